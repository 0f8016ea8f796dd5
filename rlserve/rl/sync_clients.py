"""vLLM 0.33's `HTTPVLLMWeightSyncClient`: the engine's weight-sync control plane over HTTP (`rlserve serve`).
rlserve's `LLM` is itself a `VLLMWeightSyncClient`, in-process; `rlserve.ray.RayVLLMWeightSyncClient` drives engines
that are Ray actors. A `TrainerWeightTransferEngine` drives any of them."""

from __future__ import annotations

from rlserve.rl.client import RLServeClient


class HTTPVLLMWeightSyncClient(RLServeClient):
    """`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`,
    `/shutdown_weight_transfer_engine` of a server; errors raise `RLServeError` with the server's message and the
    field it names. IPC handles travel as plain JSON (rlserve never unpickles request data), so nothing is pickled."""

    def __init__(self, base_url: str, timeout: float = 300, api_key: str | None = None) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout)
