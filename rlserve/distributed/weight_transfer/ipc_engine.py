"""`vllm.distributed.weight_transfer.ipc_engine` (0.33)."""

from rlserve.weight_transfer.ipc import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
    IPCWeightTransferEngine,
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
)

__all__ = [
    "IPCTrainerInitInfo",
    "IPCTrainerWeightTransferEngine",
    "IPCWeightTransferEngine",
    "IPCWeightTransferInitInfo",
    "IPCWeightTransferUpdateInfo",
]
