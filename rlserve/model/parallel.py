"""The tensor-parallel group the sharded layers (rlserve.model.layers) communicate over.

A group of its own over a store, like the weight-transfer group: process-group backends built directly on the store
(gloo for CPU tensors, NCCL for CUDA ones), so no process's default `torch.distributed` group is created or touched
(a trainer in the same process keeps its own). The group is passed to every layer explicitly; the default group,
`TensorParallelGroup()`, is one rank with no backend, whose collectives return their input.

Summation order. An all-reduce of two ranks adds each element once (a + b, which IEEE arithmetic makes equal to
b + a), so its result is the same bits on both ranks, run to run and whatever the message size (batch). For more
ranks, NCCL's ring and tree pick their order by message size, so `deterministic=True` (batch-invariant mode)
replaces the all-reduce by an all-gather and a sum in rank order, which depends on nothing but the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(eq=False)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    deterministic: bool = False  # see the module docstring
    store: dist.Store | None = None
    timeout: timedelta = timedelta(seconds=600)
    _backends: dict[str, object] = field(default_factory=dict, repr=False)

    @classmethod
    def join(
        cls,
        store: dist.Store,
        rank: int,
        size: int,
        timeout_s: float,
        deterministic: bool = False,
        prefix: str = "rlserve/tp",
    ) -> TensorParallelGroup:
        """Rank `rank`'s end of the group over `store` (rank 0's `serve_store`, or a client of it). The
        expert-parallel group (rlserve.model.expert_parallel) is one too, under its own `prefix`."""
        return cls(rank, size, deterministic, dist.PrefixStore(prefix, store), timedelta(seconds=timeout_s))

    def _backend(self, device: torch.device):
        kind = device.type
        backend = self._backends.get(kind)
        if backend is None:
            store = dist.PrefixStore(kind, self.store)
            if kind == "cuda":
                backend = dist.ProcessGroupNCCL(store, self.rank, self.size, self.timeout)
            elif kind == "cpu":
                backend = dist.ProcessGroupGloo(store, self.rank, self.size, self.timeout)
            else:
                raise ValueError(f"tensor parallel runs on CUDA (NCCL) or CPU (gloo), not {kind}")
            self._backends[kind] = backend
        return backend

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (in place where the backend works in place)."""
        if self.size == 1:
            return x
        if self.deterministic and self.size > 2:
            parts = self.all_gather(x.unsqueeze(0), dim=0)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            return total
        x = x.contiguous()
        self._backend(x.device).allreduce([x], dist.AllreduceOptions()).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.size)]
        self._backend(x.device).allgather([out], [x]).wait()
        return torch.cat(out, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x of rank `src`, in place on every rank (x must be contiguous)."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            opts.rootTensor = 0
            self._backend(x.device).broadcast([x], opts).wait()
        return x

    def min(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values (each rank sizes its KV cache from its own free memory)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._backend(t.device).allreduce([t], opts).wait()
        return int(t.item())

    def shutdown(self) -> None:
        # abort, not a graceful destroy: NCCL's waits for every rank, which a dead peer never does.
        for backend in self._backends.values():
            backend.abort()
        self._backends.clear()


def serve_store(address: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store for a new group, on a free port (`.port`); it must outlive the group."""
    return dist.TCPStore(
        address, 0, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=False
    )


def store_client(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout_s))
