"""`vllm.distributed.weight_transfer.clients` (0.33). `RayVLLMWeightSyncClient` comes from `rlserve.ray` (the `ray`
extra) when first asked for, so this module imports without Ray."""

from typing import Any

from rlserve.rl.sync_clients import HTTPVLLMWeightSyncClient

__all__ = ["HTTPVLLMWeightSyncClient"]  # and RayVLLMWeightSyncClient, on demand


def __getattr__(name: str) -> Any:
    if name == "RayVLLMWeightSyncClient":
        from rlserve.ray import RayVLLMWeightSyncClient

        return RayVLLMWeightSyncClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
