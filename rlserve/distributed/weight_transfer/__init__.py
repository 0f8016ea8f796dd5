"""`vllm.distributed.weight_transfer` (0.33) as rlserve provides it."""

from typing import Any

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
from rlserve.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from rlserve.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

__all__ = [
    "HTTPVLLMWeightSyncClient",
    "ModuleSource",
    "ParamMeta",
    "Replicate",
    "Shard",
    "TrainerWeightTransferEngine",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightTransferEngine",
    "WeightTransferEngineFactory",
    "WeightTransferTrainerFactory",
]


def __getattr__(name: str) -> Any:
    if name == "RayVLLMWeightSyncClient":  # the `ray` extra's, imported only when asked for
        from rlserve.distributed.weight_transfer import clients

        return clients.RayVLLMWeightSyncClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
