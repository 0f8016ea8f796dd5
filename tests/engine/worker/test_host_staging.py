"""The pinned staging allocator's bookkeeping (pinning itself needs a GPU; the logic does not)."""

from __future__ import annotations

import torch

from rlserve.engine.worker.host_staging import HostStaging


def _staging(nbytes: int = 4096) -> HostStaging:
    return HostStaging(nbytes, torch.device("cpu"), pin_memory=False)


def _owner(staging: HostStaging, t: torch.Tensor) -> int | None:
    for i, half in enumerate(staging.halves):
        if half.data_ptr() <= t.data_ptr() < half.data_ptr() + half.numel():
            return i
    return None


def test_slices_are_aligned_disjoint_and_hold_values() -> None:
    staging = _staging()
    staging.next_step()
    a = staging.to_device(torch.tensor([1, 2, 3], dtype=torch.int32))
    b = staging.to_device(torch.tensor([[4.5, 5.5]], dtype=torch.float64))
    c = staging.empty((5,), torch.int64)
    assert a.tolist() == [1, 2, 3] and b.tolist() == [[4.5, 5.5]] and c.shape == (5,)
    ptrs = [t.data_ptr() for t in (a, b, c)]
    assert all(p % 64 == 0 for p in ptrs)
    assert ptrs[0] + a.nbytes <= ptrs[1] and ptrs[1] + b.nbytes <= ptrs[2]


def test_steps_alternate_halves_and_restart_at_the_front() -> None:
    staging = _staging()
    staging.next_step()
    first = staging.empty((8,), torch.int64)
    staging.next_step()
    second = staging.empty((8,), torch.int64)
    staging.next_step()
    third = staging.empty((8,), torch.int64)
    assert _owner(staging, first) != _owner(staging, second)
    assert third.data_ptr() == first.data_ptr()  # reused two steps later, from the start of its half


def test_a_step_larger_than_its_half_gets_fresh_memory() -> None:
    staging = _staging(256)
    staging.next_step()
    inside = staging.empty((16,), torch.int64)  # 128 bytes
    outside = staging.empty((64,), torch.int64)  # 512 bytes: more than is left
    assert _owner(staging, inside) is not None and _owner(staging, outside) is None
    assert staging.to_host(torch.arange(64)).tolist() == list(range(64))
