"""Sparse (delta) backend, vLLM 0.33's `sparse_nccl`: the trainer broadcasts only the elements that changed since the
version the engine holds, as one (flat int32 indices, values) patch per checkpoint tensor, and the engine writes them
in place.

Why indices + values rather than XOR-compressed buckets: an RL step at a small learning rate changes a few percent of
the bf16 weights, scattered, so a patch is 6 bytes per changed element (int32 + bf16) against 2 per element for the
full tensor, 11x fewer bytes at 3%; building it is a compare + nonzero + gather and applying it one scatter, each a
single memory-bound kernel on the GPU. XOR buckets save bytes only through an entropy coder, which torch has no GPU
kernel for; the coder would cost more than the bytes it saves on NVLink or PCIe.

Validation matches a full update's and comes before the first write: the engine checks names and shapes (as for
any update) before receiving, then, with the patches received, that each values dtype is the served dtype (a diff
taken in another dtype may have missed elements that changed once rounded) and every index is in bounds. An invalid
update is refused whole (`WeightUpdateRefused`): nothing is written.

Trainer side: `SparseDelta` keeps the last version the engine acknowledged and diffs the next one against it
bit for bit; `SparseNCCLTrainerWeightTransferEngine.send_weights(patches)` sends one round.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, ClassVar

import torch

from rlserve.config import WeightTransferConfig
from rlserve.dtypes import dtype_name
from rlserve.weight_transfer.base import (
    VllmConfigLike,
    WeightTransferEngine,
    WeightTransferUpdateInfo,
    WeightUpdateRefused,
)
from rlserve.weight_transfer.nccl import (
    DEFAULT_TIMEOUT_S,
    NCCLWeightTransferInitInfo,
    TransferGroup,
    WeightTransferGroup,
    check_unique_id_device,
    join_worker_group,
    receive_broadcast,
)
from rlserve.weight_transfer.nccl_trainer import build_worker_init_payload, open_trainer_endpoint
from rlserve.weight_transfer.source import WeightSource
from rlserve.weight_transfer.trainer import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    run_trainer_rendezvous,
    send_with_update,
)

INDEX_DTYPE = torch.int32  # vLLM's wire type: patchable tensors hold fewer than 2**31 elements
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(_BITS[tensor.element_size()])


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D tensor's bytes, in place (a view)."""
    return tensor.view(torch.uint8)


def _ranges(starts: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
    """Each start repeated count times (int64), built on `device` without waiting for it."""
    total = sum(counts)
    return torch.repeat_interleave(
        torch.tensor(starts, dtype=torch.int64).to(device, non_blocking=True),
        torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True),
        output_size=total,
    )


def _key(tensor: torch.Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.element_size()


@dataclass
class SparseWeightPatch:
    """The changed elements of one checkpoint tensor: flat `indices` (int32) and their new `values`."""

    name: str
    indices: torch.Tensor
    values: torch.Tensor
    full_shape: tuple[int, ...]


@dataclass
class SparseNCCLWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per tensor: name, values dtype, full shape, and how many (index, value) pairs follow on the wire."""

    num_updates_list: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.num_updates_list:
            raise ValueError("`num_updates_list` cannot be empty for sparse updates")
        if len(self.num_updates_list) != len(self.names):
            raise ValueError(
                f"`num_updates_list` should be of the same size as `names`: got {len(self.num_updates_list)} and "
                f"{len(self.names)}"
            )
        for name, count, shape in zip(self.names, self.num_updates_list, self.shapes, strict=True):
            numel = torch.Size(shape).numel()
            if type(count) is not int or count < 0:
                raise ValueError(f"num_updates_list: {name!r}: a count of patched elements is a non-negative int, got "
                                 f"{count!r}")  # fmt: skip
            if count > numel:
                raise ValueError(f"num_updates_list: {name!r} has {numel} elements, cannot patch {count!r} of them")


def _patch_metadata(patches: list[SparseWeightPatch]) -> dict[str, Any]:
    return {
        "names": [p.name for p in patches],
        "dtype_names": [dtype_name(p.values.dtype) for p in patches],
        "shapes": [list(p.full_shape) for p in patches],
        "num_updates_list": [p.indices.numel() for p in patches],
    }


class SparseNCCLWeightTransferEngine(
    WeightTransferEngine[NCCLWeightTransferInitInfo, SparseNCCLWeightTransferUpdateInfo]
):
    """vLLM 0.33-shaped: writes the engine-owned model in place, never through its loader. Same group as `nccl`
    (gloo for CPU tensors); never packed."""

    init_info_cls = NCCLWeightTransferInitInfo
    update_info_cls = SparseNCCLWeightTransferUpdateInfo
    applies_deltas = True

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfigLike,
        device: torch.device,
        model: torch.nn.Module,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.timeout_s = timeout_s
        self.model_update_group: TransferGroup | None = None

    def parse_init_info(self, init_info: dict[str, Any]) -> NCCLWeightTransferInitInfo:
        tp = getattr(self.model, "tp", None)
        if tp is not None and tp.size > 1:
            # A patch's flat indices address whole checkpoint tensors; a rank holds a slice of each.
            raise ValueError("sparse_nccl: needs tensor_parallel_size 1 (patches address whole tensors)")
        ep = getattr(self.model, "ep", None)
        if ep is not None and ep.size > 1:
            # A patch of another rank's expert would be checked against a tensor this rank does not hold.
            raise ValueError("sparse_nccl: not with enable_expert_parallel yet (a rank holds only its experts)")
        info = check_unique_id_device(super().parse_init_info(init_info), self.device)
        if info.packed:
            raise ValueError(
                "Invalid init_info for SparseNCCLWeightTransferEngine: packed: sparse updates are never packed"
            )
        return info

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        self.shutdown()
        parallel = self.parallel_config
        index = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.model_update_group = join_worker_group(init_info, index, self.timeout_s, self.device)

    def receive_weights(self, update_info: SparseNCCLWeightTransferUpdateInfo) -> None:
        patches = self._receive_patches(update_info)
        writes = self._check(patches)
        with torch.no_grad():
            for target, patch in writes:
                # As bits (view, never a copy): the same bytes, and index_copy_ has no float8 kernel on CPU.
                bits = target.view(-1).view(_BITS[target.element_size()])
                bits.index_copy_(0, patch.indices.long(), _bits(patch.values))
        drop_derived = getattr(self.model, "drop_derived_weights", None)
        if callable(drop_derived):  # rlserve's model keeps an fp32 copy of the LM head
            drop_derived()

    def discard_weights(self, update_info: SparseNCCLWeightTransferUpdateInfo) -> None:
        self._receive_patches(update_info)

    def _receive_patches(self, update_info: SparseNCCLWeightTransferUpdateInfo) -> list[SparseWeightPatch]:
        group = self.model_update_group
        if group is None:
            raise self._not_initialized()
        patches, works = [], []
        for name, dtype, shape, count in zip(
            update_info.names, update_info.dtypes, update_info.shapes, update_info.num_updates_list, strict=True
        ):
            patch = SparseWeightPatch(
                name,
                torch.empty(count, dtype=INDEX_DTYPE, device=self.device),
                torch.empty(count, dtype=dtype, device=self.device),
                tuple(shape),
            )
            patches.append(patch)
            if count:  # both sides skip empty patches: nothing to say
                # As bytes: the same on the wire, and gloo has no float8 type (an FP8 engine's patches).
                works += [receive_broadcast(group, _bytes(t), self.timeout_s) for t in (patch.indices, patch.values)]
        for work in works:
            work.wait()
        return patches

    def _check(self, patches: list[SparseWeightPatch]) -> list[tuple[torch.Tensor, SparseWeightPatch]]:
        """Every patch against the model, before any is written: its tensor, the served dtype, index bounds."""
        views = dict(self.model.checkpoint_weights())
        writes = []
        for patch in patches:
            keys = self.model.written_names(patch.name, patch.values.dtype)
            if not keys:
                continue  # a tensor the model ignores, as a full update would
            target = views[keys[0]]
            if patch.values.dtype != target.dtype:  # an FP8 engine's weights included: diff the fp8 bytes
                raise WeightUpdateRefused(
                    f"weight {patch.name!r}: sparse values are {patch.values.dtype}, the model serves "
                    f"{target.dtype}: diff the weights in the served dtype"
                )
            if len(keys) != 1:
                raise WeightUpdateRefused(
                    f"weight {patch.name!r}: a stacked tensor; send a sparse patch per checkpoint tensor "
                    f"({keys[0]!r}, ...)"
                )
            writes.append((target, patch))
        _check_bounds([(target.numel(), patch) for target, patch in writes if patch.indices.numel()])
        return writes

    def shutdown(self) -> None:
        if self.model_update_group is not None:
            self.model_update_group.destroy()
            self.model_update_group = None


def _check_bounds(patches: list[tuple[int, SparseWeightPatch]]) -> None:
    """Every index of every (target numel, patch) in [0, numel), with one wait for the device however many patches."""
    if not patches:
        return
    counts = [patch.indices.numel() for _, patch in patches]
    indices = torch.cat([patch.indices for _, patch in patches]).long()
    limits = _ranges([numel for numel, _ in patches], counts, indices.device)
    bad = ((indices < 0) | (indices >= limits)).nonzero().view(-1)
    if bad.numel():
        at = int(bad[0])
        numel, patch = patches[bisect_right(list(accumulate(counts)), at)]
        raise WeightUpdateRefused(
            f"weight {patch.name!r}: sparse index {int(indices[at])} is out of bounds for its {numel} elements"
        )


# --- Trainer side -----------------------------------------------------------------------------------------------------


class SparseDelta:
    """The version the engine holds, kept on the trainer (a copy of every tensor, in the dtype it is served in), and
    the patches that bring it to the next version: the elements whose bits differ (so -0.0 vs 0.0 and NaNs count as
    they are stored). `commit` once the engine has applied them.

    Why one flat buffer per (device, element size) and diffs over chunks of it: per tensor, a diff is a compare, a
    nonzero (which waits for the GPU) and a gather, so a model of a few hundred tensors spent its time in launches and
    waits, not in the bytes (70 ms for 310 tensors on an H200 where the compare itself takes under 1 ms). A chunk of
    consecutive tensors (`chunk_bytes`, which also bounds the extra memory) is diffed with a handful of kernels and
    two waits, and a commit is one scatter per buffer."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int = 256 << 20) -> None:
        groups: dict[tuple[torch.device, int], list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in weights:
            groups.setdefault((tensor.device, tensor.element_size()), []).append((name, tensor.detach()))
        self.chunk_bytes = chunk_bytes
        self.previous: dict[str, torch.Tensor] = {}
        self._flat: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._offset: dict[str, int] = {}
        for key, members in groups.items():
            flat = torch.empty(sum(t.numel() for _, t in members), dtype=_BITS[key[1]], device=key[0])
            offset = 0
            for name, tensor in members:
                view = flat[offset : offset + tensor.numel()]
                view.copy_(_bits(tensor))
                self.previous[name] = view.view(tensor.dtype).view(tensor.shape)
                self._offset[name] = offset
                offset += tensor.numel()
            self._flat[key] = flat

    def patches(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[SparseWeightPatch]:
        items = [(name, tensor.detach()) for name, tensor in weights]
        for name, tensor in items:
            previous = self.previous.get(name)
            if previous is None:
                raise ValueError(f"SparseDelta: {name!r} is not in the version it holds")
            if previous.shape != tensor.shape or previous.dtype != tensor.dtype or previous.device != tensor.device:
                raise ValueError(
                    f"SparseDelta: {name!r} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, the version "
                    f"it holds {tuple(previous.shape)} {previous.dtype} on {previous.device}"
                )
            if tensor.numel() >= 2**31:
                raise ValueError(f"SparseDelta: {name!r} has {tensor.numel()} elements, more than int32 indices reach")
        found: dict[str, SparseWeightPatch] = {}
        for chunk in self._chunks(items):
            found.update(self._diff(chunk))
        return [found[name] for name, _ in items]

    def _chunks(self, items: list[tuple[str, torch.Tensor]]) -> Iterable[list[tuple[str, torch.Tensor]]]:
        """Consecutive tensors of one flat buffer, up to `chunk_bytes` each (a larger tensor alone)."""
        chunk: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in items:
            if chunk and (_key(chunk[0][1]) != _key(tensor) or size + tensor.nbytes > self.chunk_bytes):
                yield chunk
                chunk, size = [], 0
            chunk.append((name, tensor))
            size += tensor.nbytes
        if chunk:
            yield chunk

    def _diff(self, chunk: list[tuple[str, torch.Tensor]]) -> dict[str, SparseWeightPatch]:
        flat = self._flat[_key(chunk[0][1])]
        bounds = list(accumulate((t.numel() for _, t in chunk), initial=0))
        starts = bounds[:-1]
        first = self._offset[chunk[0][0]]
        if all(self._offset[name] == first + start for (name, _), start in zip(chunk, starts, strict=True)):
            previous = flat[first : first + bounds[-1]]  # the usual case: the order they were first given in
        else:
            previous = torch.cat([flat[self._offset[n] : self._offset[n] + t.numel()] for n, t in chunk])
        current = torch.cat([_bits(t) for _, t in chunk]) if len(chunk) > 1 else _bits(chunk[0][1])
        changed = (current != previous).nonzero().view(-1)
        counts = torch.searchsorted(changed, torch.tensor(bounds, device=changed.device))
        counts = counts.diff().tolist()
        indices = (changed - _ranges(starts, counts, changed.device)).to(INDEX_DTYPE)
        values = current[changed]
        patches = {}
        for (name, tensor), index, value in zip(chunk, indices.split(counts), values.split(counts), strict=True):
            patches[name] = SparseWeightPatch(name, index, value.view(tensor.dtype), tuple(tensor.shape))
        return patches

    def commit(self, patches: Iterable[SparseWeightPatch]) -> None:
        groups: dict[tuple[torch.device, int], list[SparseWeightPatch]] = {}
        for patch in patches:
            if patch.indices.numel():
                groups.setdefault(_key(self.previous[patch.name]), []).append(patch)
        for key, members in groups.items():
            counts = [p.indices.numel() for p in members]
            flat = self._flat[key]
            where = torch.cat([p.indices for p in members]).long()
            where += _ranges([self._offset[p.name] for p in members], counts, flat.device)
            flat.index_copy_(0, where, torch.cat([_bits(p.values) for p in members]))


@dataclass
class SparseNCCLTrainerInitInfo(TrainerInitInfo):
    """The same rendezvous as `nccl`'s, without wire parameters: sparse transfers are never packed."""

    backend: ClassVar[str] = "sparse_nccl"

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


class SparseNCCLTrainerWeightTransferEngine(TrainerWeightTransferEngine[SparseNCCLTrainerInitInfo]):
    """Broadcasts each round's patches from rank 0 while the engine's `update_weights` receives them. Takes no
    `WeightSource`: patches differ every round (see `SparseDelta`). An empty round sends nothing. Its parts keep
    vLLM's names, as `NCCLTrainerWeightTransferEngine`'s do (`model_update_group`, `open_trainer_endpoint`)."""

    init_info_cls = SparseNCCLTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None, is_sender: bool = True
    ) -> None:
        if source is not None:  # a delta backend: a source would silently never be sent
            raise ValueError(
                "Sparse NCCL weight transfer takes no WeightSource; pass each round's patches to send_weights(patches)"
            )
        super().__init__(client=client, is_sender=is_sender)
        self.model_update_group: WeightTransferGroup | None = None

    @classmethod
    def _build_worker_init_payload(cls, init_info: SparseNCCLTrainerInitInfo) -> dict[str, Any]:
        return build_worker_init_payload(init_info)

    @classmethod
    def trainer_init(
        cls, init_info: SparseNCCLTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> SparseNCCLTrainerWeightTransferEngine:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:
            payload = cls._build_worker_init_payload(init_info)
            run_trainer_rendezvous(
                init_worker=lambda: client.init_weight_transfer_engine(payload),
                init_trainer=lambda: setattr(engine, "model_update_group", open_trainer_endpoint(init_info)),
            )
        return engine

    def send_weights(self, patches: Iterable[SparseWeightPatch] | None = None) -> None:
        """One whole update (start, the patches, finish)."""
        prepared = self._prepare(patches)
        if prepared:
            self.client.start_weight_update()
            self._broadcast(prepared)
            self.client.finish_weight_update()

    def send_weight_chunk(self, patches: Iterable[SparseWeightPatch] | None = None) -> None:
        """Patches inside an update whose start and finish the caller drives."""
        prepared = self._prepare(patches)
        if prepared:
            self._broadcast(prepared)

    def _prepare(self, patches: Iterable[SparseWeightPatch] | None) -> list[SparseWeightPatch]:
        if not self.is_sender:
            return []
        prepared = list(patches or [])
        if prepared and self.model_update_group is None:
            raise RuntimeError("send_weights before trainer_init() or after shutdown(): call trainer_init")
        for p in prepared:
            # vLLM's checks and messages, before any call reaches the engine
            if p.full_shape is None:
                raise ValueError(f"Sparse patch requires full_shape: {p.name}")
            if p.indices.dtype != INDEX_DTYPE:
                raise ValueError(f"Sparse weight updates require int32 indices: {p.name}")
            if p.indices.ndim != 1 or p.values.ndim != 1:
                raise ValueError(f"Sparse weight patches must be 1D flattened updates: {p.name}")
            if p.indices.numel() != p.values.numel():
                raise ValueError(
                    f"`indices` and `values` must have matching lengths for {p.name}: {p.indices.numel()} indices, "
                    f"{p.values.numel()} values"
                )
        return prepared

    def _broadcast(self, patches: list[SparseWeightPatch]) -> None:
        group = self.model_update_group
        assert group is not None
        update_info = _patch_metadata(patches)

        def send() -> None:
            works = [
                group.broadcast(_bytes(t.contiguous()), src=0)  # as the engine receives them
                for p in patches
                if p.indices.numel()
                for t in (p.indices, p.values)
            ]
            for work in works:
                work.wait()
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the caller may free or rebuild the patches once this returns

        send_with_update(lambda: self.client.update_weights(update_info), send)

    def shutdown(self) -> None:
        if self.model_update_group is not None:
            self.model_update_group.destroy()
            self.model_update_group = None
