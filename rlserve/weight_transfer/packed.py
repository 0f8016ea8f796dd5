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
    bucket overshoots by less than one item, and an item larger than the budget closes the bucket it joined).
    This is vLLM's rule, on both of its sides (0.24.0 and 0.33.0, `packed_tensor.pack_tensors` and
    `packed_nccl_broadcast_consumer`): a vLLM trainer's buckets split where rlserve's do. Streams, so the producer
    never holds more than the bucket being built."""
    _check_params(buffer_size_bytes)
    bucket: list[T] = []
    total = 0
    for item in items:
        bucket.append(item)
        total += byte_size(item)
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
            largest = max(t.nbytes for t in bucket)
            if largest > buffer_size_bytes and buffer_size_bytes not in self._warned_budgets:
                self._warned_budgets.add(buffer_size_bytes)
                logger.warning(
                    "a tensor of %d bytes exceeds the packed buffer size (%d bytes): its bucket needs more than the "
                    "buffer size on both sides",
                    largest,
                    buffer_size_bytes,
                )
            stream = self._slot_stream(bucket[0].device, num_buffers, slot)
            slots[slot] = _start_bucket(bucket, broadcast, stream)
        for pending in slots:
            if pending is not None:
                pending.wait()


def slot_buffers(sizes: Sequence[int], num_buffers: int, device: torch.device) -> list[torch.Tensor]:
    """The alternating receive buffers of a bucket sequence: bucket i goes into buffer i % len(result), each buffer
    as large as the largest bucket it holds (no more buffers than buckets)."""
    slots = min(num_buffers, len(sizes))
    return [torch.empty(max(sizes[s::slots]), dtype=torch.uint8, device=device) for s in range(slots)]


class PackedReceiver:
    """Consumer of bucketed broadcasts (packed, or tensor by tensor): `receive` takes the tensors bucket by bucket
    into `num_buffers` alternating buffers and calls `load_weights` once per bucket, in order, the next bucket's
    receive already issued while the current one is loaded (with one buffer: receive, load, receive...).

    The double-buffer hazards are excluded by construction:
    - every buffer is allocated before the first receive and kept to the end, so none is freed (and handed out by
      the allocator) while a stream may still use it;
    - a buffer gets its next receive only after the load of its previous bucket: on the host, once `load_weights`
      returned (gloo); on CUDA, the receive stream waits for an event recorded on the unpack stream after that load;
    - a bucket is loaded only after its receive: the unpack stream (host, on CPU) waits for the receive's Work.

    On CUDA the receives are issued on one stream and the loads run on another, both after the caller's stream (the
    model may still be read there), and the caller's stream waits for the loads at the end. Keep one per engine-side
    connection: its streams are created once (fresh streams per call leak allocator pools, as on the sender).
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    def _receive_and_unpack_streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream] | None:
        if device.type != "cuda":
            return None
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._streams[device]

    def receive(
        self,
        metas: Sequence[TensorMeta],
        broadcast: BroadcastFn,
        load_weights: LoadWeightsFn,
        buffer_size_bytes: int,
        num_buffers: int,
        device: torch.device,
        packed: bool,
    ) -> None:
        """Receive the tensors described by `metas`. If `load_weights` raises, the remaining buckets are still
        received (and dropped) before the error is re-raised; a receive that fails (the trainer is gone) raises at
        once.

        `packed=True` mirrors `PackedSender.send` (one broadcast per bucket). `packed=False` mirrors a sender that
        broadcasts tensor by tensor: each tensor lands at its place in the bucket's buffer, and the buckets only
        batch the `load_weights` calls and bound the memory held. Either way a bucket is unpacked into views.
        """
        _check_params(buffer_size_bytes, num_buffers)
        buckets = [[metas[i] for i in b] for b in plan_buckets([m.nbytes for m in metas], buffer_size_bytes)]
        if not buckets:
            return
        sizes = [sum(m.nbytes for m in bucket) for bucket in buckets]
        buffers = slot_buffers(sizes, num_buffers, device)
        slots = len(buffers)
        streams = self._receive_and_unpack_streams(device)
        receive_stream, unpack_stream = streams or (None, None)
        caller = torch.cuda.current_stream(device) if streams else None
        if streams:
            receive_stream.wait_stream(caller)
            unpack_stream.wait_stream(caller)
        unpacked: list[torch.cuda.Event | None] = [None] * slots  # a buffer's previous bucket is loaded
        in_flight: deque[tuple[int, list[Work]]] = deque()
        error: Exception | None = None

        def start(index: int) -> None:
            slot = index % slots
            view = buffers[slot][: sizes[index]]
            with torch.cuda.stream(receive_stream):  # None (CPU): no stream, the host order is the order
                event = unpacked[slot]
                if event is not None:
                    receive_stream.wait_event(event)
                if packed:
                    works = [broadcast(view)]
                else:
                    works = [broadcast(part) for part in view.split([m.nbytes for m in buckets[index]])]
            in_flight.append((index, works))

        def finish_oldest() -> None:
            nonlocal error
            index, works = in_flight.popleft()
            slot = index % slots
            with torch.cuda.stream(unpack_stream):
                for work in works:
                    work.wait()  # NCCL: the unpack stream waits for the receive; gloo: the host does
                if error is None:
                    try:
                        load_weights(unpack_tensors(buffers[slot], buckets[index]))
                    except Exception as e:
                        # Keep receiving (and dropping) the rest: the trainer is mid-broadcast and would otherwise
                        # hang, and the group stays in step for the next update.
                        error = e
                if unpack_stream is not None:
                    event = unpacked[slot] = torch.cuda.Event()
                    event.record(unpack_stream)

        try:
            for index in range(len(buckets)):
                if len(in_flight) == slots:
                    finish_oldest()  # frees the buffer the next receive goes into
                start(index)
            while in_flight:
                finish_oldest()
        finally:
            if streams:
                caller.wait_stream(unpack_stream)  # the caller sees the loaded weights; the buffers die after it
        if error is not None:
            raise error
