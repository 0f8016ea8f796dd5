"""Weight transfer from a trainer into a running engine, with vLLM's native weight-sync API shapes.

Engine side: `WeightTransferEngineFactory.create_engine(config, device)` -> a `WeightTransferEngine`. Trainer side:
`NCCLWeightTransferEngine.trainer_init` / `trainer_send_weights` and `IPCWeightTransferEngine.trainer_send_weights`.
"""

from rlserve.weight_transfer.base import (
    TRAINER_LOST,
    LoadWeightsFn,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
)
from rlserve.weight_transfer.checksum import compare_checksums, tensor_sha256, weight_checksums
from rlserve.weight_transfer.factory import WeightTransferEngineFactory
from rlserve.weight_transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
)
from rlserve.weight_transfer.nccl import (
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
    WeightTransferGroup,
)
from rlserve.weight_transfer.packed import plan_buckets

__all__ = [
    "TRAINER_LOST",
    "IPCTrainerSendWeightsArgs",
    "IPCWeightTransferEngine",
    "IPCWeightTransferInitInfo",
    "IPCWeightTransferUpdateInfo",
    "LoadWeightsFn",
    "NCCLTrainerSendWeightsArgs",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
    "NCCLWeightTransferUpdateInfo",
    "WeightTransferEngine",
    "WeightTransferEngineFactory",
    "WeightTransferGroup",
    "WeightTransferInitInfo",
    "WeightTransferInitRequest",
    "WeightTransferUpdateInfo",
    "WeightTransferUpdateRequest",
    "compare_checksums",
    "plan_buckets",
    "tensor_sha256",
    "weight_checksums",
]
