"""Broadcast backend (`nccl`): the trainer's rank 0 and every inference worker join one process group of their own.

The group is stateless with respect to `torch.distributed`: a `TCPStore` rendezvous (the trainer, rank 0, serves
it) and process-group backends built directly on that store, so neither process's default group is created or
touched. CUDA tensors travel over NCCL and CPU tensors over gloo, through the same code; a backend is created for a
device type the first time a tensor of that type is broadcast (on a CPU-only machine only gloo ever exists).

The engine's side also joins the group vLLM's trainer forms (`StatelessProcessGroup` + `PyNcclCommunicator`:
`stateless_group.py`, `pynccl.py`), with the same init_info: after connecting to the trainer's store it reads which
handshake the trainer started (vLLM's publishes its NCCL unique id at `broadcast_from/0/0`; rlserve's counts
arrivals under its prefix). vLLM's torch-free form, `nccl_unique_id_b64`, joins NCCL directly (CUDA only).

Blocking: `init_transfer_engine` (engine) and `trainer_init` (trainer) each block until every rank has joined, and
`receive_weights` blocks until `trainer_send_weights` has sent everything, so each pair must run concurrently: the
trainer issues the engine call (HTTP, RPC) on a thread while it joins or sends on its own thread.

Trainer side, with the engine's update metadata sent as `update_info` (names, dtype_names, shapes, packed...):

    group = NCCLWeightTransferEngine.trainer_init({"master_address": host, "master_port": port, "world_size": 2})
    NCCLWeightTransferEngine.trainer_send_weights(model.named_parameters(), NCCLTrainerSendWeightsArgs(group=group))
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rlserve.config import WeightTransferConfig
from rlserve.weight_transfer.base import (
    LoadWeightsFn,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from rlserve.weight_transfer.nccl_library import NCCL_UNIQUE_ID_BYTES
from rlserve.weight_transfer.packed import PackedReceiver, PackedSender, as_bytes, tensor_metas
from rlserve.weight_transfer.pynccl import PyNcclCommunicator, Work
from rlserve.weight_transfer.stateless_group import StatelessProcessGroup, connect_store

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
DEFAULT_PACKED_NUM_BUFFERS = 2
DEFAULT_TIMEOUT_S = 600.0
# Ranks in one weight-transfer group, at most: far more than any trainer and its inference workers, and within the
# C int torch.distributed counts ranks in (a larger one made the store's constructor raise a TypeError: a 500).
MAX_WORLD_SIZE = 1 << 16
_STORE_PREFIX = "rlserve/weight_transfer"
_ARRIVED = "arrived"
_RLSERVE_ARRIVED_KEY = f"{_STORE_PREFIX}/{_ARRIVED}"  # PrefixStore joins with "/"
_VLLM_UNIQUE_ID_KEY = "broadcast_from/0/0"  # vLLM's PyNcclCommunicator: rank 0's first broadcast_obj
_PROTOCOL_POLL_S = 0.01


class _Backend(Protocol):
    """What is used of `ProcessGroupGloo` / `ProcessGroupNCCL` (c10d backends, which have no public common type)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def abort(self) -> None: ...


class WeightTransferGroup:
    """A process group of its own over a `TCPStore`: `broadcast` picks NCCL for CUDA tensors, gloo for CPU ones."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._backends: dict[str, _Backend] = {}
        self.packed_sender = PackedSender()  # the trainer's: its streams serve every update

    @classmethod
    def create(
        cls, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> WeightTransferGroup:
        """Join the group as `rank`; blocks until all `world_size` ranks have joined. Rank 0 serves the store."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
        try:
            # multi_tenant: the trainer may already serve a store on this port (e.g. its own torch.distributed
            # rendezvous); the prefix below keeps the two key spaces apart.
            tcp_store = dist.TCPStore(
                master_address,
                master_port,
                is_master=rank == 0,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
                multi_tenant=True,
            )
        except dist.DistError as e:
            raise _rendezvous_timeout(master_address, master_port, rank, world_size, timeout_s, e) from e
        return cls.join(tcp_store, master_address, master_port, rank, world_size, timeout_s)

    @classmethod
    def join(
        cls, tcp_store: dist.Store, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float
    ) -> WeightTransferGroup:
        """The rendezvous over a connected store (the address only names it in errors)."""
        timeout = timedelta(seconds=timeout_s)
        try:
            store = dist.PrefixStore(_STORE_PREFIX, tcp_store)
            # A store that outlives a group (multi-tenant, or a trainer that re-inits) still holds the previous
            # group's keys: count arrivals and give each group its own generation prefix.
            arrived = store.add(_ARRIVED, 1)
            generation = (arrived - 1) // world_size
            ready = f"{generation}/ready"
            if arrived % world_size == 0:
                store.set(ready, "1")
            store.wait([ready], timeout)
        except dist.DistError as e:
            raise _rendezvous_timeout(master_address, master_port, rank, world_size, timeout_s, e) from e
        return cls(dist.PrefixStore(str(generation), store), rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start an in-place broadcast of a contiguous tensor from rank `src`; returns its Work (wait() on it). It
        travels as bytes: the same on the wire, and gloo has no bfloat16 or float8 type."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self._backend(tensor.device).broadcast([as_bytes(tensor)], opts)

    def _backend(self, device: torch.device) -> _Backend:
        kind = device.type
        backend = self._backends.get(kind)
        if backend is None:
            store = dist.PrefixStore(f"backend{len(self._backends)}", self.store)
            self._check_same_device_type(store, kind)
            if kind == "cuda":
                backend = dist.ProcessGroupNCCL(store, self.rank, self.world_size, self.timeout)
            elif kind == "cpu":
                backend = dist.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)
            else:
                raise ValueError(f"weight transfer broadcasts CUDA (NCCL) or CPU (gloo) tensors, not {kind}")
            self._backends[kind] = backend
        return backend

    def _check_same_device_type(self, store: dist.Store, kind: str) -> None:
        # A trainer sending CPU tensors to an engine receiving on CUDA would build gloo on one side and NCCL on the
        # other and hang until the timeout; compare first and fail with the reason instead.
        store.set(f"device_type/{self.rank}", kind)
        kinds = {r: store.get(f"device_type/{r}").decode() for r in range(self.world_size)}
        if len(set(kinds.values())) > 1:
            raise RuntimeError(
                f"weight-transfer ranks disagree on the device type of the tensors (rank: type) {kinds}; the trainer "
                "must send tensors on the same kind of device (cuda or cpu) as the engine receives into"
            )

    def destroy(self) -> None:
        """vLLM's name (its group's, `PyNcclCommunicator.destroy`), which the engines call: `shutdown`."""
        self.shutdown()

    def shutdown(self) -> None:
        # abort, not shutdown: NCCL's graceful destroy waits for every rank to destroy too, so an engine shutting
        # down while its trainer lives (or is gone) would hang. Nothing is in flight here: each broadcast was waited on.
        for backend in self._backends.values():
            backend.abort()
        self._backends.clear()


@dataclass(kw_only=True)
class NCCLWeightTransferInitInfo(WeightTransferInitInfo):
    """Rendezvous parameters, in one of vLLM 0.33's two forms: `master_address` + `master_port` (a TCPStore the
    trainer, rank 0, serves: rlserve's trainer classes or vLLM's own, told apart by what the trainer writes to the
    store), or `nccl_unique_id_b64` (standard base64 of the 128 bytes of an `ncclGetUniqueId` a torch-free trainer
    minted; NCCL only, no store). `world_size` counts the trainer's rank 0 and every inference worker; a worker's
    rank is `rank_offset` + its index. The packed fields are vLLM 0.33's handshake-time wire parameters; 0.24
    trainers send them per update instead, which takes precedence."""

    master_address: str | None = None
    master_port: int | None = None
    world_size: int
    rank_offset: int = 1
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    nccl_unique_id_b64: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.nccl_unique_id_b64 is None:
            if not isinstance(self.master_address, str) or not self.master_address:
                raise ValueError(
                    f"master_address must be a host name or address, got {self.master_address!r}; trainers without a "
                    "TCPStore need nccl_unique_id_b64 instead"
                )
            if type(self.master_port) is not int or not 0 < self.master_port < 65536:
                raise ValueError(f"master_port must be an int in 1..65535, got {self.master_port!r}")
        else:
            if self.master_address is not None or self.master_port is not None:
                raise ValueError("nccl_unique_id_b64: pass it OR master_address/master_port, not both")
            _ = self.nccl_unique_id_bytes
        if type(self.world_size) is not int or not 2 <= self.world_size <= MAX_WORLD_SIZE:
            raise ValueError(
                f"world_size must be an int in 2..{MAX_WORLD_SIZE} (trainer + workers), got {self.world_size!r}"
            )
        if type(self.rank_offset) is not int or not 1 <= self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset must be in 1..world_size-1, got {self.rank_offset!r}")
        if self.packed_buffer_size_bytes < 1 or self.packed_num_buffers < 1:
            raise ValueError("packed_buffer_size_bytes and packed_num_buffers must be >= 1")

    @property
    def nccl_unique_id_bytes(self) -> bytes | None:
        if self.nccl_unique_id_b64 is None:
            return None
        try:
            # Standard base64 only, as vLLM: a URL-safe encoding is refused rather than mis-decoded.
            raw = base64.b64decode(self.nccl_unique_id_b64, validate=True)
        except (ValueError, TypeError) as e:
            raise ValueError("nccl_unique_id_b64 is not valid standard base64 (URL-safe base64 is not accepted)") from e
        if len(raw) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"nccl_unique_id_b64 must decode to {NCCL_UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        return raw


@dataclass
class NCCLWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Metadata of the tensors the trainer broadcasts, in order. `packed_buffer_size_bytes` must equal the
    trainer's; None takes the init info's value. The update is packed if this or the init info says so. As in vLLM
    0.33, empty `names`/`dtype_names`/`shapes` reuse the previous update's metadata (a trainer that sends the same
    parameters every round ships them once)."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    packed: bool = False
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None
    # vLLM 0.24's sparse form on this backend: parsed and checked as 0.24 does, refused by the engine (rlserve's sparse
    # updates travel over the `sparse_nccl` backend, vLLM 0.33's form).
    update_kind: str = field(default="dense", kw_only=True)
    num_updates_list: list[int] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_update_kind(self.update_kind, self.num_updates_list, len(self.names), self.packed)
        if self.packed_buffer_size_bytes is not None and self.packed_buffer_size_bytes < 1:
            raise ValueError(f"packed_buffer_size_bytes must be >= 1, got {self.packed_buffer_size_bytes}")
        if self.packed_num_buffers is not None and self.packed_num_buffers < 1:
            raise ValueError(f"packed_num_buffers must be >= 1, got {self.packed_num_buffers}")


@dataclass(frozen=True)
class NCCLTrainerSendWeightsArgs:
    """Trainer-side send parameters. `packed` and `packed_buffer_size_bytes` must match the update info the engine
    gets; `post_iter_func` maps each `(name, tensor)` item to the tensor to send (default: the tensor); `stream` is
    the CUDA stream for unpacked sends (default: the current one)."""

    group: WeightTransferGroup
    src: int = 0
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None
    packed: bool = False
    stream: torch.cuda.Stream | None = None
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


def _check_update_kind(kind: str, num_updates_list: list[int] | None, count: int, packed: bool) -> None:
    """vLLM 0.24's checks of an update's `update_kind` and its sparse metadata, with its messages."""
    if kind not in ("dense", "sparse_flat"):
        raise ValueError(f"Unsupported update_kind: {kind}")
    if kind == "dense":
        if num_updates_list is not None:
            raise ValueError("Sparse metadata is only supported for `update_kind='sparse_flat'`")
        return
    if num_updates_list is None:
        raise ValueError("`num_updates_list` is required for sparse updates")
    if not num_updates_list:
        raise ValueError("`num_updates_list` cannot be empty for sparse updates")
    if any(n < 0 for n in num_updates_list):
        raise ValueError("Sparse `num_updates_list` entries must be non-negative")
    if len(num_updates_list) != count:
        raise ValueError(
            f"`num_updates_list` should be of the same size as `names`: got {len(num_updates_list)} and {count}"
        )
    if packed:
        raise ValueError("`update_kind='sparse_flat'` cannot be combined with `packed=True`")


def _discard(_: list[tuple[str, torch.Tensor]]) -> None:
    """`load_weights` of a discarded update: the bytes were received, nothing is kept."""


class NCCLWeightTransferEngine(WeightTransferEngine[NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo]):
    init_info_cls = NCCLWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: Any = None,
        device: torch.device | str | None = None,
        model: torch.nn.Module | None = None,
        *,
        worker_index: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """`(config, device)` or vLLM 0.33's `(config, vllm_config, device, model)`; the rest as in `create_engine`."""
        super().__init__(config, vllm_config, device, model)
        self.worker_index = worker_index
        self.timeout_s = timeout_s
        self.model_update_group: TransferGroup | None = None  # joined by init_transfer_engine
        # The wire parameters, from the trainer's init_info at the handshake (vLLM 0.33; 0.24's per-update ones win)
        self.packed = False
        self.packed_buffer_size_bytes = DEFAULT_PACKED_BUFFER_SIZE_BYTES
        self.packed_num_buffers = DEFAULT_PACKED_NUM_BUFFERS
        self._last_metadata: tuple[list[str], list[str], list[list[int]]] | None = None
        self._receiver = PackedReceiver()  # its CUDA streams serve every update, across re-inits

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        """Joins the trainer's group; blocks until the trainer (rank 0) has called `trainer_init`."""
        self.shutdown()  # a second init (new trainer run) replaces the old group
        self.model_update_group = join_worker_group(init_info, self.worker_index, self.timeout_s, self.device)
        self.packed = init_info.packed
        self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
        self.packed_num_buffers = init_info.packed_num_buffers

    def parse_init_info(self, init_info: dict[str, Any]) -> NCCLWeightTransferInitInfo:
        return check_unique_id_device(super().parse_init_info(init_info), self.device)

    def parse_update_info(self, update_info: dict[str, Any]) -> NCCLWeightTransferUpdateInfo:
        info = super().parse_update_info(update_info)
        if info.update_kind != "dense":
            raise ValueError(
                f"Invalid update_info for {type(self).__name__}: update_kind={info.update_kind!r}: the nccl backend "
                "receives dense updates; send sparse patches over the sparse_nccl backend "
                "(WeightTransferConfig(backend='sparse_nccl'), vLLM 0.33's form)"
            )
        return info

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo, load_weights: LoadWeightsFn | None = None):
        """Either call shape: vLLM 0.24's (with `load_weights`) or 0.33's (see `target_load_weights`)."""
        self._receive(update_info, self.target_load_weights(load_weights))

    def discard_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        self._receive(update_info, _discard)

    def _receive(self, update_info: NCCLWeightTransferUpdateInfo, load_weights: LoadWeightsFn) -> None:
        group = self.model_update_group
        if group is None:
            raise self._not_initialized()
        if update_info.names:
            self._last_metadata = (update_info.names, update_info.dtype_names, update_info.shapes)
        elif self._last_metadata is not None:
            names, dtype_names, shapes = self._last_metadata
            update_info = replace(update_info, names=names, dtype_names=dtype_names, shapes=shapes)
        self._receiver.receive(
            tensor_metas(update_info),
            lambda tensor: receive_broadcast(group, tensor, self.timeout_s),
            load_weights,
            _first_set(update_info.packed_buffer_size_bytes, self.packed_buffer_size_bytes),
            _first_set(update_info.packed_num_buffers, self.packed_num_buffers),
            self.device,
            packed=update_info.packed or self.packed,
        )

    def shutdown(self) -> None:
        if self.model_update_group is not None:
            self.model_update_group.destroy()
            self.model_update_group = None
        self._last_metadata = None

    @staticmethod
    def trainer_init(init_info: Mapping[str, Any]) -> WeightTransferGroup:
        """Trainer side: join (and serve) the group as rank 0. Reads `master_address`, `master_port`, `world_size`
        and, optionally, `timeout_s`; other keys (the engine's `rank_offset`, packed fields) are ignored. Blocks
        until every worker has joined, so issue the engines' `init_weight_transfer_engine` concurrently."""
        return WeightTransferGroup.create(
            init_info["master_address"],
            int(init_info["master_port"]),
            0,
            int(init_info["world_size"]),
            float(init_info.get("timeout_s", DEFAULT_TIMEOUT_S)),
        )

    @staticmethod
    def trainer_send_weights(
        iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: NCCLTrainerSendWeightsArgs | dict[str, Any]
    ) -> None:
        """Trainer side: broadcast the tensors in iteration order (the order of the engine's update_info). Returns
        once every broadcast has completed."""
        args = (
            trainer_args
            if isinstance(trainer_args, NCCLTrainerSendWeightsArgs)
            else NCCLTrainerSendWeightsArgs(**trainer_args)
        )
        post = args.post_iter_func or (lambda item: item[1])
        group = args.group
        if args.packed:
            group.packed_sender.send(
                (post(item) for item in iterator),
                lambda t: group.broadcast(t, src=args.src),
                args.packed_buffer_size_bytes,
                args.packed_num_buffers,
            )
            return
        last_stream: torch.cuda.Stream | None = None
        for item in iterator:
            tensor = post(item)
            if not tensor.is_cuda:
                group.broadcast(tensor.contiguous(), src=args.src).wait()
                continue
            current = torch.cuda.current_stream(tensor.device)
            stream = args.stream or current
            if stream != current:
                # A side stream must see the tensor finished, and the allocator must not recycle a temporary
                # tensor on the current stream while the side stream still reads it.
                stream.wait_stream(current)
                tensor.record_stream(stream)
            with torch.cuda.stream(stream):
                group.broadcast(tensor.contiguous(), src=args.src).wait()  # on CUDA a stream wait, not a host wait
            last_stream = stream
        if last_stream is not None:
            last_stream.synchronize()


def check_unique_id_device(init_info: NCCLWeightTransferInitInfo, device: torch.device) -> NCCLWeightTransferInitInfo:
    """Refuse the unique-id form where there is no NCCL, before anything waits for the trainer."""
    if init_info.nccl_unique_id_b64 is not None and device.type != "cuda":
        raise ValueError(
            f"nccl_unique_id_b64: joining from an NCCL unique id needs NCCL, and this engine's weights are on "
            f"{device}; rendezvous over master_address/master_port instead (gloo on CPU)"
        )
    return init_info


def join_worker_group(
    init_info: NCCLWeightTransferInitInfo, worker_index: int, timeout_s: float, device: torch.device
) -> TransferGroup:
    """An engine worker's place in the trainer's group: rank `rank_offset` + its index among the workers. Which
    trainer serves the store decides the protocol: vLLM's trainer (`StatelessProcessGroup` + `PyNcclCommunicator`)
    publishes the NCCL unique id as its first broadcast; rlserve's counts arrivals under its own prefix."""
    rank = init_info.rank_offset + worker_index
    unique_id = init_info.nccl_unique_id_bytes
    if unique_id is not None:
        communicator = PyNcclCommunicator.from_unique_id_bytes(
            unique_id, rank, init_info.world_size, device, timeout_s=timeout_s
        )
        return VLLMWireGroup(communicator)
    assert init_info.master_address is not None and init_info.master_port is not None
    address, port, world_size = init_info.master_address, init_info.master_port, init_info.world_size
    try:
        # Every rank passes world_size: vLLM's server waits in its constructor until all ranks have counted in.
        store = connect_store(address, port, rank, world_size, timeout_s)
        protocol = _trainer_protocol(store, timeout_s)
    except (dist.DistError, TimeoutError) as e:
        raise _rendezvous_timeout(address, port, rank, world_size, timeout_s, e) from e
    if protocol == "rlserve":
        return WeightTransferGroup.join(store, address, port, rank, world_size, timeout_s)
    group = StatelessProcessGroup(rank, world_size, store)
    return VLLMWireGroup(PyNcclCommunicator(group, device, timeout_s=timeout_s))


def _trainer_protocol(store: dist.Store, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([_VLLM_UNIQUE_ID_KEY]):
            return "vllm"
        if store.check([_RLSERVE_ARRIVED_KEY]):
            return "rlserve"
        if time.monotonic() > deadline:
            raise TimeoutError("the trainer joined the store but started neither rlserve's nor vLLM's handshake")
        time.sleep(_PROTOCOL_POLL_S)


class VLLMWireGroup:
    """The receiving end of vLLM's group, shaped as `WeightTransferGroup` is for the receive path."""

    def __init__(self, communicator: PyNcclCommunicator) -> None:
        self.communicator = communicator

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Work:
        return self.communicator.broadcast_async(tensor, src)

    def destroy(self) -> None:
        self.communicator.destroy()


TransferGroup = WeightTransferGroup | VLLMWireGroup


def receive_broadcast(group: TransferGroup, tensor: torch.Tensor, timeout_s: float) -> _ReceiveWork:
    """Start receiving `tensor` from the trainer; a trainer that never set up its side reads as TRAINER_LOST."""
    try:
        return _ReceiveWork(group.broadcast(tensor, src=0), timeout_s)
    except dist.DistError as e:  # the store: the trainer never set up its side within the timeout
        raise _trainer_lost(e, timeout_s) from e


class _ReceiveWork:
    """A receiving broadcast whose failure reads as what it is: the trainer's process closed its connections (it
    died: gloo's "Connection closed by peer") or sent nothing within the timeout. Both backends raise a plain
    RuntimeError; the engine abandons the update on TRAINER_LOST."""

    def __init__(self, work: Work, timeout_s: float) -> None:
        self.work = work
        self.timeout_s = timeout_s

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as e:
            raise _trainer_lost(e, self.timeout_s) from e


def _trainer_lost(error: BaseException, timeout_s: float) -> ConnectionError:
    return ConnectionError(f"the trainer (rank 0) is gone or sent nothing within {timeout_s:g} s: {error}")


def _rendezvous_timeout(
    address: str, port: int, rank: int, world_size: int, timeout_s: float, error: BaseException
) -> RuntimeError:
    return RuntimeError(
        f"weight-transfer rendezvous at {address}:{port} (rank {rank} of {world_size}) did not complete within "
        f"{timeout_s:g} s: {error}"
    )


def _first_set(value: int | None, default: int) -> int:
    return default if value is None else value
