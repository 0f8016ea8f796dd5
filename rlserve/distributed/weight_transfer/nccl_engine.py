"""`vllm.distributed.weight_transfer.nccl_engine` (0.33, and 0.24's `NCCLTrainerSendWeightsArgs`)."""

from rlserve.weight_transfer.nccl import (
    NCCLTrainerInitInfo,
    NCCLTrainerSendWeightsArgs,
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)

__all__ = [
    "NCCLTrainerInitInfo",
    "NCCLTrainerSendWeightsArgs",
    "NCCLTrainerWeightTransferEngine",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
    "NCCLWeightTransferUpdateInfo",
]
