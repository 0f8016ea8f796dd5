"""vLLM 0.33's `HTTPVLLMWeightSyncClient`: the engine's weight-sync control plane over HTTP (`rlserve serve`).
rlserve's `LLM` is itself a `VLLMWeightSyncClient`, in-process; `rlserve.ray.RayVLLMWeightSyncClient` drives engines
that are Ray actors. A `TrainerWeightTransferEngine` drives any of them."""

from __future__ import annotations

from typing import Any

from rlserve.rl.client import RLServeClient, _Call, _Routes


class HTTPVLLMWeightSyncClient(RLServeClient):
    """`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`,
    `/shutdown_weight_transfer_engine` of a server; errors raise `RLServeError` with the server's message and the
    field it names. IPC handles travel as plain JSON (rlserve never unpickles request data), so nothing is pickled.

    As vLLM's client, every weight-sync call is one `_post(path, json)`: code that wraps or replaces that method
    (a test recording what is sent, a transport of its own) sees every call, with vLLM's bodies."""

    def __init__(self, base_url: str, timeout: float = 300, api_key: str | None = None) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout)

    def _post(self, path: str, json: dict[str, Any] | list[Any] | None = None) -> None:
        self._send(_Call("POST", f"/{path}", json=json))

    def _post_call(self, call: _Call) -> None:
        self._post(call.path.removeprefix("/"), call.json)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post_call(_Routes.init_weight_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        self._post_call(_Routes.start_weight_update)

    def shutdown_weight_transfer_engine(self) -> None:
        self._post_call(_Routes.shutdown_weight_transfer_engine)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._post_call(_Routes.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post_call(_Routes.finish_weight_update(weight_version))
