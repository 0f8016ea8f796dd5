"""The trainer's end of vLLM's weight-transfer group from the helpers that vLLM 0.28+'s trainers call directly
(`nccl_common.trainer_init`, `packed_tensor.packed_nccl_broadcast_producer`; TRL's `VLLMClient` and async GRPO do):
rlserve's `StatelessProcessGroup` and `PyNcclCommunicator` on vLLM's wire, so an engine joins it with the same
init_info whether it is vLLM or rlserve. On a machine without CUDA the communicator runs over gloo
(`pynccl.py`), which rlserve's engine speaks on the CPU and vLLM does not."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from rlserve.weight_transfer.base import current_device
from rlserve.weight_transfer.nccl import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS
from rlserve.weight_transfer.pynccl import PyNcclCommunicator
from rlserve.weight_transfer.stateless_group import DEFAULT_STORE_TIMEOUT_S, StatelessProcessGroup

_RENDEZVOUS_FIELDS = ("master_address", "master_port", "world_size")


def _rendezvous(init_info: Any) -> tuple[str, int, int]:
    """vLLM's `NCCLRendezvous`: a mapping or any object with the three fields."""
    if isinstance(init_info, Mapping):
        missing = [f for f in _RENDEZVOUS_FIELDS if f not in init_info]
        values = [init_info.get(f) for f in _RENDEZVOUS_FIELDS]
    else:
        missing = [f for f in _RENDEZVOUS_FIELDS if not hasattr(init_info, f)]
        values = [getattr(init_info, f, None) for f in _RENDEZVOUS_FIELDS]
    if missing:
        raise ValueError(f"trainer_init: init_info lacks {missing} ({type(init_info).__name__})")
    address, port, world_size = values
    if not isinstance(address, str) or not address:
        raise ValueError(f"trainer_init: master_address must be a host name or address, got {address!r}")
    for name, value in (("master_port", port), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"trainer_init: {name} must be an int, got {value!r}")
    if not 0 < port < 65536:
        raise ValueError(f"trainer_init: master_port {port} is not a TCP port")
    if world_size < 2:
        raise ValueError(f"trainer_init: world_size {world_size} leaves no rank for an engine worker")
    return address, port, world_size


def trainer_init(init_info: Any, rank: int = 0, *, timeout_s: float = DEFAULT_STORE_TIMEOUT_S) -> PyNcclCommunicator:
    """Join (as `rank`; rank 0 serves the store) the group at `master_address:master_port` of `world_size` ranks,
    vLLM's way: a `StatelessProcessGroup`, then a `PyNcclCommunicator` on the current device. Blocks until every
    rank has joined, so the engines' `init_weight_transfer_engine` must be in flight."""
    address, port, world_size = _rendezvous(init_info)
    group = StatelessProcessGroup.create(address, port, rank, world_size, store_timeout=int(timeout_s))
    return PyNcclCommunicator(group, current_device(), timeout_s=timeout_s)


def packed_nccl_broadcast_producer(
    iterator: Iterator[tuple[str, torch.Tensor]],
    group: PyNcclCommunicator,
    src: int,
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
) -> None:
    """Broadcast `post_iter_func(item)` of every item from `src`, packed into uint8 buckets by vLLM's rule (the
    engine's consumer splits them where vLLM's would), `num_buffers` buckets in flight. Returns once every
    broadcast has completed."""
    if not isinstance(group, PyNcclCommunicator):
        raise TypeError(
            "packed_nccl_broadcast_producer: group must be the PyNcclCommunicator from trainer_init (or built on a "
            f"StatelessProcessGroup), got {type(group).__name__}"
        )
    group.packed_sender.send(
        (post_iter_func(item) for item in iterator),
        lambda tensor: group.broadcast_async(tensor, src),
        buffer_size_bytes,
        num_buffers,
    )
