"""`vllm.distributed.weight_transfer.base` (0.33; `SparseWeightPatch` is where 0.24 kept it)."""

from rlserve.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
)
from rlserve.weight_transfer.source import (
    ModuleSource,
    ParamMeta,
    Replicate,
    Shard,
    WeightSource,
    materialize_full_tensor,
)
from rlserve.weight_transfer.sparse_nccl import SparseWeightPatch
from rlserve.weight_transfer.trainer import TrainerInitInfo, TrainerWeightTransferEngine, VLLMWeightSyncClient

__all__ = [
    "ModuleSource",
    "ParamMeta",
    "Replicate",
    "Shard",
    "SparseWeightPatch",
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferInitRequest",
    "WeightTransferUpdateInfo",
    "WeightTransferUpdateRequest",
    "materialize_full_tensor",
]
