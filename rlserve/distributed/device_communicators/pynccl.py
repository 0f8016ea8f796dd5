"""`vllm.distributed.device_communicators.pynccl` (0.24, 0.33)."""

from rlserve.weight_transfer.pynccl import PyNcclCommunicator

__all__ = ["PyNcclCommunicator"]
