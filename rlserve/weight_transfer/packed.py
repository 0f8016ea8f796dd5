"""Bucketed broadcast of many tensors: planning, packing, and the pipelined producer and consumer.

Producer and consumer never exchange the bucket layout: both derive it from the tensors' byte sizes with the same
rule (`iter_buckets`), so they must agree on `buffer_size_bytes` (vLLM's "must-agree" wire parameter). The number
of buffers is a local memory/overlap knob and may differ between the two sides.

Every broadcast carries raw bytes (`uint8`), whatever the tensors' dtypes: any dtype torch can hold travels, on NCCL
and on gloo alike, and bf16 round-trips exactly.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.distributed import Work

from rlserve.weight_transfer.base import LoadWeightsFn, WeightTransferUpdateInfo

logger = logging.getLogger(__name__)

BroadcastFn = Callable[[torch.Tensor], Work]
"""Starts a broadcast of one contiguous tensor from the trainer (in place on the receivers) and returns its Work."""

T = TypeVar("T")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def tensor_metas(update_info: WeightTransferUpdateInfo) -> list[TensorMeta]:
    return [
        TensorMeta(name, dtype, tuple(shape))
        for name, dtype, shape in zip(update_info.names, update_info.dtypes, update_info.shapes, strict=True)
    ]


def _check_params(buffer_size_bytes: int, num_buffers: int = 1) -> None:
    if buffer_size_bytes < 1:
        raise ValueError(f"packed buffer size must be >= 1 byte, got {buffer_size_bytes}")
    if num_buffers < 1:
        raise ValueError(f"packed_num_buffers must be >= 1, got {num_buffers}")


def iter_buckets(items: Iterable[T], byte_size: Callable[[T], int], buffer_size_bytes: int) -> Iterator[list[T]]:
    """Group `items` in order: append an item, close the bucket once its total exceeds `buffer_size_bytes` (so a
    bucket overshoots by less than one item); an item larger than the budget travels alone. Streams, so the
    producer never holds more than the bucket being built."""
    _check_params(buffer_size_bytes)
    bucket: list[T] = []
    total = 0
    for item in items:
        size = byte_size(item)
        if size > buffer_size_bytes and bucket:
            yield bucket
            bucket, total = [], 0
        bucket.append(item)
        total += size
        if total > buffer_size_bytes:
            yield bucket
            bucket, total = [], 0
    if bucket:
        yield bucket


def plan_buckets(byte_sizes: Sequence[int], buffer_size_bytes: int) -> list[list[int]]:
    """Indices of `byte_sizes` grouped into buckets by the `iter_buckets` rule; no input, no buckets."""
    return list(iter_buckets(range(len(byte_sizes)), byte_sizes.__getitem__, buffer_size_bytes))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Flat `uint8` view of a tensor's bytes (a copy only if the tensor is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat `uint8` tensor holding the bytes of `tensors` back to back, without padding."""
    if len(tensors) == 1:
        return as_bytes(tensors[0])  # nothing to concatenate: send the tensor's own bytes
    return torch.cat([as_bytes(t) for t in tensors])


def unpack_tensors(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Split a flat byte buffer laid out by `pack_tensors` back into `(name, tensor)` views."""
    flat = buffer.reshape(-1).view(torch.uint8)
    expected = sum(m.nbytes for m in metas)
    if flat.numel() < expected:
        raise ValueError(f"packed buffer holds {flat.numel()} bytes, the tensors need {expected}")
    out: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for meta in metas:
        raw = flat[offset : offset + meta.nbytes]
        offset += meta.nbytes
        # Packing adds no padding, so a tensor may start at an offset its dtype cannot view (e.g. fp32 after an
        # odd-sized bf16 tensor); copy those few bytes to a fresh, aligned allocation.
        if raw.storage_offset() % meta.dtype.itemsize:
            raw = raw.clone()
        out.append((meta.name, raw.view(meta.dtype).view(meta.shape)))
    return out


@dataclass
class _InFlight:
    """A bucket whose broadcast may still be running, and what must stay alive until it is done."""

    work: Work
    stream: torch.cuda.Stream | None
    keep_alive: list[torch.Tensor]

    def wait(self) -> None:
        if self.stream is None:
            self.work.wait()
        else:
            self.stream.synchronize()  # the stream already waits on the broadcast (see _start_bucket)


def _start_bucket(bucket: list[torch.Tensor], broadcast: BroadcastFn, stream: torch.cuda.Stream | None) -> _InFlight:
    device = bucket[0].device
    if stream is None:
        # On CPU the concatenation is done when cat returns; gloo sends from its own threads, so packing the next
        # bucket still overlaps this send.
        packed = pack_tensors(bucket)
        return _InFlight(broadcast(packed), None, [packed])
    # The tensors were produced on the caller's stream: the slot's stream must see them finished before packing.
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        packed = pack_tensors(bucket)
        work = broadcast(packed)
        work.wait()  # makes the slot's stream wait for the broadcast, so synchronizing it frees the slot
    # The sources are kept too: they may be temporaries whose memory the allocator would otherwise hand out on the
    # caller's stream while the slot's stream still reads them.
    return _InFlight(work, stream, [packed, *bucket])


class PackedSender:
    """Producer of packed broadcasts: `send` packs tensors into buckets and broadcasts them, with `num_buffers`
    buckets in flight so packing bucket i+1 overlaps sending bucket i.

    Keep one per trainer-side connection (WeightTransferGroup has one) and reuse it for every update: its CUDA
    streams are created once (fresh streams per call leaked allocator memory in vLLM, gh-52950, since the caching
    allocator keeps per-stream pools), and it warns about an oversized tensor once, not at every training step.
    """

    def __init__(self) -> None:
        self._streams: dict[tuple[torch.device, int], list[torch.cuda.Stream]] = {}
        self._warned_budgets: set[int] = set()

    def _slot_stream(self, device: torch.device, num_buffers: int, slot: int) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        key = (device, num_buffers)
        if key not in self._streams:
            self._streams[key] = [torch.cuda.Stream(device=device) for _ in range(num_buffers)]
        return self._streams[key][slot]

    def send(
        self, tensors: Iterable[torch.Tensor], broadcast: BroadcastFn, buffer_size_bytes: int, num_buffers: int
    ) -> None:
        """Returns when every broadcast has completed."""
        _check_params(buffer_size_bytes, num_buffers)
        slots: list[_InFlight | None] = [None] * num_buffers
        for index, bucket in enumerate(iter_buckets(tensors, lambda t: t.nbytes, buffer_size_bytes)):
            slot = index % num_buffers
            in_flight = slots[slot]
            if in_flight is not None:
                in_flight.wait()
                # Drop every reference to the old packed buffer before the next one is allocated.
                slots[slot] = in_flight = None
            oversized = len(bucket) == 1 and bucket[0].nbytes > buffer_size_bytes
            if oversized and buffer_size_bytes not in self._warned_budgets:
                self._warned_budgets.add(buffer_size_bytes)
                logger.warning(
                    "a tensor of %d bytes exceeds the packed buffer size (%d bytes): such tensors are sent as their "
                    "own bucket, which needs their whole size on both sides",
                    bucket[0].nbytes,
                    buffer_size_bytes,
                )
            stream = self._slot_stream(bucket[0].device, num_buffers, slot)
            slots[slot] = _start_bucket(bucket, broadcast, stream)
        for pending in slots:
            if pending is not None:
                pending.wait()


def receive_buckets(
    metas: Sequence[TensorMeta],
    broadcast: BroadcastFn,
    load_weights: LoadWeightsFn,
    buffer_size_bytes: int,
    num_buffers: int,
    device: torch.device,
    packed: bool,
) -> None:
    """Consumer: receive the tensors described by `metas`, bucket by bucket, with up to `num_buffers` buckets in
    flight, calling `load_weights` once per bucket in order. If `load_weights` raises, the remaining buckets are
    still received (and dropped) before the error is re-raised.

    `packed=True` mirrors `PackedSender.send` (one flat buffer per bucket, unpacked into views). `packed=False`
    mirrors a sender that broadcasts tensor by tensor: each tensor is received into its own `torch.empty(shape,
    dtype)` and the buckets only batch the `load_weights` calls and bound the memory held.
    """
    _check_params(buffer_size_bytes, num_buffers)
    in_flight: deque[tuple[list[Work], Callable[[], list[tuple[str, torch.Tensor]]]]] = deque()

    # A function, not the loop body, so no local variable keeps a finished bucket's buffer alive.
    def start(chunk: list[TensorMeta]) -> tuple[list[Work], Callable[[], list[tuple[str, torch.Tensor]]]]:
        if packed:
            flat = torch.empty(sum(m.nbytes for m in chunk), dtype=torch.uint8, device=device)
            # Unpacking waits for the data: a misaligned view is a copy, which must not be taken early.
            return [broadcast(flat)], lambda: unpack_tensors(flat, chunk)
        named = [(m.name, torch.empty(m.shape, dtype=m.dtype, device=device)) for m in chunk]
        return [broadcast(as_bytes(t)) for _, t in named], lambda: named

    error: Exception | None = None

    def finish_oldest() -> None:
        nonlocal error
        works, collect = in_flight.popleft()
        for work in works:
            work.wait()
        if error is None:
            try:
                load_weights(collect())
            except Exception as e:
                # Keep receiving (and dropping) the rest: the trainer is mid-broadcast and would otherwise hang, and
                # the group stays in step for the next update.
                error = e

    for bucket in plan_buckets([m.nbytes for m in metas], buffer_size_bytes):
        in_flight.append(start([metas[i] for i in bucket]))
        if len(in_flight) == num_buffers:
            finish_oldest()
    while in_flight:
        finish_oldest()
    if error is not None:
        raise error
