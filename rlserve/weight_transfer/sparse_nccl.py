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

from collections.abc import Iterable
from dataclasses import dataclass, field
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
    WeightTransferGroup,
    check_no_unique_id,
    join_worker_group,
    receive_broadcast,
)
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
            if type(count) is not int or not 0 <= count <= numel:
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
        self._group: WeightTransferGroup | None = None

    def parse_init_info(self, init_info: dict[str, Any]) -> NCCLWeightTransferInitInfo:
        check_no_unique_id(init_info)
        tp = getattr(self.model, "tp", None)
        if tp is not None and tp.size > 1:
            # A patch's flat indices address whole checkpoint tensors; a rank holds a slice of each.
            raise ValueError("sparse_nccl: needs tensor_parallel_size 1 (patches address whole tensors)")
        ep = getattr(self.model, "ep", None)
        if ep is not None and ep.size > 1:
            # A patch of another rank's expert would be checked against a tensor this rank does not hold.
            raise ValueError("sparse_nccl: not with enable_expert_parallel yet (a rank holds only its experts)")
        info = super().parse_init_info(init_info)
        if info.packed:
            raise ValueError(
                "Invalid init_info for SparseNCCLWeightTransferEngine: packed: sparse updates are never packed"
            )
        return info

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        self.shutdown()
        parallel = self.parallel_config
        index = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self._group = join_worker_group(init_info, index, self.timeout_s)

    def receive_weights(self, update_info: SparseNCCLWeightTransferUpdateInfo) -> None:
        patches = self._receive_patches(update_info)
        writes = self._check(patches)
        with torch.no_grad():
            for target, patch in writes:
                target.view(-1).index_copy_(0, patch.indices.long(), patch.values)
        drop_derived = getattr(self.model, "drop_derived_weights", None)
        if callable(drop_derived):  # rlserve's model keeps an fp32 copy of the LM head
            drop_derived()

    def discard_weights(self, update_info: SparseNCCLWeightTransferUpdateInfo) -> None:
        self._receive_patches(update_info)

    def _receive_patches(self, update_info: SparseNCCLWeightTransferUpdateInfo) -> list[SparseWeightPatch]:
        group = self._group
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
                works += [receive_broadcast(group, t, self.timeout_s) for t in (patch.indices, patch.values)]
        for work in works:
            work.wait()
        return patches

    def _check(self, patches: list[SparseWeightPatch]) -> list[tuple[torch.Tensor, SparseWeightPatch]]:
        """Every patch against the model, before any is written: its tensor, the served dtype, index bounds."""
        views = dict(self.model.checkpoint_weights())
        writes = []
        for patch in patches:
            keys = self.model.written_names(patch.name)
            if not keys:
                continue  # a tensor the model ignores, as a full update would
            if len(keys) != 1:
                raise WeightUpdateRefused(
                    f"weight {patch.name!r}: a stacked tensor; send a sparse patch per checkpoint tensor "
                    f"({keys[0]!r}, ...)"
                )
            target = views[keys[0]]
            if patch.values.dtype != target.dtype:
                raise WeightUpdateRefused(
                    f"weight {patch.name!r}: sparse values are {patch.values.dtype}, the model serves "
                    f"{target.dtype}: diff the weights in the served dtype"
                )
            if patch.indices.numel():
                low, high = int(patch.indices.min()), int(patch.indices.max())
                if low < 0 or high >= target.numel():
                    raise WeightUpdateRefused(
                        f"weight {patch.name!r}: sparse index {low if low < 0 else high} is out of bounds for its "
                        f"{target.numel()} elements"
                    )
            writes.append((target, patch))
        return writes

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.shutdown()
        self._group = None


# --- Trainer side -----------------------------------------------------------------------------------------------------


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(_BITS[tensor.element_size()])


class SparseDelta:
    """The version the engine holds, kept on the trainer (a copy of every tensor, in the dtype it is served in), and
    the patches that bring it to the next version: the elements whose bits differ (so -0.0 vs 0.0 and NaNs count as
    they are stored). `commit` once the engine has applied them."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.previous = {name: tensor.detach().clone() for name, tensor in weights}

    def patches(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[SparseWeightPatch]:
        patches = []
        for name, tensor in weights:
            previous = self.previous.get(name)
            if previous is None:
                raise ValueError(f"SparseDelta: {name!r} is not in the version it holds")
            if previous.shape != tensor.shape or previous.dtype != tensor.dtype:
                raise ValueError(
                    f"SparseDelta: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the version it holds "
                    f"{tuple(previous.shape)} {previous.dtype}"
                )
            if tensor.numel() >= 2**31:
                raise ValueError(f"SparseDelta: {name!r} has {tensor.numel()} elements, more than int32 indices reach")
            flat = tensor.detach().reshape(-1)
            indices = (_bits(flat) != _bits(previous)).nonzero().view(-1)
            patches.append(SparseWeightPatch(name, indices.to(INDEX_DTYPE), flat[indices], tuple(tensor.shape)))
        return patches

    def commit(self, patches: Iterable[SparseWeightPatch]) -> None:
        for patch in patches:
            self.previous[patch.name].view(-1)[patch.indices.long()] = patch.values


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
    `WeightSource`: patches differ every round (see `SparseDelta`). An empty round sends nothing."""

    init_info_cls = SparseNCCLTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, init_info: SparseNCCLTrainerInitInfo) -> None:
        super().__init__(client=client, is_sender=init_info.is_sender, rank=init_info.rank)
        self.group: WeightTransferGroup | None = None

    @classmethod
    def trainer_init(
        cls, init_info: SparseNCCLTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> SparseNCCLTrainerWeightTransferEngine:
        if source is not None:
            raise ValueError("sparse_nccl takes no WeightSource: pass each round's patches to send_weights(patches)")
        engine = cls(client=client, init_info=init_info)
        if not engine.is_sender:
            return engine
        worker = {
            "master_address": init_info.master_address,
            "master_port": init_info.master_port,
            "world_size": init_info.world_size,
            "rank_offset": 1,
        }

        def open_group() -> None:
            engine.group = WeightTransferGroup.create(
                init_info.master_address, init_info.master_port, 0, init_info.world_size, init_info.timeout_s
            )

        run_trainer_rendezvous(init_worker=lambda: client.init_weight_transfer_engine(worker), init_trainer=open_group)
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
        if prepared and self.group is None:
            raise RuntimeError("send_weights after shutdown(): call trainer_init again")
        for p in prepared:
            if p.indices.dtype != INDEX_DTYPE or p.indices.ndim != 1 or p.values.ndim != 1:
                raise ValueError(f"sparse patch {p.name!r}: indices must be 1-D int32 and values 1-D")
            if p.indices.numel() != p.values.numel():
                raise ValueError(f"sparse patch {p.name!r}: {p.indices.numel()} indices for {p.values.numel()} values")
        return prepared

    def _broadcast(self, patches: list[SparseWeightPatch]) -> None:
        group = self.group
        assert group is not None
        update_info = _patch_metadata(patches)

        def send() -> None:
            works = [
                group.broadcast(t.contiguous(), src=0)
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
        if self.group is not None:
            self.group.shutdown()
            self.group = None
