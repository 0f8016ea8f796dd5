"""vLLM's `packed_tensor` functions (0.24.0 and 0.33.0), for code that calls them directly: packing one bucket from a
`(name, tensor)` iterator (`pack_tensors` -> `PackedChunk`), its inverse `unpack_tensor`, the consumer of packed
broadcasts, and the packed CUDA-IPC producer / consumer. The bucket rule is rlserve's `packed.iter_buckets` (vLLM's:
a bucket closes once its bytes exceed the budget), so a chunk from here splits where rlserve's own sender and
receiver split. The packed broadcast producer is `vllm_sender.packed_nccl_broadcast_producer`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from rlserve.dtypes import dtype_from_name
from rlserve.weight_transfer.ipc_handles import gpu_uuid
from rlserve.weight_transfer.nccl import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS
from rlserve.weight_transfer.packed import TensorMeta, _check_params, as_bytes, iter_buckets, unpack_tensors

PostIterFn = Callable[[tuple[str, torch.Tensor]], torch.Tensor]


@dataclass
class PackedChunk:
    """One bucket: the bytes of its tensors back to back (`uint8`), and each tensor's name, shape, dtype and size
    in bytes, in order."""

    packed_tensor: torch.Tensor
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[torch.dtype]
    tensor_sizes: list[int]


def unpack_tensor(
    packed_tensor: torch.Tensor,
    names: list[str],
    shapes: list[list[int]],
    dtypes: list[torch.dtype],
    tensor_sizes: list[int],
) -> list[tuple[str, torch.Tensor]]:
    """`(name, tensor)` views of `packed_tensor`, laid out as `pack_tensors` packs (a tensor whose offset its dtype
    cannot view is copied). The views alias the buffer: clone them before the buffer is reused."""
    count = len(names)
    for what, values in (("shapes", shapes), ("dtypes", dtypes), ("tensor_sizes", tensor_sizes)):
        if len(values) != count:
            raise ValueError(f"unpack_tensor: {len(values)} {what} for {count} names")
    metas = [TensorMeta(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
    for meta, size in zip(metas, tensor_sizes, strict=True):
        if meta.nbytes != size:
            raise ValueError(f"unpack_tensor: {meta.name!r} is {size} bytes, but {meta.dtype} {list(meta.shape)} is "
                             f"{meta.nbytes}")  # fmt: skip
    return unpack_tensors(packed_tensor, metas)


def pack_tensors(
    iterator: Iterator[tuple[str, torch.Tensor]],
    post_iter_func: PostIterFn,
    buffer_size_bytes: int,
    tensor_list: list[torch.Tensor] | None = None,
    current_size: int = 0,
) -> PackedChunk | None:
    """The next bucket of `iterator`: items taken (each as `post_iter_func(item)`'s bytes) until the bucket's bytes,
    counting `current_size` bytes already in `tensor_list`, exceed `buffer_size_bytes`, or the iterator ends.
    None if the iterator was already exhausted and `tensor_list` is empty. A tensor larger than the budget warns
    (both sides then need buffers that large) and travels alone in its bucket."""
    _check_params(buffer_size_bytes)
    parts = tensor_list if tensor_list is not None else []
    total = current_size
    names: list[str] = []
    shapes: list[list[int]] = []
    dtypes: list[torch.dtype] = []
    sizes: list[int] = []
    for name, tensor in iterator:
        flat = as_bytes(post_iter_func((name, tensor)))
        if flat.numel() > buffer_size_bytes:
            warnings.warn(
                f"Tensor '{name}' has size {flat.numel()} bytes, which exceeds buffer_size_bytes={buffer_size_bytes}.",
                stacklevel=2,
            )
        parts.append(flat)
        names.append(name)
        shapes.append(list(tensor.shape))
        dtypes.append(tensor.dtype)
        sizes.append(flat.numel())
        total += flat.numel()
        if total > buffer_size_bytes:  # `packed.iter_buckets`'s rule: the bucket closes once over the budget
            break
    if not parts:
        return None
    return PackedChunk(torch.cat(parts), names, shapes, dtypes, sizes)


def packed_nccl_broadcast_consumer(
    iterator: Iterator[tuple[str, tuple[list[int], torch.dtype]]],
    group: Any,
    src: int,
    post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None],
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    device: torch.device | str = "cuda",
) -> None:
    """Receive what `packed_nccl_broadcast_producer` sends from `src` for the tensors `iterator` describes (`(name,
    (shape, dtype))`, in sending order): one `group.broadcast(buffer, src=src)` per bucket, split by the same rule
    and `buffer_size_bytes`, each bucket's `(name, tensor)` views handed to `post_unpack_func`. Each bucket gets a
    buffer of its own, so the views stay valid after the call. `num_buffers` is the producer's overlap knob; the
    receives here are in order on the group's stream."""
    _check_params(buffer_size_bytes, num_buffers)
    metas = (TensorMeta(name, dtype, tuple(shape)) for name, (shape, dtype) in iterator)
    for bucket in iter_buckets(metas, lambda m: m.nbytes, buffer_size_bytes):
        buffer = torch.empty(sum(m.nbytes for m in bucket), dtype=torch.uint8, device=device)
        group.broadcast(buffer, src=src)
        post_unpack_func(unpack_tensors(buffer, bucket))


@dataclass
class PackedIpcChunk:
    """One chunk of a packed CUDA-IPC transfer: its tensors' metadata and the `{gpu_uuid: rebuild args}` handle of
    the producer's buffer."""

    names: list[str]
    shapes: list[list[int]]
    dtype_names: list[str]
    tensor_sizes: list[int]
    ipc_handle: dict[str, tuple]


def packed_ipc_producer(
    iterator: Iterator[tuple[str, torch.Tensor]],
    gpu_uuid: str,
    post_iter_func: PostIterFn,
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
) -> Iterator[PackedIpcChunk]:
    """Copy the tensors into one CUDA buffer of `buffer_size_bytes`, exported once, and yield a chunk each time it is
    full (a chunk never exceeds the buffer; a tensor larger than it is a ValueError). The consumer must be done with
    a chunk before the generator is resumed: the next chunk overwrites the buffer."""
    _check_params(buffer_size_bytes)
    buffer = torch.empty(buffer_size_bytes, dtype=torch.uint8, device="cuda")
    _, handle_args = reduce_tensor(buffer)
    chunk = PackedIpcChunk([], [], [], [], {gpu_uuid: handle_args})
    used = 0
    for name, tensor in iterator:
        flat = as_bytes(post_iter_func((name, tensor)))
        if flat.numel() > buffer_size_bytes:
            raise ValueError(
                f"Tensor '{name}' has size {flat.numel()} bytes, which exceeds buffer_size_bytes={buffer_size_bytes}. "
                f"Increase buffer_size_bytes to at least {flat.numel()}."
            )
        if used and used + flat.numel() > buffer_size_bytes:
            torch.cuda.current_stream().synchronize()  # the consumer reads the buffer from another process
            yield chunk
            chunk, used = PackedIpcChunk([], [], [], [], {gpu_uuid: handle_args}), 0
        buffer[used : used + flat.numel()].copy_(flat)
        chunk.names.append(name)
        chunk.shapes.append(list(tensor.shape))
        chunk.dtype_names.append(str(tensor.dtype).removeprefix("torch."))
        chunk.tensor_sizes.append(flat.numel())
        used += flat.numel()
    if used:
        torch.cuda.current_stream().synchronize()
        yield chunk


class PackedBufferImporter:
    """The consumer's mapping of the producer's buffer, kept across the chunks of one export: torch counts one
    release per export, so mapping it once per chunk would release it too often (and leak it on the producer)."""

    def __init__(self) -> None:
        self._entry: tuple[tuple, torch.Tensor] | None = None

    def rebuild(self, list_args: list) -> torch.Tensor:
        key = tuple(list_args)
        if self._entry is None or self._entry[0] != key:
            self._entry = (key, rebuild_cuda_tensor(*list_args))
        return self._entry[1]

    def close(self) -> None:
        self._entry = None


def packed_ipc_consumer(
    ipc_handle: dict[str, tuple],
    names: list[str],
    shapes: list[list[int]],
    dtype_names: list[str],
    tensor_sizes: list[int],
    device_index: int,
    importer: PackedBufferImporter | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """The chunk's tensors, copied out of the producer's buffer (which its next chunk overwrites) onto
    `device_index`. Share one `importer` across the chunks of a transfer."""
    uuid = gpu_uuid(device_index)
    if uuid not in ipc_handle:
        raise ValueError(f"IPC handle not found for GPU UUID {uuid}. Available UUIDs: {list(ipc_handle.keys())}")
    args = list(ipc_handle[uuid])
    args[6] = device_index  # rebuild_cuda_tensor's storage_device: the producer's index need not be ours
    buffer = (importer or PackedBufferImporter()).rebuild(args)[: sum(tensor_sizes)]
    dtypes = [dtype_from_name(name) for name in dtype_names]
    return [(name, t.clone()) for name, t in unpack_tensor(buffer, names, shapes, dtypes, tensor_sizes)]
