"""`vllm.distributed.weight_transfer.packed_tensor` (0.33): the trainer's packed broadcast and its defaults."""

from rlserve.weight_transfer.nccl import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS
from rlserve.weight_transfer.vllm_sender import packed_nccl_broadcast_producer

__all__ = ["DEFAULT_PACKED_BUFFER_SIZE_BYTES", "DEFAULT_PACKED_NUM_BUFFERS", "packed_nccl_broadcast_producer"]
