"""An engine worker's end (a rank > 0) of a trainer's group formed the way vLLM's `StatelessProcessGroup` and
`PyNcclCommunicator` form it, which prime-rl's and PipelineRL's trainers use for their weight broadcasts.

vLLM's wire facts (stateless_group.py): rank 0 (the trainer) serves a `TCPStore` at host:port for `world_size`
ranks and broadcasts objects as pickles under `broadcast_from/{src}/{n}`. On CUDA, rank 0 broadcasts its NCCL unique
id that way first, every rank joins the NCCL communicator with it, and a one-element all-reduce warms it up; tensors
then travel by NCCL broadcast, in the sender's dtype. What the store holds is decoded by `decode_store_value`, never
by general unpickling.

On CPU (tests, no NCCL) the tensors travel over gloo instead: rlserve's `WeightTransferGroup` on the same store, as
bytes. That half is rlserve's convention; a CPU trainer must use the same (tests/server/framework_senders.py does).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlserve.weight_transfer.nccl import WeightTransferGroup, _trainer_lost, receive_broadcast
from rlserve.weight_transfer.nccl_library import ncclUniqueId
from rlserve.weight_transfer.packed import as_bytes
from rlserve.weight_transfer.stateless_group import decode_store_value

_CPU_PREFIX = "rlserve/gloo"


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
        """Rank 0's next `broadcast_obj`, decoded by `decode_store_value`."""
        key = f"broadcast_from/0/{self._received}"
        try:
            data = self.store.get(key)
        except dist.DistError as e:
            raise _trainer_lost(e, self.timeout_s) from e
        self._received += 1
        return decode_store_value(data)

    def _join_nccl(self) -> None:
        unique_id = self.receive_object()
        if not isinstance(unique_id, ncclUniqueId):
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
        torch.cuda.nccl.broadcast([as_bytes(tensor)], root=0, comms=[self._nccl])  # fp8 too (same bytes as typed)
        return _Done()

    def shutdown(self) -> None:
        if self._cpu is not None:
            self._cpu.shutdown()
        self._cpu = self._nccl = None
