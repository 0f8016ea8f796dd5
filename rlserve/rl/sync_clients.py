"""vLLM 0.33's `VLLMWeightSyncClient`s: the engine's weight-sync control plane over HTTP (`rlserve serve`) or on Ray
actors. rlserve's `LLM` is itself one, in-process. A `TrainerWeightTransferEngine` drives any of them."""

from __future__ import annotations

from typing import Any

from rlserve.rl.client import RLServeClient
from rlserve.weight_transfer import WeightTransferInitRequest, WeightTransferUpdateRequest
from rlserve.weight_transfer.trainer import UpdatePayload


class HTTPVLLMWeightSyncClient(RLServeClient):
    """`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`,
    `/shutdown_weight_transfer_engine` of a server; errors raise `RLServeError` with the server's message and the
    field it names. IPC handles travel as plain JSON (rlserve never unpickles request data), so nothing is pickled."""

    def __init__(self, base_url: str, timeout: float = 300, api_key: str | None = None) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout)


class RayVLLMWeightSyncClient:
    """Drives one or more engine actors (anything exposing the engine's weight-sync methods: `init_weight_transfer_
    engine`, `start_weight_update`, `update_weights`, `finish_weight_update`, `update_weight_version`,
    `shutdown_weight_transfer_engine`, e.g. `ray.remote(LLM)`): each call goes to every actor and waits for all, so
    data-parallel replicas update as one."""

    def __init__(self, handle: Any) -> None:
        self.handles = handle if isinstance(handle, list) else [handle]

    def _all(self, method: str, *args: Any) -> None:
        import ray  # the optional extra: only this client needs it

        ray.get([getattr(h, method).remote(*args) for h in self.handles])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", WeightTransferInitRequest(init_info=init_info))

    def shutdown_weight_transfer_engine(self) -> None:
        self._all("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: UpdatePayload) -> None:
        self._all("update_weights", WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update")
        if weight_version is not None:
            self._all("update_weight_version", weight_version)
