"""`vllm.distributed.weight_transfer` (0.33) as rlserve provides it."""

from rlserve.distributed.weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    Replicate,
    Shard,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)
from rlserve.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient
from rlserve.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

__all__ = [
    "HTTPVLLMWeightSyncClient",
    "ModuleSource",
    "ParamMeta",
    "RayVLLMWeightSyncClient",
    "Replicate",
    "Shard",
    "TrainerWeightTransferEngine",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightTransferEngine",
    "WeightTransferEngineFactory",
    "WeightTransferTrainerFactory",
]
