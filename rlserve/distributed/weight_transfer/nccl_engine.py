"""`vllm.distributed.weight_transfer.nccl_engine` (0.33, and 0.24's `NCCLTrainerSendWeightsArgs`). As in vLLM, the
trainer engine opens its end of the group through this module's `open_trainer_endpoint` (rlserve's: the group of
`rlserve.weight_transfer.nccl`, which the engine tells apart from vLLM's own trainer's by its handshake)."""

from rlserve.weight_transfer.nccl import (
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)
from rlserve.weight_transfer.nccl_trainer import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    open_trainer_endpoint,
)

__all__ = [
    "NCCLTrainerInitInfo",
    "NCCLTrainerSendWeightsArgs",
    "NCCLTrainerWeightTransferEngine",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
    "NCCLWeightTransferUpdateInfo",
    "open_trainer_endpoint",
]
