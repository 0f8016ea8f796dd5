"""A trainer process on vLLM's weight-transfer wire, for the tests that update a real `rlserve serve` with it.

What it does is what vLLM's trainer-side NCCL sender does, read from vLLM 0.33.0's wheel (identical in 0.24.0):
- `vllm/distributed/utils.py`, `StatelessProcessGroup.create`: rank 0 binds the port itself (SO_REUSEADDR) and serves
  a `TCPStore(host, port, world_size=..., is_master=True, timeout=300 s, use_libuv=False, master_listen_fd=...)`,
  whose constructor returns once every rank has connected; `broadcast_obj(obj, src)` on the source sets
  `broadcast_from/{src}/{n}` to `pickle.dumps(obj)`, n counting its broadcasts from 0.
- `vllm/distributed/device_communicators/pynccl.py`, `PyNcclCommunicator.__init__`: rank 0 mints an `ncclUniqueId`
  (`pynccl_wrapper.py`: a ctypes structure, one field `internal` of 128 `c_byte`) and sends it as its first
  `broadcast_obj`, then `ncclCommInitRank` and a one-element float32 all-reduce (the warm-up).
- `vllm/distributed/weight_transfer/packed_tensor.py`, `pack_tensors` / `packed_nccl_broadcast_producer`: each tensor
  flattened to uint8 and appended; the chunk closes once its total exceeds `buffer_size_bytes`; `torch.cat`; one
  broadcast per chunk. Unpacked (`nccl_engine.trainer_send_weights`): one broadcast per tensor, in its own dtype.

vLLM has no CPU data plane (its communicator disables itself without NCCL), so on CPU the data plane is rlserve's
stand-in for `ncclCommInitRank`: a gloo group over the same store under `gloo_prefix(unique id)`, with the same warm-up.

With `RLSERVE_TEST_VLLM_SRC` naming directories (os.pathsep-separated) that hold vLLM's source and the few packages
its modules import, vLLM's own `StatelessProcessGroup`, `ncclUniqueId` and `pack_tensors` run instead of the replay
(checked with 0.24.0 and 0.33.0). To build them:
    pip download --no-deps vllm==0.33.0 -d /tmp/w && unzip -q /tmp/w/vllm-*.whl '*.py' -d /tmp/vllm-src
    pip install --no-deps --target /tmp/vllm-deps psutil cbor2 aiohttp multidict yarl propcache aiohappyeyeballs \
        aiosignal frozenlist openai_harmony pybase64
    RLSERVE_TEST_VLLM_SRC=/tmp/vllm-src:/tmp/vllm-deps pytest tests/server/test_server_vllm_trainer.py

Protocol with the parent, one line each way: prints `joined` once the group is formed; then for each line
`send FILE PACKED BUFFER_BYTES` it broadcasts FILE's tensors (sorted by name) and prints `sent`; `exit` ends it.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import socket
import sys
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlserve.weight_transfer.pynccl import gloo_prefix

VLLM_WRAPPER = "vllm.distributed.device_communicators.pynccl_wrapper"
STORE_TIMEOUT_S = 300  # StatelessProcessGroup.create's store_timeout default


class ReplayStatelessProcessGroup:
    """vLLM's `StatelessProcessGroup`, the parts a sending rank 0 uses."""

    def __init__(self, rank: int, world_size: int, store: dist.TCPStore) -> None:
        self.rank, self.world_size, self.store = rank, world_size, store
        self.broadcast_send_counter = 0

    @staticmethod
    def create(host: str, port: int, rank: int, world_size: int) -> ReplayStatelessProcessGroup:
        assert rank == 0, "the replay is the trainer's side"
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen()
        store = dist.TCPStore(
            host_name=host,
            port=port,
            master_listen_fd=listener.detach(),
            world_size=world_size,
            is_master=True,
            timeout=timedelta(seconds=STORE_TIMEOUT_S),
            use_libuv=False,
        )
        return ReplayStatelessProcessGroup(rank, world_size, store)

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        assert self.rank == src
        self.store.set(f"broadcast_from/{src}/{self.broadcast_send_counter}", pickle.dumps(obj))
        self.broadcast_send_counter += 1
        return obj


def replay_unique_id_class() -> type[ctypes.Structure]:
    """vLLM's `ncclUniqueId`, under vLLM's module path, so `pickle.dumps` writes the bytes vLLM's rank 0 writes."""

    class ncclUniqueId(ctypes.Structure):  # noqa: N801
        _fields_ = [("internal", ctypes.c_byte * 128)]

    ncclUniqueId.__module__, ncclUniqueId.__qualname__ = VLLM_WRAPPER, "ncclUniqueId"
    parts = VLLM_WRAPPER.split(".")
    for depth in range(1, len(parts) + 1):  # pickle imports the module by name: its packages must resolve too
        sys.modules.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
    sys.modules[VLLM_WRAPPER].ncclUniqueId = ncclUniqueId
    return ncclUniqueId


def replay_pack_chunks(iterator: Iterator[tuple[str, torch.Tensor]], buffer_size_bytes: int) -> Iterator[torch.Tensor]:
    """`pack_tensors`, called until the iterator is exhausted, as `packed_nccl_broadcast_producer` does."""
    while True:
        parts, total = [], 0
        for _name, tensor in iterator:
            flat = tensor.contiguous().view(-1).view(torch.uint8)
            parts.append(flat)
            total += flat.numel()
            if total > buffer_size_bytes:
                break
        if not parts:
            return
        yield torch.cat(parts, dim=0)


def vllm_pieces() -> tuple[Callable[..., Any], type[ctypes.Structure], Callable[..., Iterator[torch.Tensor]]]:
    """(StatelessProcessGroup.create, ncclUniqueId, chunks): vLLM's own where its source is given, else the replay."""
    source = os.environ.get("RLSERVE_TEST_VLLM_SRC")
    if not source:
        return ReplayStatelessProcessGroup.create, replay_unique_id_class(), replay_pack_chunks
    sys.path[:0] = source.split(os.pathsep)
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    def chunks(iterator: Iterator[tuple[str, torch.Tensor]], buffer_size_bytes: int) -> Iterator[torch.Tensor]:
        while (chunk := pack_tensors(iterator, lambda item: item[1], buffer_size_bytes)) is not None:
            yield chunk.packed_tensor

    return StatelessProcessGroup.create, ncclUniqueId, chunks


def main(port: int, world_size: int) -> None:
    create_group, unique_id_class, chunks = vllm_pieces()
    group = create_group(host="127.0.0.1", port=port, rank=0, world_size=world_size)
    unique_id = unique_id_class()
    ctypes.memmove(ctypes.addressof(unique_id), os.urandom(128), 128)
    group.broadcast_obj(unique_id, src=0)
    gloo = dist.ProcessGroupGloo(
        dist.PrefixStore(gloo_prefix(bytes(unique_id)), group.store), 0, world_size, timedelta(seconds=60)
    )
    gloo.allreduce([torch.zeros(1)]).wait()
    print("joined", flush=True)

    def broadcast(tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        gloo.broadcast([tensor], opts).wait()

    for line in sys.stdin:
        command, *args = line.split()
        if command == "exit":
            break
        path, packed, buffer_bytes = args[0], args[1] == "1", int(args[2])
        weights = load_file(path)
        items = iter([(name, weights[name]) for name in sorted(weights)])
        for tensor in chunks(items, buffer_bytes) if packed else (t for _, t in items):
            broadcast(tensor)
        print("sent", flush=True)
    gloo.abort()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
