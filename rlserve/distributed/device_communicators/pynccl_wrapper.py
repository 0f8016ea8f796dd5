"""`vllm.distributed.device_communicators.pynccl_wrapper` (0.24, 0.33): the NCCL binding's public names."""

from rlserve.weight_transfer.nccl_library import NCCL_UNIQUE_ID_BYTES, NCCLLibrary, ncclUniqueId

__all__ = ["NCCL_UNIQUE_ID_BYTES", "NCCLLibrary", "ncclUniqueId"]
