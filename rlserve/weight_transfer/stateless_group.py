"""An engine worker's end (a rank > 0) of a trainer's group formed the way vLLM's `StatelessProcessGroup` and
`PyNcclCommunicator` form it, which prime-rl's and PipelineRL's trainers use for their weight broadcasts.

vLLM's wire facts: rank 0 (the trainer) serves a `TCPStore` at host:port for `world_size` ranks; an object is
broadcast by setting `broadcast_from/{src}/{n}` (n counts that sender's broadcasts) to its pickle. On CUDA,
`PyNcclCommunicator` has rank 0 broadcast its NCCL unique id that way, every rank joins the NCCL communicator with
it, and a one-element all-reduce warms it up; tensors then travel by NCCL broadcast, in the sender's dtype.

Pickles from the store are decoded by `decode_store_object`, which builds only the few types these senders put
there (containers, numbers, strings, torch dtypes and sizes, vLLM's `ncclUniqueId`), never arbitrary objects.

On CPU (tests, no NCCL) the tensors travel over gloo instead: rlserve's `WeightTransferGroup` on the same store, as
bytes. That half is rlserve's convention; a CPU trainer must use the same (tests/server/framework_senders.py does).
"""

from __future__ import annotations

import ctypes
import io
import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlserve.weight_transfer.nccl import WeightTransferGroup, _trainer_lost, receive_broadcast
from rlserve.weight_transfer.packed import as_bytes

_VLLM_UNIQUE_ID = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")
_CPU_PREFIX = "rlserve/gloo"


class NcclUniqueId(ctypes.Structure):
    """The layout of vLLM's `ncclUniqueId` (128 opaque bytes), which its pickle restores."""

    _fields_ = [("internal", ctypes.c_byte * 128)]


class _StoreUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == _VLLM_UNIQUE_ID:
            return NcclUniqueId
        if (module, name) == ("_ctypes", "_unpickle"):
            return _unpickle_unique_id
        raise ValueError(f"the trainer's store holds a {module}.{name}, which no weight broadcast sends")


def _unpickle_unique_id(cls: type, state: tuple) -> NcclUniqueId:
    """ctypes' restore (`_ctypes._unpickle(cls, (__dict__, raw bytes))`), for the unique id only."""
    if cls is not NcclUniqueId:
        raise ValueError(f"the trainer's store holds a ctypes {cls!r}, not an NCCL unique id")
    raw = state[1] if isinstance(state, tuple) and len(state) == 2 else None
    if not isinstance(raw, bytes) or len(raw) != ctypes.sizeof(NcclUniqueId):
        raise ValueError("the trainer's store holds an NCCL unique id that is not 128 bytes")
    return NcclUniqueId.from_buffer_copy(raw)


def decode_store_object(data: bytes) -> Any:
    """A pickle a vLLM-style trainer wrote, restricted to the types above (ValueError for anything else)."""
    try:
        return _StoreUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"the trainer's store holds something that is not a weight-broadcast object: {e}") from e


class _Done:
    """A completed (CUDA: enqueued on the current stream) broadcast: the Work shape `wait()` for callers."""

    def wait(self) -> None:
        """Nothing to wait for on the host: later work on the stream is ordered after it."""


class StatelessGroupMember:
    """This worker's rank in the trainer's group. `broadcast(tensor)` receives `tensor` in place from rank 0."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self._received = 0  # broadcast_from/0/{n}: rank 0's broadcasts read so far
        self._cpu: WeightTransferGroup | None = None
        self._nccl: Any = None
        if device.type == "cuda":
            self._join_nccl()
        else:
            self._cpu = WeightTransferGroup(
                dist.PrefixStore(_CPU_PREFIX, store), rank, world_size, timedelta(seconds=timeout_s)
            )

    @classmethod
    def join(
        cls, host: str, port: int, rank: int, world_size: int, device: torch.device, timeout_s: float
    ) -> StatelessGroupMember:
        """Join as `rank` (> 0); blocks until the trainer's store is up and every rank has joined."""
        if not 0 < rank < world_size:
            raise ValueError(f"rank {rank} is outside 1..{world_size - 1} (rank 0 is the trainer)")
        try:
            # A client of the trainer's store; world_size, so it counts itself in (the trainer waits for all).
            store = dist.TCPStore(
                host, port, world_size=world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
            )
        except (dist.DistError, RuntimeError) as e:
            raise ConnectionError(
                f"the trainer's store at {host}:{port} did not answer within {timeout_s:g} s: {e}"
            ) from e
        return cls(store, rank, world_size, device, timeout_s)

    def receive_object(self) -> Any:
        """Rank 0's next `broadcast_obj`, decoded by `decode_store_object`."""
        key = f"broadcast_from/0/{self._received}"
        try:
            data = self.store.get(key)
        except dist.DistError as e:
            raise _trainer_lost(e, self.timeout_s) from e
        self._received += 1
        return decode_store_object(data)

    def _join_nccl(self) -> None:
        unique_id = self.receive_object()
        if not isinstance(unique_id, NcclUniqueId):
            raise ValueError(f"the trainer's first broadcast object is {type(unique_id).__name__}, not its NCCL id")
        with torch.cuda.device(self.device):
            self._nccl = torch.cuda.nccl.init_rank(self.world_size, bytes(unique_id.internal), self.rank)
            warm_up = torch.zeros(1, device=self.device)  # PyNcclCommunicator's own warm-up all-reduce
            torch.cuda.nccl.all_reduce([warm_up], comms=[self._nccl])
            torch.cuda.current_stream(self.device).synchronize()

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start receiving `tensor` (contiguous) from rank 0; returns a Work whose `wait()` completes it."""
        if self._cpu is not None:
            return receive_broadcast(self._cpu, as_bytes(tensor), self.timeout_s)
        torch.cuda.nccl.broadcast([tensor], root=0, comms=[self._nccl])
        return _Done()

    def shutdown(self) -> None:
        if self._cpu is not None:
            self._cpu.shutdown()
        self._cpu = self._nccl = None
