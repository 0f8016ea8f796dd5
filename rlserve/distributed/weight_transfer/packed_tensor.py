"""`vllm.distributed.weight_transfer.packed_tensor` (0.24, 0.33): packing, the packed broadcast's producer and
consumer, the packed CUDA-IPC producer and consumer, and their defaults."""

from rlserve.weight_transfer.nccl import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS
from rlserve.weight_transfer.vllm_packed import (
    PackedBufferImporter,
    PackedChunk,
    PackedIpcChunk,
    pack_tensors,
    packed_ipc_consumer,
    packed_ipc_producer,
    packed_nccl_broadcast_consumer,
    unpack_tensor,
)
from rlserve.weight_transfer.vllm_sender import packed_nccl_broadcast_producer

__all__ = [
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "DEFAULT_PACKED_NUM_BUFFERS",
    "PackedBufferImporter",
    "PackedChunk",
    "PackedIpcChunk",
    "pack_tensors",
    "packed_ipc_consumer",
    "packed_ipc_producer",
    "packed_nccl_broadcast_consumer",
    "packed_nccl_broadcast_producer",
    "unpack_tensor",
]
