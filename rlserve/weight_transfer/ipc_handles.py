"""CUDA IPC handles as plain data: `reduce_tensor`'s rebuild arguments encoded for JSON and decoded against an
allowlist (`encode_rebuild_args` / `decode_rebuild_args`), never pickled, so an `update_weights` body cannot execute
code; and the export of a CUDA tensor keyed by its GPU's UUID (rlserve.weight_transfer.ipc uses both sides)."""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import reduce_tensor

from rlserve.dtypes import dtype_from_name, dtype_name

# --- Plain-data encoding of rebuild_cuda_tensor's arguments --------------------------------------------------------

# The only classes a handle may name: a name outside these tables is refused, so decoding never imports or calls
# anything the sender chose.
_TENSOR_CLASSES: dict[str, type] = {"torch.Tensor": torch.Tensor, "torch.nn.Parameter": torch.nn.Parameter}
_STORAGE_CLASSES: dict[str, type] = {
    "torch.storage.TypedStorage": torch.storage.TypedStorage,
    "torch.UntypedStorage": torch.UntypedStorage,
}


class _Codec(NamedTuple):
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


def _class_codec(table: dict[str, type]) -> _Codec:
    names = {cls: name for name, cls in table.items()}

    def encode(cls: type) -> str:
        if cls not in names:
            raise ValueError(f"cannot export {cls!r} over IPC: expected one of {sorted(table)}")
        return names[cls]

    def decode(value: Any) -> type:
        if isinstance(value, type) and value in names:
            return value
        if isinstance(value, str) and value in table:
            return table[value]
        raise ValueError(f"class {value!r} is not allowed in an IPC handle: expected one of {sorted(table)}")

    return _Codec(encode, decode)


def _decode_int(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"expected an int, got {value!r}")
    return value


def _decode_bool(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError(f"expected a bool, got {value!r}")
    return value


def _decode_ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"expected a list of ints, got {value!r}")
    return tuple(_decode_int(v) for v in value)


def _encode_bytes(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def _decode_bytes(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return base64.b64decode(value, validate=True)
    raise ValueError(f"expected base64 text, got {value!r}")


def _decode_dtype(value: Any) -> torch.dtype:
    return value if isinstance(value, torch.dtype) else dtype_from_name(value)


_INT = _Codec(int, _decode_int)
_BOOL = _Codec(bool, _decode_bool)
_BYTES = _Codec(_encode_bytes, _decode_bytes)
# Positional, in rebuild_cuda_tensor's order, so index 6 is the storage device as in vLLM's handles.
_REBUILD_ARGS: tuple[tuple[str, _Codec], ...] = (
    ("tensor_cls", _class_codec(_TENSOR_CLASSES)),
    ("tensor_size", _Codec(list, lambda v: torch.Size(_decode_ints(v)))),
    ("tensor_stride", _Codec(list, _decode_ints)),
    ("tensor_offset", _INT),
    ("storage_cls", _class_codec(_STORAGE_CLASSES)),
    ("dtype", _Codec(dtype_name, _decode_dtype)),
    ("storage_device", _INT),
    ("storage_handle", _BYTES),
    ("storage_size_bytes", _INT),
    ("storage_offset_bytes", _INT),
    ("requires_grad", _BOOL),
    ("ref_counter_handle", _BYTES),
    ("ref_counter_offset", _INT),
    ("event_handle", _BYTES),
    ("event_sync_required", _BOOL),
)
ARG_INDEX = {name: i for i, (name, _) in enumerate(_REBUILD_ARGS)}


def encode_rebuild_args(args: Sequence[Any]) -> list[Any]:
    """`reduce_tensor(t)[1]` -> a list of JSON values (classes and dtype by name, handles as base64 text)."""
    if len(args) != len(_REBUILD_ARGS):
        raise ValueError(f"expected {len(_REBUILD_ARGS)} rebuild_cuda_tensor arguments, got {len(args)}")
    return [codec.encode(value) for (_, codec), value in zip(_REBUILD_ARGS, args, strict=True)]


def decode_rebuild_args(data: Sequence[Any]) -> list[Any]:
    """Inverse of `encode_rebuild_args`; also accepts the raw arguments (as an in-process caller would pass).
    Refuses any class outside the allowlist and any field of the wrong type."""
    if not isinstance(data, list | tuple) or len(data) != len(_REBUILD_ARGS):
        raise ValueError(f"an IPC handle is a list of {len(_REBUILD_ARGS)} rebuild_cuda_tensor arguments")
    decoded = []
    for (name, codec), value in zip(_REBUILD_ARGS, data, strict=True):
        try:
            decoded.append(codec.decode(value))
        except ValueError as e:
            raise ValueError(f"bad IPC handle field {name!r}: {e}") from e
    return decoded


def gpu_uuid(device_index: int) -> str:
    return str(torch.cuda.get_device_properties(device_index).uuid)


def export_tensor(tensor: torch.Tensor) -> dict[str, list[Any]]:
    """`{gpu_uuid: encoded rebuild args}` for a CUDA tensor. The tensor must stay alive until the engine is done."""
    if not tensor.is_cuda:
        raise ValueError(f"the ipc backend shares CUDA tensors, got one on {tensor.device}")
    _, args = reduce_tensor(tensor)
    return {gpu_uuid(tensor.device.index): encode_rebuild_args(args)}
