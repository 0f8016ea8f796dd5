"""CUDA IPC backend (`ipc`): a colocated trainer shares its GPU tensors with the engine on the same GPU.

The trainer exports each tensor (or, packed, one staging buffer) with `torch.multiprocessing.reductions
.reduce_tensor`; the engine maps it with `rebuild_cuda_tensor` (a zero-copy view) and loads from it. Handles travel
as plain JSON-able data (rlserve.weight_transfer.ipc_handles): never pickle, so an `update_weights` body cannot
execute code.

`ipc_handles` is keyed by GPU UUID (`str(torch.cuda.get_device_properties(i).uuid)`), so an FSDP trainer can merge
the dicts of all its ranks and every engine worker picks its own GPU's entry.

CUDA IPC bookkeeping: every export must be mapped and released exactly once by the receiver, or the trainer's
memory stays pinned in torch's IPC limbo. Packed transfers export one buffer per sync; the engine maps it on the
first chunk and releases it after the last one (`is_last_chunk`), when a different buffer arrives, or at shutdown.
vLLM mapped it per chunk and leaked one buffer per sync (#51258). A trainer that keeps its staging buffer across
syncs (`IPCStagingBuffer`) exports it once and marks its chunks `keep_mapped`: the engine then keeps the one mapping
for every later sync from that buffer (opening and closing a CUDA IPC mapping, and the export, cost milliseconds
per sync) and releases it when a different buffer arrives, a chunk comes without `keep_mapped`, or at shutdown.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from rlserve.config import WeightTransferConfig
from rlserve.dtypes import dtype_name
from rlserve.weight_transfer.base import (
    LoadWeightsFn,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from rlserve.weight_transfer.ipc_handles import ARG_INDEX, decode_rebuild_args, export_tensor, gpu_uuid
from rlserve.weight_transfer.packed import TensorMeta, as_bytes, tensor_metas, unpack_tensors
from rlserve.weight_transfer.source import WeightSource
from rlserve.weight_transfer.trainer import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    check_single_sender,
    checked_iter,
)

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
HTTP_TIMEOUT_S = 300.0

# --- Trainer side -------------------------------------------------------------------------------------------------

SendFn = Callable[[dict[str, Any]], Any]


class IPCStagingBuffer:
    """A packed staging buffer of `size_bytes`, allocated on the first tensor's device and exported then, once. Kept
    by a trainer and passed as `IPCTrainerSendWeightsArgs(staging=...)` on every sync, it is exported and mapped once
    for all of them: the engine keeps the mapping between syncs (so this buffer's memory stays mapped until a sync
    comes from another buffer, or without `staging`, or the engine shuts down: keep it alive that long). A chunk
    layout seen before (the same names, dtypes and shapes) is filled through views made the first time: one
    multi-tensor copy, without per-tensor host work beyond the layout's key."""

    def __init__(self, size_bytes: int) -> None:
        if size_bytes < 1:
            raise ValueError(f"the staging buffer's size must be >= 1 byte, got {size_bytes}")
        self.nbytes = size_bytes
        self.buffer: torch.Tensor | None = None
        self.handle: dict[str, list[Any]] = {}
        self._layouts: dict[tuple[TensorMeta, ...], _ChunkLayout] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        """The buffer, on `device`: allocated and exported on the first call, which an empty update never makes."""
        if self.buffer is None:
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            self.handle = export_tensor(self.buffer)
        elif self.buffer.device != device:
            raise ValueError(f"the staging buffer is on {self.buffer.device}, but a tensor to send is on {device}")
        return self.buffer

    def fill(self, chunk: list[tuple[str, torch.Tensor]]) -> dict[str, list[Any]]:
        """Copy the chunk's tensors into the buffer, back to back from its start (the copies are queued on the
        current stream), and return its update-info fields (names, dtype_names, shapes, tensor_sizes)."""
        key = tuple(TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in chunk)
        layout = self._layouts.get(key)
        tensors = [t.detach() for _, t in chunk]
        if layout is None:  # first seen: one cat of byte views, cheaper than making typed views it may never reuse
            if len(self._layouts) >= MAX_CACHED_LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[key] = _ChunkLayout.of(key)
            used = sum(layout.fields["tensor_sizes"])
            torch.cat([as_bytes(t) for t in tensors], out=self.buffer[:used])
            return layout.fields
        if layout.views is None:
            layout.views = _typed_views(self.buffer, key)
        if layout.views:
            torch._foreach_copy_(layout.views, tensors)
        else:  # a tensor at an offset its dtype cannot view: byte views every time
            torch.cat([as_bytes(t) for t in tensors], out=self.buffer[: sum(layout.fields["tensor_sizes"])])
        return layout.fields


@dataclass
class _ChunkLayout:
    """A chunk's update-info fields, and (once the layout comes a second time) typed views of its tensors in the
    staging buffer; an empty list: some tensor's offset is not aligned for its dtype, so no views."""

    fields: dict[str, list[Any]]
    views: list[torch.Tensor] | None = None

    @classmethod
    def of(cls, metas: tuple[TensorMeta, ...]) -> _ChunkLayout:
        return cls(
            {
                "names": [m.name for m in metas],
                "dtype_names": [dtype_name(m.dtype) for m in metas],
                "shapes": [list(m.shape) for m in metas],
                "tensor_sizes": [m.nbytes for m in metas],
            }
        )


def _typed_views(buffer: torch.Tensor, metas: tuple[TensorMeta, ...]) -> list[torch.Tensor]:
    views, offset = [], 0
    for meta in metas:
        if offset % meta.dtype.itemsize:
            return []
        views.append(buffer[offset : offset + meta.nbytes].view(meta.dtype).view(meta.shape))
        offset += meta.nbytes
    return views


@dataclass(frozen=True)
class IPCTrainerSendWeightsArgs:
    """`send_mode` delivers one update_info dict to the engine and returns once it has been loaded: a callable (an
    in-process `llm.update_weights(...)`, a pipe, a Ray call) or `"http"`, which POSTs `{"update_info": ...}` to
    `{url}/update_weights` (with `api_key` as a bearer token, if given). `staging` (packed only): a buffer kept across
    syncs, used instead of one allocated and exported per sync; its size is the chunks' limit."""

    send_mode: SendFn | str
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    url: str | None = None
    api_key: str | None = None
    staging: IPCStagingBuffer | None = None

    def __post_init__(self) -> None:
        if isinstance(self.send_mode, str):
            if self.send_mode != "http":
                raise ValueError(f"send_mode must be a callable or 'http', got {self.send_mode!r}")
            if not self.url:
                raise ValueError("send_mode='http' needs `url` (the engine server's base URL)")
        elif not callable(self.send_mode):
            raise ValueError(f"send_mode must be a callable or 'http', got {self.send_mode!r}")
        if self.packed_buffer_size_bytes < 1:
            raise ValueError(f"packed_buffer_size_bytes must be >= 1, got {self.packed_buffer_size_bytes}")
        if self.staging is not None:
            if not isinstance(self.staging, IPCStagingBuffer):
                raise ValueError(f"`staging` must be an IPCStagingBuffer, got {type(self.staging).__name__}")
            if not self.packed:
                raise ValueError("`staging` is a packed staging buffer: it needs packed=True")
            if self.packed_buffer_size_bytes not in (DEFAULT_PACKED_BUFFER_SIZE_BYTES, self.staging.nbytes):
                raise ValueError(
                    f"packed_buffer_size_bytes ({self.packed_buffer_size_bytes}) differs from the staging buffer's "
                    f"size ({self.staging.nbytes}): the staging buffer's size is the limit; leave it out"
                )


@contextlib.contextmanager
def _sender(args: IPCTrainerSendWeightsArgs) -> Iterator[SendFn]:
    if callable(args.send_mode):
        yield args.send_mode
        return
    import httpx  # only the HTTP mode needs it

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = f"{args.url.rstrip('/')}/update_weights"
    # One client per sync: packed chunks reuse its connection. Loading the CA bundle for TLS verification takes
    # 20-40 ms, most of a small model's sync; a plain-http URL never negotiates TLS, so it skips that.
    verify = not url.startswith("http://")
    with httpx.Client(timeout=HTTP_TIMEOUT_S, headers=headers, verify=verify) as client:
        yield lambda update_info: client.post(url, json={"update_info": update_info}).raise_for_status()


def _send_unpacked(iterator: Iterator[tuple[str, torch.Tensor]], send: SendFn) -> None:
    keep_alive: list[torch.Tensor] = []  # the exports point into these: they must outlive the engine's load
    names: list[str] = []
    dtype_names: list[str] = []
    shapes: list[list[int]] = []
    handles: list[dict[str, list[Any]]] = []
    for name, tensor in iterator:
        shared = tensor.detach().contiguous()
        keep_alive.append(shared)
        names.append(name)
        dtype_names.append(dtype_name(shared.dtype))
        shapes.append(list(shared.shape))
        handles.append(export_tensor(shared))
    torch.cuda.synchronize()  # the engine reads the memory from its own process and streams
    send({"names": names, "dtype_names": dtype_names, "shapes": shapes, "ipc_handles": handles})


def _send_packed(
    iterator: Iterator[tuple[str, torch.Tensor]], send: SendFn, staging: IPCStagingBuffer, keep_mapped: bool
) -> None:
    """Copy tensors into the staging buffer and send a chunk whenever the next tensor would not fit (a chunk never
    exceeds the buffer). The buffer is exported once: for this sync, or, `keep_mapped`, for every sync from it."""
    chunk: list[tuple[str, torch.Tensor]] = []  # held until its flush, then copied in one go
    used = 0

    def flush(is_last: bool) -> None:
        fields = {key: list(values) for key, values in staging.fill(chunk).items()}  # the cached lists stay ours
        chunk.clear()
        torch.cuda.synchronize()  # the copies into the buffer must be complete before the engine reads it
        send(
            {**fields, "ipc_handles": staging.handle, "packed": True, "is_last_chunk": is_last}
            | ({"keep_mapped": True} if keep_mapped else {})
        )

    for name, tensor in iterator:
        size = tensor.nbytes
        if size > staging.nbytes:
            raise ValueError(
                f"{name!r} has {size} bytes, more than the packed buffer ({staging.nbytes} bytes): raise "
                "packed_buffer_size_bytes"
            )
        staging.on(tensor.device)
        if used + size > staging.nbytes:
            flush(is_last=False)  # send() returns after the engine loaded the chunk, so the buffer is free again
            used = 0
        chunk.append((name, tensor))
        used += size
    if chunk:  # an empty update sends nothing
        flush(is_last=True)


# --- Engine side --------------------------------------------------------------------------------------------------


@dataclass
class IPCWeightTransferInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the handles come with each update. `packed` is vLLM 0.33's handshake-time wire flag: with
    it, an update of unpacked handles is refused (each update's handles say how they are laid out either way)."""

    packed: bool = False


@dataclass
class IPCWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Unpacked: `ipc_handles` is one `{gpu_uuid: encoded args}` per tensor. Packed: one such dict for the staging
    buffer, `tensor_sizes` gives each tensor's bytes (laid out back to back), and `is_last_chunk` is False on every
    chunk of a sync but the last. `keep_mapped` (rlserve's, packed only): the buffer is the trainer's for every sync
    (IPCStagingBuffer), so the engine keeps it mapped after the last chunk."""

    ipc_handles: list[dict[str, Any]] | dict[str, Any] | None = None
    packed: bool = False
    tensor_sizes: list[int] | None = None
    ipc_handles_pickled: str | None = None
    is_last_chunk: bool = True
    keep_mapped: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ipc_handles_pickled is not None:
            raise ValueError(
                "`ipc_handles_pickled` is refused: rlserve never unpickles request data, and "
                "VLLM_ALLOW_INSECURE_SERIALIZATION=1 does not change that. Send `ipc_handles` as plain data instead "
                "(rlserve's IPCWeightTransferEngine.trainer_send_weights does)"
            )
        if self.ipc_handles is None:
            raise ValueError("`ipc_handles` must be provided (rlserve takes no `ipc_handles_pickled`)")
        # A single dict is a packed chunk's buffer; vLLM G3 trainers say `packed` in their config, not here.
        self.packed = self.packed or isinstance(self.ipc_handles, dict)
        count = len(self.names)
        if type(self.keep_mapped) is not bool:
            raise ValueError(f"`keep_mapped` must be a bool, got {self.keep_mapped!r}")
        if self.keep_mapped and not self.packed:
            raise ValueError("`keep_mapped` needs a packed update: only a staging buffer stays mapped")
        if self.packed:
            if not isinstance(self.ipc_handles, dict):
                raise ValueError("packed `ipc_handles` is one {gpu_uuid: handle} dict for the buffer")
            if self.tensor_sizes is None or len(self.tensor_sizes) != count:
                raise ValueError("packed updates need `tensor_sizes`, one per name")
            expected = [m.nbytes for m in tensor_metas(self)]
            if list(self.tensor_sizes) != expected:
                raise ValueError(f"`tensor_sizes` {self.tensor_sizes} do not match the dtypes and shapes ({expected})")
            handles = [self.ipc_handles]
        else:
            if not isinstance(self.ipc_handles, list) or len(self.ipc_handles) != count:
                raise ValueError(f"`ipc_handles` should be a list of the same size as `names` ({count})")
            handles = self.ipc_handles
        for handle in handles:
            if not isinstance(handle, dict) or not handle:
                raise ValueError("each IPC handle is a non-empty {gpu_uuid: handle} dict")
            for args in handle.values():
                decode_rebuild_args(args)


# Chunk layouts whose views a mapping (or a kept staging buffer) remembers: a sync of any model is a few chunks.
MAX_CACHED_LAYOUTS = 64


class _Mapping(NamedTuple):
    """The trainer's staging buffer as mapped for the current sync (or, kept, for every sync), which export it came
    from, and the tensor views into it of each chunk layout seen (a model's 310 views cost milliseconds of host time
    to make, and a kept buffer's later syncs bring the same layouts)."""

    export_id: tuple[Any, ...]
    buffer: torch.Tensor
    views: dict[tuple[TensorMeta, ...], list[tuple[str, torch.Tensor]]]

    def tensors(self, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
        key = tuple(metas)
        views = self.views.get(key)
        if views is None:
            if len(self.views) >= MAX_CACHED_LAYOUTS:
                self.views.clear()
            views = self.views[key] = unpack_tensors(self.buffer, metas)
        return list(views)  # a copy: the loader may consume its list


class IPCWeightTransferEngine(WeightTransferEngine[IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo]):
    """Needs the engine on a CUDA device, on the trainer's GPU. Needs no `init_transfer_engine` before updates."""

    init_info_cls = IPCWeightTransferInitInfo
    update_info_cls = IPCWeightTransferUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: Any = None,
        device: torch.device | str | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        """`(config, device)` (vLLM 0.24) or `(config, vllm_config, device, model)` (0.33)."""
        super().__init__(config, vllm_config, device, model)
        self._mapping: _Mapping | None = None
        self._packed = False

    def init_transfer_engine(self, init_info: IPCWeightTransferInitInfo) -> None:
        self._device_index()  # fail at the handshake, not at the first update, on a non-CUDA engine
        self._packed = init_info.packed

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo, load_weights: LoadWeightsFn) -> None:
        index = self._device_index()
        if self._packed and not update_info.packed:
            raise ValueError("update_info: unpacked ipc_handles (a list), but init_info said packed=True")
        if update_info.packed:
            self._map_buffer(update_info.ipc_handles, index, required=True)
            load_weights(self._mapping.tensors(tensor_metas(update_info)))
        else:
            tensors = []
            for meta, handle in zip(tensor_metas(update_info), update_info.ipc_handles, strict=True):
                tensor = self._rebuild(handle, index, required=True)
                if tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
                    raise ValueError(
                        f"IPC handle of {meta.name!r} is a {tuple(tensor.shape)} {tensor.dtype} tensor, update_info "
                        f"says {meta.shape} {meta.dtype}"
                    )
                tensors.append((meta.name, tensor))
            load_weights(tensors)
        self._finish(update_info, index)

    def discard_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        # Map and drop each export anyway: an export nobody maps stays pinned in the trainer (see module docstring).
        index = self._device_index()
        if update_info.packed:
            self._map_buffer(update_info.ipc_handles, index, required=False)
        else:
            for handle in update_info.ipc_handles:
                self._rebuild(handle, index, required=False)
        self._finish(update_info, index)

    def _finish(self, update_info: IPCWeightTransferUpdateInfo, index: int) -> None:
        # The trainer overwrites the staging buffer (or frees its tensors) once this returns: every read of the
        # shared memory, including the loader's copies, must be complete first.
        torch.cuda.synchronize(index)
        if update_info.packed and update_info.is_last_chunk and not update_info.keep_mapped:
            self._release()

    def _map_buffer(self, handle: dict[str, Any], index: int, required: bool) -> torch.Tensor | None:
        args = self._local_args(handle, index, required)
        if args is None:
            return None
        # The storage handle and offset name the buffer; the ref-counter slot names this export of it.
        export_id = tuple(
            args[ARG_INDEX[f]]
            for f in ("storage_handle", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset")
        )
        if self._mapping is not None and self._mapping.export_id != export_id:
            self._release()  # a new sync started without the previous one's last chunk
        if self._mapping is None:
            self._mapping = _Mapping(export_id, rebuild_cuda_tensor(*args), {})
        return self._mapping.buffer

    def _rebuild(self, handle: dict[str, Any], index: int, required: bool) -> torch.Tensor | None:
        args = self._local_args(handle, index, required)
        return None if args is None else rebuild_cuda_tensor(*args)

    def _local_args(self, handle: dict[str, Any], index: int, required: bool) -> list[Any] | None:
        uuid = gpu_uuid(index)
        if uuid not in handle:
            if required:
                raise ValueError(f"IPC handle not found for GPU UUID {uuid}. Available UUIDs: {list(handle)}")
            return None
        args = decode_rebuild_args(handle[uuid])
        args[ARG_INDEX["storage_device"]] = index  # the trainer's device index need not be ours for the same GPU
        return args

    def _release(self) -> None:
        # Dropping the last reference closes the mapping and releases the trainer's export.
        self._mapping = None

    def _device_index(self) -> int:
        if self.device.type != "cuda":
            raise RuntimeError(f"the ipc weight transfer backend needs the engine on a CUDA device, not {self.device}")
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def shutdown(self) -> None:
        if self._mapping is not None:
            torch.cuda.synchronize(self._mapping.buffer.device)
        self._release()

    @staticmethod
    def trainer_send_weights(
        iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: IPCTrainerSendWeightsArgs | dict[str, Any]
    ) -> None:
        """Trainer side: export the tensors (CUDA tensors on the engine's GPU) and deliver the update
        info(s) through `send_mode`. Source tensors (and the staging buffer) stay alive until this returns; then
        `torch.cuda.ipc_collect()` frees whatever the engine has released."""
        args = (
            trainer_args
            if isinstance(trainer_args, IPCTrainerSendWeightsArgs)
            else IPCTrainerSendWeightsArgs(**trainer_args)
        )
        try:
            with _sender(args) as send:
                if args.packed:
                    # Without a kept buffer, one for this sync alone, freed when _send_packed returns (so that
                    # ipc_collect below can free it once the engine has released it).
                    staging = args.staging or IPCStagingBuffer(args.packed_buffer_size_bytes)
                    keep_mapped = args.staging is not None
                    _send_packed(iterator, send, staging, keep_mapped)
                    del staging
                else:
                    _send_unpacked(iterator, send)
        finally:
            torch.cuda.ipc_collect()


# --- Trainer side, vLLM 0.33 ----------------------------------------------------------------------------------------


@dataclass
class IPCTrainerInitInfo(TrainerInitInfo):
    """No rendezvous: `packed` and the staging buffer's size are the wire parameters (`packed` is handed to the
    engine at the handshake)."""

    backend: ClassVar[str] = "ipc"

    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES


class IPCTrainerWeightTransferEngine(TrainerWeightTransferEngine[IPCTrainerInitInfo]):
    """Exports the whole `WeightSource` (CUDA tensors on the engine's GPU) every round and posts the handles as the
    update itself, through the client's `update_weights`. Non-sender ranks only join the gathers."""

    init_info_cls = IPCTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, init_info: IPCTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        self.init_info = init_info

    @classmethod
    def trainer_init(
        cls, init_info: IPCTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> IPCTrainerWeightTransferEngine:
        if source is None or not source.implements_iter_full():
            raise ValueError("the ipc trainer engine shares full tensors: it needs a WeightSource with iter_full()")
        check_single_sender(source)
        engine = cls(client=client, source=source, init_info=init_info)
        if engine.is_sender:
            client.init_weight_transfer_engine({"packed": init_info.packed})
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source.iter_full():
                pass
            return
        args = IPCTrainerSendWeightsArgs(
            send_mode=self.client.update_weights,
            packed=self.init_info.packed,
            packed_buffer_size_bytes=self.init_info.packed_buffer_size_bytes,
        )
        self.client.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(checked_iter(self.source, self.source.metadata), args)
        self.client.finish_weight_update()
