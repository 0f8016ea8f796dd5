"""Weight transfer from a trainer into a running engine, with vLLM's native weight-sync API shapes.

Engine side: `WeightTransferEngineFactory.create_engine(config, device, model=...)` -> a `WeightTransferEngine` (of
vLLM 0.33's shape or 0.24's). Trainer side, 0.24: `NCCLWeightTransferEngine.trainer_init` / `trainer_send_weights` and
`IPCWeightTransferEngine.trainer_send_weights`; 0.33: `WeightTransferTrainerFactory.trainer_init(init_info, client=,
source=)` -> a `TrainerWeightTransferEngine` (`trainer.py`, `source.py`; vLLM's import paths in
`rlserve.distributed.weight_transfer`).
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
from rlserve.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from rlserve.weight_transfer.ipc import (
    IPCStagingBuffer,
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
    "IPCStagingBuffer",
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
    "WeightTransferTrainerFactory",
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
