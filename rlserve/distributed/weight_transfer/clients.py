"""`vllm.distributed.weight_transfer.clients` (0.33)."""

from rlserve.rl.sync_clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient

__all__ = ["HTTPVLLMWeightSyncClient", "RayVLLMWeightSyncClient"]
