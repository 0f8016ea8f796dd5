"""`vllm.distributed.weight_transfer.nccl_common` (0.33): what the dense and sparse NCCL backends share, and the
trainer's rendezvous that vLLM 0.28+'s trainers call directly."""

from rlserve.weight_transfer.nccl import NCCLWeightTransferInitInfo
from rlserve.weight_transfer.trainer import run_trainer_rendezvous
from rlserve.weight_transfer.vllm_sender import trainer_init

__all__ = ["NCCLWeightTransferInitInfo", "run_trainer_rendezvous", "trainer_init"]
