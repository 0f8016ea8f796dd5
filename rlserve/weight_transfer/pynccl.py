"""vLLM's `PyNcclCommunicator`: the data plane of vLLM's weight-transfer group, joined as vLLM's ranks join it.

The handshake (vLLM 0.24.0 and 0.33.0, `vllm/distributed/device_communicators/pynccl.py`): rank 0 mints an
`ncclUniqueId` and broadcasts it as the group's first `broadcast_obj`; every rank calls `ncclCommInitRank(world_size,
unique_id, rank)` and then a one-element float32 all-reduce (the warm-up: every peer must issue it before any other
collective). `from_unique_id_bytes` joins from an id shared out of band (`nccl_unique_id_b64`), with no store.

On a CPU device (no NCCL) the same handshake runs and the data plane is gloo instead: rank 0 mints a random id,
broadcasts it the same way, and every rank builds a gloo group over the store under a prefix derived from the id
(`gloo_prefix`), then issues the same warm-up. vLLM has no CPU data plane; this is rlserve's, for tests and CPU use.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rlserve.weight_transfer.nccl_library import (
    NCCL_UNIQUE_ID_BYTES,
    NCCLLibrary,
    ncclComm_t,
    ncclUniqueId,
    unique_id_from_bytes,
)
from rlserve.weight_transfer.packed import PackedSender
from rlserve.weight_transfer.stateless_group import DEFAULT_STORE_TIMEOUT_S

GLOO_PREFIX = "rlserve_pynccl_gloo"
_POLL_S = 0.0005


class MetadataGroup(Protocol):
    """What is used of a `StatelessProcessGroup` (rlserve's or vLLM's own)."""

    rank: int
    world_size: int
    store: dist.Store

    def broadcast_obj(self, obj: Any, src: int) -> Any: ...


class Work(Protocol):
    def wait(self) -> Any: ...


@dataclass(frozen=True)
class _StreamWork:
    """An NCCL broadcast enqueued on a stream. `wait` waits on the host until it is done, at most `timeout_s`, then
    orders the caller's current stream after it. NCCL itself never times out: a peer that died or sends nothing
    would leave the kernel spinning, so past the timeout the communicator is aborted (which ends the kernel) and
    TimeoutError raised."""

    done: torch.cuda.Event
    timeout_s: float
    abort: Callable[[], None]

    def wait(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.done.query():
            if time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(f"an NCCL broadcast did not complete within {self.timeout_s:g} s")
            time.sleep(_POLL_S)
        torch.cuda.current_stream().wait_event(self.done)


def gloo_prefix(unique_id: bytes) -> str:
    """The store prefix of a CPU group's gloo rendezvous: one per minted id, so groups on one store stay apart."""
    return f"{GLOO_PREFIX}/{unique_id[:16].hex()}"


def _as_device(device: int | str | torch.device) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"PyNcclCommunicator: a cuda or cpu device, not {device}")
    return device


class PyNcclCommunicator:
    """A group's communicator on `device`: NCCL for a CUDA device, gloo for the CPU. `group` is None for one built
    by `from_unique_id_bytes`."""

    def __init__(
        self,
        group: MetadataGroup,
        device: int | str | torch.device,
        library_path: str | None = None,
        *,
        timeout_s: float = DEFAULT_STORE_TIMEOUT_S,
    ) -> None:
        if isinstance(group, dist.ProcessGroup):
            raise TypeError(
                "PyNcclCommunicator: rlserve builds it on a StatelessProcessGroup only, not a torch ProcessGroup"
            )
        self.group: MetadataGroup | None = group
        self.rank = group.rank
        self.world_size = group.world_size
        self.device = _as_device(device)
        self.timeout_s = timeout_s
        self._prepare(library_path)
        if self.disabled:
            return
        minted = self._mint_unique_id() if self.rank == 0 else None
        unique_id = group.broadcast_obj(minted, src=0)
        # ctypes.Structure: vLLM's own group (an extension may build one) hands back vLLM's ncclUniqueId class.
        if not isinstance(unique_id, ctypes.Structure) or ctypes.sizeof(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(
                f"PyNcclCommunicator: rank 0 broadcast {type(unique_id).__name__} where an ncclUniqueId belongs"
            )
        self.unique_id = unique_id_from_bytes(bytes(unique_id))
        self._init_comm(group.store)

    @classmethod
    def from_unique_id_bytes(
        cls,
        unique_id_bytes: bytes,
        rank: int,
        world_size: int,
        device: int | str | torch.device,
        library_path: str | None = None,
        *,
        timeout_s: float = DEFAULT_STORE_TIMEOUT_S,
    ) -> PyNcclCommunicator:
        """Join from an id minted elsewhere (a torch-free trainer's `ncclGetUniqueId`). No barrier: every rank must
        enter at once. NCCL only: gloo needs a store."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is out of range for a group of world_size {world_size}")
        unique_id = unique_id_from_bytes(unique_id_bytes)  # its length is checked before the device
        self = cls.__new__(cls)
        self.group = None
        self.rank, self.world_size = rank, world_size
        self.device = _as_device(device)
        self.timeout_s = timeout_s
        if self.device.type != "cuda":
            raise ValueError(
                "nccl_unique_id_b64: joining from an NCCL unique id needs NCCL on a CUDA device; this rank's device "
                f"is {self.device} (on CPU, rendezvous over master_address/master_port instead)"
            )
        self.unique_id = unique_id
        self._prepare(library_path)
        if not self.disabled:
            self._init_comm(None)
        return self

    def _prepare(self, library_path: str | None) -> None:
        self._nccl: NCCLLibrary | None = None
        self._comm: ncclComm_t | None = None
        self._gloo: dist.ProcessGroupGloo | None = None
        # One per connection, for every update (vLLM's packed producer): its CUDA streams are made once.
        self.packed_sender = PackedSender()
        # A group of one has nothing to talk to (vLLM's rule too).
        self.disabled = self.world_size == 1
        self.available = not self.disabled
        if self.available and self.device.type == "cuda":
            self._nccl = NCCLLibrary(library_path)

    def _mint_unique_id(self) -> ncclUniqueId:
        if self._nccl is not None:
            return self._nccl.get_unique_id()
        return unique_id_from_bytes(os.urandom(NCCL_UNIQUE_ID_BYTES))

    def _init_comm(self, store: dist.Store | None) -> None:
        warmup = torch.zeros(1, device=self.device)
        if self._nccl is None:
            assert store is not None
            prefixed = dist.PrefixStore(gloo_prefix(bytes(self.unique_id)), store)
            self._gloo = dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, timedelta(seconds=self.timeout_s))
            self._gloo.allreduce([warmup]).wait()
            return
        with torch.cuda.device(self.device):
            self._comm = self._nccl.comm_init_rank(self.world_size, self.unique_id, self.rank)
            stream = torch.cuda.current_stream()
            self._nccl.all_reduce_sum(warmup, self._comm, stream)
            stream.synchronize()

    def _check_device(self, tensor: torch.Tensor) -> None:
        if tensor.device != self.device:
            raise ValueError(f"this communicator works on {self.device}, the tensor is on {tensor.device}")

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> Work:
        """Start an in-place broadcast from `src`; its Work's `wait` returns once it is done and orders the caller's
        current stream after it, or raises (gloo: RuntimeError; NCCL: TimeoutError past `timeout_s`)."""
        self._check_device(tensor)
        if self._gloo is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            return self._gloo.broadcast([tensor], opts)
        assert self._nccl is not None and self._comm is not None
        stream = torch.cuda.current_stream(self.device)
        self._nccl.broadcast(tensor, src, self._comm, stream)
        done = torch.cuda.Event()
        done.record(stream)
        return _StreamWork(done, self.timeout_s, self.destroy)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None) -> None:
        """vLLM's: enqueued on `stream` (default: the current one) on CUDA; finished on return with gloo."""
        if self.disabled:
            return
        if self._gloo is not None:
            self.broadcast_async(tensor, src).wait()
            return
        with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
            self.broadcast_async(tensor, src)

    def all_reduce(
        self,
        in_tensor: torch.Tensor,
        out_tensor: torch.Tensor | None = None,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor | None:
        """Sum across ranks into `out_tensor` (default: a new tensor); `in_tensor` is left as it was. Only SUM:
        a weight-transfer group sums its warm-up and nothing else."""
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"PyNcclCommunicator.all_reduce: op {op} is not supported in rlserve (SUM only)")
        if self.disabled:
            return None
        self._check_device(in_tensor)
        out = in_tensor.clone() if out_tensor is None else out_tensor.copy_(in_tensor)
        if self._gloo is not None:
            self._gloo.allreduce([out]).wait()
        else:
            assert self._nccl is not None and self._comm is not None
            current = torch.cuda.current_stream(self.device)
            if stream is not None and stream != current:
                stream.wait_stream(current)  # the copy into `out` was enqueued on the current stream
            self._nccl.all_reduce_sum(out, self._comm, stream or current)
        return out

    def destroy(self) -> None:
        """Abort, not a graceful destroy: that would wait for every peer to destroy too (one may be gone)."""
        if self._comm is not None and self._nccl is not None:
            self._nccl.comm_abort(self._comm)
        if self._gloo is not None:
            self._gloo.abort()
        self._comm = self._gloo = None
        self.available, self.disabled = False, True
