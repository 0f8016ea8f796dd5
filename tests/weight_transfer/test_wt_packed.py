"""Bucket planning, packing and the pipelined producer/consumer, in one process over a loopback "broadcast"."""

from __future__ import annotations

import logging
import weakref
from collections import deque

import pytest
import torch

from rlserve.weight_transfer.packed import (
    PackedReceiver,
    PackedSender,
    TensorMeta,
    pack_tensors,
    plan_buckets,
    unpack_tensors,
)

BUDGETS = (100, 1000, 10000, 100000)


def _tensors(dtypes: list[torch.dtype], seed: int = 0) -> list[torch.Tensor]:
    """Shapes with odd byte counts, a 0-d tensor and an empty one, so unaligned offsets occur in mixed packs."""
    shapes = [(7,), (3, 5), (), (33, 17), (0, 4), (1, 1, 9), (64, 64), (2,)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtypes[i % len(dtypes)]) for i, shape in enumerate(shapes * 2)]


def _metas(tensors: list[torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", t.dtype, tuple(t.shape)) for i, t in enumerate(tensors)]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_raw(a), _raw(b))


def test_plan_buckets_nonempty_input_gives_buckets() -> None:
    buckets = plan_buckets([40, 40, 40], 100)
    assert len(buckets) > 0
    assert [i for b in buckets for i in b] == [0, 1, 2]


def test_plan_buckets_closes_after_exceeding() -> None:
    # 40 + 40 = 80 stays open, + 40 = 120 exceeds the budget and closes the bucket (overshoot < one tensor).
    assert plan_buckets([40, 40, 40, 40], 100) == [[0, 1, 2], [3]]
    assert plan_buckets([50, 50, 1], 100) == [[0, 1, 2]]  # exactly at the budget does not close


def test_plan_buckets_oversized_tensor_closes_the_bucket_it_joined() -> None:
    # vLLM 0.24.0/0.33.0 packed_tensor.pack_tensors: append, then close once the total exceeds the budget; a
    # tensor larger than the budget joins the open bucket rather than travelling alone.
    assert plan_buckets([10, 500, 10], 100) == [[0, 1], [2]]
    assert plan_buckets([500, 10], 100) == [[0], [1]]


def test_plan_buckets_many_small_tensors() -> None:
    sizes = [40] * 100
    buckets = plan_buckets(sizes, 1000)
    assert len(buckets) > 1
    assert [i for b in buckets for i in b] == list(range(100))
    totals = [sum(sizes[i] for i in b) for b in buckets]
    assert sum(totals) == 4000
    assert totals == [1040, 1040, 1040, 880]


def test_plan_buckets_empty_and_bad_budget() -> None:
    assert plan_buckets([], 100) == []
    with pytest.raises(ValueError):
        plan_buckets([1], 0)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize(
    "dtypes",
    [[torch.float32], [torch.float16], [torch.bfloat16], [torch.bfloat16, torch.float32, torch.float16, torch.int64]],
    ids=["fp32", "fp16", "bf16", "mixed"],
)
def test_pack_unpack_round_trip(dtypes: list[torch.dtype], budget: int) -> None:
    tensors = _tensors(dtypes)
    metas = _metas(tensors)
    buckets = plan_buckets([m.nbytes for m in metas], budget)
    assert sum(len(b) for b in buckets) == len(tensors)
    for bucket in buckets:
        packed = pack_tensors([tensors[i] for i in bucket])
        assert packed.dtype == torch.uint8 and packed.numel() == sum(metas[i].nbytes for i in bucket)
        unpacked = unpack_tensors(packed.clone(), [metas[i] for i in bucket])
        for i, (name, tensor) in zip(bucket, unpacked, strict=True):
            assert name == metas[i].name
            assert _bitwise_equal(tensor, tensors[i]), name


def test_unpack_refuses_short_buffer() -> None:
    with pytest.raises(ValueError, match="bytes"):
        unpack_tensors(torch.zeros(3, dtype=torch.uint8), [TensorMeta("x", torch.float32, (1,))])


class _LoopbackWork:
    """Like an NCCL Work on CUDA: `wait` makes the current stream wait for the stream the operation ran on."""

    def __init__(self, link: _Loopback, tensor: torch.Tensor) -> None:
        self.link = link
        self.event = None
        if tensor.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> bool:
        self.link.outstanding -= 1
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return True


class _Loopback:
    """Stands in for a broadcast: the producer's buffers are queued by value, the consumer's receive dequeues them
    at once (the data lands when the receive is issued, so a receive into a buffer still to be loaded overwrites it).
    On CUDA the receive first sleeps on its stream, so a load not ordered after it would read the old bytes."""

    def __init__(self) -> None:
        self.queue: deque[torch.Tensor] = deque()
        self.sent = 0
        self.received = 0
        self.outstanding = 0  # receives issued and not yet waited for

    def send(self, tensor: torch.Tensor) -> _LoopbackWork:
        self.queue.append(tensor.clone())
        self.sent += 1
        return _LoopbackWork(self, tensor)

    def receive(self, tensor: torch.Tensor) -> _LoopbackWork:
        if tensor.is_cuda:
            torch.cuda._sleep(1_000_000)
        tensor.copy_(self.queue.popleft())
        self.received += 1
        self.outstanding += 1
        return _LoopbackWork(self, tensor)


class _PeakTracker:
    """Wraps a torch allocating function; records how many of its results are alive when it allocates another
    (CPython frees tensors by refcount, so this is the peak number of buffers held)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.peak = 0
        self._alive: list[weakref.ref[torch.Tensor]] = []
        real = getattr(torch, name)

        def tracked(*args: object, **kwargs: object) -> torch.Tensor:
            self.peak = max(self.peak, 1 + sum(r() is not None for r in self._alive))
            out = real(*args, **kwargs)
            self._alive.append(weakref.ref(out))
            return out

        monkeypatch.setattr(torch, name, tracked)


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_buffers", [1, 2, 3])
@pytest.mark.parametrize("packed", [True, False])
def test_pipelined_send_receive(num_buffers: int, packed: bool, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the producer packs and sends on one cached stream per slot."""
    tensors = [t.to(device) for t in _tensors([torch.bfloat16, torch.float32, torch.float16], seed=1)]
    metas = _metas(tensors)
    budget = 300  # several multi-tensor buckets plus oversized ones
    buckets = plan_buckets([m.nbytes for m in metas], budget)
    assert len([b for b in buckets if len(b) > 1]) > 3
    link = _Loopback()
    loaded: list[tuple[str, torch.Tensor]] = []
    calls: list[int] = []
    in_flight_at_load: list[int] = []

    def load_weights(batch: list[tuple[str, torch.Tensor]]) -> None:
        calls.append(len(batch))
        in_flight_at_load.append(link.outstanding)
        loaded.extend((name, t.clone()) for name, t in batch)  # copies out, as the contract says

    with monkeypatch.context() as patch:
        packs = _PeakTracker(patch, "cat")  # the producer's packed buffers of multi-tensor buckets
        if packed:
            PackedSender().send(iter(tensors), link.send, budget, num_buffers)
        else:
            for t in tensors:  # the unpacked sender: one broadcast per tensor
                link.send(_raw(t))
        link.outstanding = 0
    with monkeypatch.context() as patch:
        receive_buffers = _PeakTracker(patch, "empty")
        PackedReceiver().receive(metas, link.receive, load_weights, budget, num_buffers, torch.device(device), packed)
    assert not link.queue
    assert link.sent == link.received == (len(buckets) if packed else len(tensors))
    assert [name for name, _ in loaded] == [m.name for m in metas]
    for (name, got), want in zip(loaded, tensors, strict=True):
        assert got.device.type == device and _bitwise_equal(got, want), name
    assert calls == [len(b) for b in buckets]
    # Each bucket is loaded while the next num_buffers - 1 are being received (none with one buffer).
    tail = [min(num_buffers - 1, len(buckets) - 1 - i) for i in range(len(buckets))]
    sends = [1 if packed else len(b) for b in buckets]
    assert in_flight_at_load == [sum(sends[i + 1 : i + 1 + n]) for i, n in enumerate(tail)]
    assert receive_buffers.peak == min(num_buffers, len(buckets))  # the receiver's buffers, allocated once
    if packed:  # at most num_buffers packed buckets alive on the sender
        assert 0 < packs.peak <= num_buffers


def test_send_packed_warns_about_oversized_tensor(caplog: pytest.LogCaptureFixture) -> None:
    link = _Loopback()
    sender = PackedSender()
    with caplog.at_level(logging.WARNING):
        sender.send(iter([torch.zeros(100), torch.zeros(2)]), link.send, 64, 2)
        sender.send(iter([torch.zeros(100), torch.zeros(2)]), link.send, 64, 2)
    assert caplog.text.count("exceeds the packed buffer size") == 1  # once per sender, not at every training step
    for _ in range(2):
        assert [link.queue.popleft().numel() for _ in range(2)] == [400, 8]


def test_empty_update_sends_nothing() -> None:
    link = _Loopback()
    PackedSender().send(iter([]), link.send, 64, 2)
    PackedReceiver().receive([], link.receive, lambda _: pytest.fail("nothing"), 64, 2, torch.device("cpu"), True)
    assert link.sent == link.received == 0


@pytest.mark.parametrize("packed", [True, False])
def test_receive_drains_the_update_when_load_fails(packed: bool) -> None:
    tensors = _tensors([torch.float32], seed=2)
    metas = _metas(tensors)
    link = _Loopback()
    if packed:
        PackedSender().send(iter(tensors), link.send, 300, 2)
    else:
        for t in tensors:
            link.send(_raw(t))
    calls = 0

    def failing_load(batch: list[tuple[str, torch.Tensor]]) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("loader bug")

    with pytest.raises(RuntimeError, match="loader bug"):
        PackedReceiver().receive(metas, link.receive, failing_load, 300, 2, torch.device("cpu"), packed)
    assert calls == 1 and not link.queue  # every byte the trainer sent was taken off the wire
