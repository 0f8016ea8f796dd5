"""`vllm.distributed.weight_transfer.nccl_engine` (0.33)."""

from rlserve.weight_transfer.nccl import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)

__all__ = [
    "NCCLTrainerInitInfo",
    "NCCLTrainerWeightTransferEngine",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
    "NCCLWeightTransferUpdateInfo",
]
