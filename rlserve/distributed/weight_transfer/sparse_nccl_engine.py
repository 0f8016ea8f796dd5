"""`vllm.distributed.weight_transfer.sparse_nccl_engine` (0.33)."""

from rlserve.weight_transfer.nccl_trainer import open_trainer_endpoint
from rlserve.weight_transfer.sparse_nccl import (
    SparseNCCLTrainerInitInfo,
    SparseNCCLTrainerWeightTransferEngine,
    SparseNCCLWeightTransferEngine,
    SparseNCCLWeightTransferUpdateInfo,
    SparseWeightPatch,
)

__all__ = [
    "SparseNCCLTrainerInitInfo",
    "SparseNCCLTrainerWeightTransferEngine",
    "SparseNCCLWeightTransferEngine",
    "SparseNCCLWeightTransferUpdateInfo",
    "SparseWeightPatch",
    "open_trainer_endpoint",
]
