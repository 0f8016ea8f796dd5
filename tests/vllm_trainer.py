"""A trainer process that runs vLLM's own trainer-side code, for the tests that update a real `rlserve serve` with it:
`python vllm_trainer.py PORT WORLD_SIZE VLLM_PATH`, VLLM_PATH the release's source (and what goes beside it) as
tests/vllm_source.py finds it, os.pathsep-separated.

What runs is vLLM's (the same in 0.24.0 and 0.33.0):
- `vllm/distributed/utils.py`, `StatelessProcessGroup.create`: rank 0 binds the port itself (SO_REUSEADDR) and serves
  a `TCPStore(..., is_master=True, timeout=300 s, use_libuv=False, master_listen_fd=...)`, whose constructor returns
  once every rank has connected; `broadcast_obj(obj, src)` sets `broadcast_from/{src}/{n}` to `pickle.dumps(obj)`.
- `vllm/distributed/device_communicators/pynccl_wrapper.py`, `ncclUniqueId` (a ctypes structure of 128 bytes): rank 0
  sends one as its first `broadcast_obj`, as `PyNcclCommunicator.__init__` does before `ncclCommInitRank` and a
  one-element float32 all-reduce (the warm-up).
- `vllm/distributed/weight_transfer/packed_tensor.py`, `pack_tensors`, called until the iterator is exhausted as
  `packed_nccl_broadcast_producer` does: one broadcast per chunk. Unpacked (`nccl_engine.trainer_send_weights`): one
  broadcast per tensor, in its own dtype.

vLLM has no CPU data plane (its communicator disables itself without NCCL), so the data plane is rlserve's CPU stand-in
for `ncclCommInitRank`: a gloo group over the same store under `gloo_prefix(unique id)`, with the same warm-up.

Protocol with the parent, one line each way: prints `joined FILE` once the group is formed (FILE: where the
`StatelessProcessGroup` that formed it was defined); then for each line `send FILE PACKED BUFFER_BYTES` it broadcasts
FILE's tensors (sorted by name) and prints `sent`; for `pickle HEX` (128 bytes) it prints `pickled HEX`, the pickle of
vLLM's `ncclUniqueId` holding them; `exit` ends it.

`replay_rank0_store` and `replay_unique_id_class` are vLLM's store server and unique-id class written from
the facts above, for tests that need a hostile trainer or vLLM's pickle bytes inside the test process (where importing
vLLM's own package would shadow rlserve's `vllm` surface for the tests after); the `pickle` command checks those bytes
against vLLM's own class.
"""

from __future__ import annotations

import ctypes
import inspect
import os
import pickle
import socket
import sys
import types
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlserve.weight_transfer.pynccl import gloo_prefix

VLLM_WRAPPER = "vllm.distributed.device_communicators.pynccl_wrapper"
STORE_TIMEOUT_S = 300  # StatelessProcessGroup.create's store_timeout default


def replay_rank0_store(host: str, port: int, world_size: int) -> dist.TCPStore:
    """The store vLLM's `StatelessProcessGroup.create` serves on rank 0; returns once every rank has connected."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen()
    return dist.TCPStore(
        host_name=host,
        port=port,
        master_listen_fd=listener.detach(),
        world_size=world_size,
        is_master=True,
        timeout=timedelta(seconds=STORE_TIMEOUT_S),
        use_libuv=False,
    )


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


def main(port: int, world_size: int, vllm_path: str) -> None:
    sys.path[:0] = vllm_path.split(os.pathsep)
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    def chunks(iterator: Iterator[tuple[str, torch.Tensor]], buffer_size_bytes: int) -> Iterator[torch.Tensor]:
        while (chunk := pack_tensors(iterator, lambda item: item[1], buffer_size_bytes)) is not None:
            yield chunk.packed_tensor

    group = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=0, world_size=world_size)
    unique_id = ncclUniqueId()
    ctypes.memmove(ctypes.addressof(unique_id), os.urandom(128), 128)
    group.broadcast_obj(unique_id, src=0)
    gloo = dist.ProcessGroupGloo(
        dist.PrefixStore(gloo_prefix(bytes(unique_id)), group.store), 0, world_size, timedelta(seconds=60)
    )
    gloo.allreduce([torch.zeros(1)]).wait()
    print("joined", inspect.getsourcefile(StatelessProcessGroup), flush=True)

    def broadcast(tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        gloo.broadcast([tensor], opts).wait()

    for line in sys.stdin:
        command, *args = line.split()
        if command == "exit":
            break
        if command == "pickle":  # the bytes vLLM's rank 0 writes to the store for this unique id
            unique_id = ncclUniqueId()
            ctypes.memmove(ctypes.addressof(unique_id), bytes.fromhex(args[0]), 128)
            print("pickled", pickle.dumps(unique_id).hex(), flush=True)
            continue
        path, packed, buffer_bytes = args[0], args[1] == "1", int(args[2])
        weights = load_file(path)
        items = iter([(name, weights[name]) for name in sorted(weights)])
        for tensor in chunks(items, buffer_bytes) if packed else (t for _, t in items):
            broadcast(tensor)
        print("sent", flush=True)
    gloo.abort()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
