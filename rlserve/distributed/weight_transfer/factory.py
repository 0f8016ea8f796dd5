"""`vllm.distributed.weight_transfer.factory` (0.33)."""

from rlserve.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

__all__ = ["WeightTransferEngineFactory", "WeightTransferTrainerFactory"]
