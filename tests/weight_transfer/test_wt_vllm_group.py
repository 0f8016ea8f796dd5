"""vLLM's group at rlserve's vLLM-shaped paths: `StatelessProcessGroup` (vLLM 0.33.0's store keys, decoded by a
restricted unpickler) and `PyNcclCommunicator` (on CPU: gloo over the same store), ranks on threads of one process."""

from __future__ import annotations

import ctypes
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from vllm_trainer import replay_unique_id_class

from rlserve.distributed.device_communicators.pynccl import PyNcclCommunicator
from rlserve.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
from rlserve.distributed.utils import StatelessProcessGroup
from rlserve.engine.wire.process import free_port
from rlserve.weight_transfer.nccl_library import unique_id_from_bytes
from rlserve.weight_transfer.stateless_group import decode_store_value, encode_store_value

T = TypeVar("T")
TIMEOUT_S = 60


def _on_ranks(world_size: int, work: Callable[[StatelessProcessGroup], T]) -> list[T]:
    """`work` on every rank of a fresh group, each on its own thread (rank 0 serves the store). The groups live
    until every rank is done: the store's server goes with rank 0's."""
    port = free_port()
    groups: list[StatelessProcessGroup] = []

    def rank(r: int) -> T:
        group = StatelessProcessGroup.create("127.0.0.1", port, r, world_size, store_timeout=TIMEOUT_S)
        groups.append(group)
        return work(group)

    with ThreadPoolExecutor(world_size) as pool:
        return [f.result(TIMEOUT_S) for f in [pool.submit(rank, r) for r in range(world_size)]]


@contextmanager
def _vllm_unique_id_class() -> Iterator[type[ctypes.Structure]]:
    """The replay of vLLM's class under vLLM's module path, registered only for the block (no `vllm` leaks out)."""
    before = {k for k in sys.modules if k == "vllm" or k.startswith("vllm.")}
    try:
        yield replay_unique_id_class()
    finally:
        for name in [k for k in sys.modules if (k == "vllm" or k.startswith("vllm.")) and k not in before]:
            del sys.modules[name]


def _vllm_pickle_of(raw: bytes) -> bytes:
    with _vllm_unique_id_class() as cls:
        unique_id = cls()
        ctypes.memmove(ctypes.addressof(unique_id), raw, len(raw))
        return pickle.dumps(unique_id)


def test_unique_id_travels_as_vllm_pickles_it() -> None:
    raw = os.urandom(128)
    vllm_bytes = _vllm_pickle_of(raw)
    assert encode_store_value(unique_id_from_bytes(raw)) == vllm_bytes  # a vLLM engine can read rlserve's rank 0
    decoded = decode_store_value(vllm_bytes)
    assert isinstance(decoded, ncclUniqueId) and bytes(decoded) == raw
    assert bytes(decode_store_value(pickle.dumps(unique_id_from_bytes(raw)))) == raw  # rlserve's class path too


class _Payload:
    def __init__(self, reduce: tuple) -> None:
        self.reduce = reduce

    def __reduce__(self) -> tuple:
        return self.reduce


def test_decoder_refuses_whatever_is_not_plain_data(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    refused = {
        "posix.mkdir": pickle.dumps(_Payload((os.mkdir, (str(marker),)))),
        "builtins.eval": pickle.dumps(_Payload((eval, ("1",)))),
        "collections.OrderedDict": pickle.dumps(__import__("collections").OrderedDict(a=1)),
        "torch._utils": pickle.dumps(torch.zeros(1)),
    }
    for name, data in refused.items():
        with pytest.raises(ValueError, match=f"refused {name}"):
            decode_store_value(data)
    assert not marker.exists()
    # _ctypes._unpickle for anything but a 128-byte unique id: another class, a short id, extra state.
    with _vllm_unique_id_class() as cls:
        good = pickle.dumps(cls())
    for bad in (
        good.replace(b"ncclUniqueId", b"ncclUniqueIx"),
        good.replace(b"C\x80" + bytes(128), b"C\x7f" + bytes(127)),
        good.replace(b"}\x94", b"}\x94(\x8c\x01a\x94K\x01u", 1),
    ):
        with pytest.raises(ValueError, match="weight-transfer store"):
            decode_store_value(bad)
    for garbage in (b"", b"\x80\x04\x95", b"not a pickle"):
        with pytest.raises(ValueError, match="weight-transfer store"):
            decode_store_value(garbage)
    plain = {"phase": "ready", "ranks": [0, 1], "ok": True, "x": 1.5, "raw": b"\x00", "t": (None,), "s": {1}}
    assert decode_store_value(pickle.dumps(plain)) == plain


def test_group_keys_and_collectives_between_ranks() -> None:
    def work(group: StatelessProcessGroup) -> dict[str, Any]:
        got: dict[str, Any] = {"first": group.broadcast_obj({"from": 0} if group.rank == 0 else None, src=0)}
        if group.rank == 0:
            group.send_obj(["to", 2], dst=2)
        if group.rank == 2:
            got["received"] = group.recv_obj(src=0)
        got["gathered"] = group.all_gather_obj(f"rank {group.rank}")
        if group.rank == 1:
            # vLLM's keys, numbered per source: rank 0's second broadcast was its all_gather entry.
            got["keys"] = [decode_store_value(group.store.get(k)) for k in ("broadcast_from/0/0", "broadcast_from/0/1")]
        group.barrier(timeout=TIMEOUT_S)
        return got

    results = _on_ranks(3, work)
    assert [r["first"] for r in results] == [{"from": 0}] * 3
    assert results[2]["received"] == ["to", 2]
    assert all(r["gathered"] == ["rank 0", "rank 1", "rank 2"] for r in results)
    assert results[1]["keys"] == [{"from": 0}, "rank 0"]


def test_tensor_methods_of_the_store_are_refused_by_name() -> None:
    group = StatelessProcessGroup(0, 2, store=None)  # type: ignore[arg-type]  # refused before any store use
    for method in ("broadcast", "send", "recv", "all_reduce"):
        with pytest.raises(NotImplementedError, match=f"StatelessProcessGroup.{method}: not supported"):
            getattr(group, method)(torch.zeros(1), 0)


def test_communicator_on_cpu_broadcasts_and_sums_over_gloo() -> None:
    def work(group: StatelessProcessGroup) -> tuple[torch.Tensor, torch.Tensor, PyNcclCommunicator]:
        comm = PyNcclCommunicator(group, device="cpu", timeout_s=TIMEOUT_S)
        data = torch.arange(6, dtype=torch.bfloat16) if group.rank == 0 else torch.zeros(6, dtype=torch.bfloat16)
        comm.broadcast(data, src=0)
        return data, comm.all_reduce(torch.full((2,), float(group.rank + 1))), comm

    results = _on_ranks(2, work)
    for data, total, _ in results:
        assert torch.equal(data, torch.arange(6, dtype=torch.bfloat16))
        assert torch.equal(total, torch.full((2,), 3.0))
    assert bytes(results[0][2].unique_id) == bytes(results[1][2].unique_id)  # every rank joined on rank 0's id
    for _, _, comm in results:
        comm.destroy()


def test_communicator_refuses_what_it_cannot_join() -> None:
    with pytest.raises(ValueError, match="nccl_unique_id_b64: joining from an NCCL unique id needs NCCL"):
        PyNcclCommunicator.from_unique_id_bytes(bytes(128), rank=1, world_size=2, device="cpu")
    with pytest.raises(ValueError, match="op .* is not supported in rlserve"):
        PyNcclCommunicator(StatelessProcessGroup(0, 1, store=None), device="cpu").all_reduce(  # type: ignore[arg-type]
            torch.zeros(1), op=torch.distributed.ReduceOp.MAX
        )
    with pytest.raises(ValueError, match="expected a 128-byte NCCL unique id, got 3 bytes"):
        unique_id_from_bytes(b"abc")

    def bad_id(group: StatelessProcessGroup) -> str:
        if group.rank == 0:
            group.broadcast_obj("not an id", src=0)
            return ""
        with pytest.raises(ValueError, match="rank 0 broadcast str where an ncclUniqueId belongs") as e:
            PyNcclCommunicator(group, device="cpu")
        return str(e.value)

    assert _on_ranks(2, bad_id)[1]
