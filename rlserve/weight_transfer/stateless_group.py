"""vLLM's `StatelessProcessGroup`: the metadata side of vLLM's weight-transfer group, on the wire as vLLM has it.

The protocol (vLLM 0.24.0 and 0.33.0 alike, `vllm/distributed/utils.py`): rank 0 serves a `TCPStore` built with
`world_size` (its constructor waits until every rank has connected; each rank's constructor counts itself) and
`use_libuv=False`; objects travel as pickles under `send_to/{dst}/{n}` (point to point) and `broadcast_from/{src}/{n}`
(one writer, every other rank reads), each key numbered by a per-peer counter on both sides; a barrier broadcasts
`barrier_{uuid4}` and then sets `arrival_{id}_{rank}` and `departure_{id}_{rank}`. `PyNcclCommunicator` broadcasts
the `ncclUniqueId` rank 0 minted as the group's first broadcast (`broadcast_from/0/0`).

What arrives is decoded by a restricted unpickler: plain data (None, bool, int, float, str, bytes, list, tuple, dict,
set), torch dtypes and `torch.Size` (prime-rl's per-state-dict metadata) and `ncclUniqueId`, nothing else, so a peer (or
anyone who reaches the store's port) cannot make this process run code by what it puts there. vLLM's tensor methods
(`broadcast`, `send`, `recv`, `all_reduce`: pickled tensors, which unpickle through `torch.load`) are refused by name.
"""

from __future__ import annotations

import io
import pickle
import socket
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from rlserve.weight_transfer.nccl_library import NCCL_UNIQUE_ID_BYTES, ncclUniqueId, unique_id_from_bytes

VLLM_UNIQUE_ID_MODULE = "vllm.distributed.device_communicators.pynccl_wrapper"
# The class's paths a pickle may name: vLLM's, and rlserve's (a peer pickling rlserve's class by plain pickle).
UNIQUE_ID_MODULES = (
    VLLM_UNIQUE_ID_MODULE,
    "rlserve.distributed.device_communicators.pynccl_wrapper",
    ncclUniqueId.__module__,
)
DEFAULT_DATA_EXPIRATION_S = 3600
DEFAULT_STORE_TIMEOUT_S = 300
_POLL_S = 0.005


class _UniqueIdClass:
    """What the unpickler hands back for the class `ncclUniqueId`: an inert token that only `_rebuild_ctypes`
    accepts, so a pickle cannot set attributes on (or otherwise use) a real class."""

    __slots__ = ()


_UNIQUE_ID_CLASS = _UniqueIdClass()


def _rebuild_ctypes(cls: object, state: object) -> ncclUniqueId:
    """`_ctypes._unpickle(cls, (dict, bytes))`, the reduction of a ctypes structure, for `ncclUniqueId` only."""
    if (
        cls is not _UNIQUE_ID_CLASS
        or not isinstance(state, tuple)
        or len(state) != 2
        or state[0] != {}
        or not isinstance(state[1], bytes)
        or len(state[1]) != NCCL_UNIQUE_ID_BYTES
    ):
        raise pickle.UnpicklingError(f"a ctypes object other than an {NCCL_UNIQUE_ID_BYTES}-byte ncclUniqueId")
    return unique_id_from_bytes(state[1])


class _StoreUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_ctypes", "_unpickle"):
            return _rebuild_ctypes
        if name == "ncclUniqueId" and module in UNIQUE_ID_MODULES:
            return _UNIQUE_ID_CLASS
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refused {module}.{name}: the weight-transfer store carries plain data, torch dtypes and sizes, and "
            "ncclUniqueId only"
        )


def decode_store_value(data: bytes) -> Any:
    """A value a peer put in the store, unpickled without resolving any global but ncclUniqueId's reduction."""
    try:
        return _StoreUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise ValueError(f"weight-transfer store: malformed or disallowed value: {e}") from e
    except Exception as e:  # truncated or garbled bytes raise anything from EOFError to KeyError
        raise ValueError(f"weight-transfer store: undecodable value: {type(e).__name__}: {e}") from e


# vLLM's peers unpickle `ncclUniqueId` by its vLLM path: an rlserve rank 0 writes exactly the bytes vLLM 0.33's
# `pickle.dumps(ncclUniqueId)` writes (protocol 4, one frame), so a vLLM engine can join a group rlserve serves.
_VLLM_UNIQUE_ID_PICKLE_HEAD = (
    b"\x80\x04\x95" + (236).to_bytes(8, "little")
    + b"\x8c\x07_ctypes\x94\x8c\t_unpickle\x94\x93\x94"
    + b"\x8c" + bytes([len(VLLM_UNIQUE_ID_MODULE)]) + VLLM_UNIQUE_ID_MODULE.encode() + b"\x94"
    + b"\x8c\x0cncclUniqueId\x94\x93\x94}\x94C" + bytes([NCCL_UNIQUE_ID_BYTES])
)  # fmt: skip
_VLLM_UNIQUE_ID_PICKLE_TAIL = b"\x94\x86\x94\x86\x94R\x94."


def encode_store_value(obj: Any) -> bytes:
    if isinstance(obj, ncclUniqueId):
        return _VLLM_UNIQUE_ID_PICKLE_HEAD + bytes(obj) + _VLLM_UNIQUE_ID_PICKLE_TAIL
    return pickle.dumps(obj)


def connect_store(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's store as vLLM builds it: rank 0 serves it on a socket it binds itself (SO_REUSEADDR, so a port a
    previous group just released binds again); every rank passes `world_size`, which makes the server's constructor
    wait for all of them."""
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world_size=world_size, is_master=False, timeout=timeout, use_libuv=False)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen()
    except OSError:
        listener.close()
        raise
    fd = listener.detach()
    try:
        return dist.TCPStore(
            host, port, world_size=world_size, is_master=True, timeout=timeout, use_libuv=False, master_listen_fd=fd
        )
    except Exception:
        socket.close(fd)
        raise


@dataclass
class StatelessProcessGroup:
    """A group's metadata channel over a `TCPStore`, without torch.distributed's global state. `create` joins one;
    data-plane tensors go through a `PyNcclCommunicator` built on it."""

    rank: int
    world_size: int
    store: dist.Store
    data_expiration_seconds: int = DEFAULT_DATA_EXPIRATION_S
    send_dst_counter: dict[int, int] = field(default_factory=dict)
    recv_src_counter: dict[int, int] = field(default_factory=dict)
    broadcast_send_counter: int = 0
    broadcast_recv_src_counter: dict[int, int] = field(default_factory=dict)
    entries: deque[tuple[str, float]] = field(default_factory=deque)  # keys this rank wrote, oldest first

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of world_size {self.world_size}")
        self.send_dst_counter = dict.fromkeys(range(self.world_size), 0)
        self.recv_src_counter = dict.fromkeys(range(self.world_size), 0)
        self.broadcast_recv_src_counter = dict.fromkeys(range(self.world_size), 0)

    @staticmethod
    def create(
        host: str,
        port: int,
        rank: int,
        world_size: int,
        data_expiration_seconds: int = DEFAULT_DATA_EXPIRATION_S,
        store_timeout: int = DEFAULT_STORE_TIMEOUT_S,
    ) -> StatelessProcessGroup:
        """Join as `rank`; rank 0 serves the store. Returns once every rank has connected."""
        store = connect_store(host, port, rank, world_size, store_timeout)
        return StatelessProcessGroup(rank, world_size, store, data_expiration_seconds)

    def _put(self, key: str, obj: Any) -> None:
        self.expire_data()
        self.store.set(key, encode_store_value(obj))
        self.entries.append((key, time.time()))

    def expire_data(self) -> None:
        """Delete the keys this rank wrote more than `data_expiration_seconds` ago."""
        while self.entries and time.time() - self.entries[0][1] > self.data_expiration_seconds:
            self.store.delete_key(self.entries.popleft()[0])

    def send_obj(self, obj: Any, dst: int) -> None:
        self._put(f"send_to/{dst}/{self.send_dst_counter[dst]}", obj)
        self.send_dst_counter[dst] += 1

    def recv_obj(self, src: int) -> Any:
        obj = decode_store_value(self.store.get(f"send_to/{self.rank}/{self.recv_src_counter[src]}"))
        self.recv_src_counter[src] += 1
        return obj

    def broadcast_obj(self, obj: Any | None, src: int) -> Any:
        """Rank `src` publishes `obj` and returns it; every other rank returns what `src` published."""
        if self.rank == src:
            self._put(f"broadcast_from/{src}/{self.broadcast_send_counter}", obj)
            self.broadcast_send_counter += 1
            return obj
        key = f"broadcast_from/{src}/{self.broadcast_recv_src_counter[src]}"
        obj = decode_store_value(self.store.get(key))
        self.broadcast_recv_src_counter[src] += 1
        return obj

    def all_gather_obj(self, obj: Any) -> list[Any]:
        return [self.broadcast_obj(obj if src == self.rank else None, src=src) for src in range(self.world_size)]

    def barrier(self, timeout: float = 30.0) -> None:
        """Every rank arrives, then departs; rank 0 (the store's server) returns last and deletes the keys."""
        barrier_id = self.broadcast_obj(f"barrier_{uuid.uuid4()}" if self.rank == 0 else None, src=0)
        if not isinstance(barrier_id, str):
            raise ValueError(f"barrier: rank 0 broadcast {type(barrier_id).__name__}, not a barrier id")
        self.store.set(f"arrival_{barrier_id}_{self.rank}", b"1")
        self._wait_for_all(f"arrival_{barrier_id}", timeout)
        self.store.set(f"departure_{barrier_id}_{self.rank}", b"1")
        if self.rank != 0:
            return
        self._wait_for_all(f"departure_{barrier_id}", timeout)
        for rank in range(self.world_size):
            self.store.delete_key(f"arrival_{barrier_id}_{rank}")
            self.store.delete_key(f"departure_{barrier_id}_{rank}")

    def _wait_for_all(self, prefix: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        missing = [f"{prefix}_{rank}" for rank in range(self.world_size)]
        while missing:
            missing = [key for key in missing if not self.store.check([key])]
            if missing and time.monotonic() > deadline:
                raise RuntimeError(f"barrier timed out after {timeout:.2f} s waiting for {missing}")
            time.sleep(_POLL_S if missing else 0)

    def broadcast(self, *_: Any, **__: Any) -> NoReturn:
        _refuse_tensor_method("broadcast")

    def send(self, *_: Any, **__: Any) -> NoReturn:
        _refuse_tensor_method("send")

    def recv(self, *_: Any, **__: Any) -> NoReturn:
        _refuse_tensor_method("recv")

    def all_reduce(self, *_: Any, **__: Any) -> NoReturn:
        _refuse_tensor_method("all_reduce")


def _refuse_tensor_method(name: str) -> NoReturn:
    raise NotImplementedError(
        f"StatelessProcessGroup.{name}: not supported in rlserve; vLLM moves these tensors as pickles, which only "
        "general unpickling (torch.load) decodes. Send tensors through a PyNcclCommunicator, or plain lists through "
        "broadcast_obj / send_obj"
    )
