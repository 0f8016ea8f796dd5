"""`vllm.distributed.weight_transfer.sparse_nccl_engine` (0.33)."""

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
]
