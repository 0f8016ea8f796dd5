"""`vllm.distributed.weight_transfer.nccl_common` (0.33): what the dense and sparse NCCL backends share."""

from rlserve.weight_transfer.nccl import NCCLWeightTransferInitInfo
from rlserve.weight_transfer.trainer import run_trainer_rendezvous

__all__ = ["NCCLWeightTransferInitInfo", "run_trainer_rendezvous"]
