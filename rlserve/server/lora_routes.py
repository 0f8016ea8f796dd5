"""LoRA adapters over HTTP, vLLM's routes and shapes: `POST /v1/load_lora_adapter {"lora_name", "lora_path",
"load_inplace"}`, `POST /v1/unload_lora_adapter {"lora_name"}`, adapters started with `--lora-modules`, and the
adapter names a request may send as `model` (listed by `/v1/models` with their base model as `parent`).

Where rlserve differs from vLLM, on purpose:
- the load and unload routes work only when runtime updating is on, as in vLLM (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true,
  or `--enable-runtime-lora-updating`; otherwise a 404 naming them), and then behind /v1's API key (vLLM: none), and
  `lora_path` must lie under `--allowed-weight-dirs`, as a checkpoint's `weight_dir` must;
- a reload in place (`load_inplace`) gives the adapter new prefix-cache keys in the engine, so no block computed
  with its previous weights is reused (vLLM keeps them and logs a warning);
- a failed load is a 400 naming the field (vLLM answers 500), and more adapters than `--max-loras` a 409.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import defaultdict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import Field

from rlserve.lora import LoRARequest
from rlserve.server.access import confined_dir
from rlserve.server.errors import APIError
from rlserve.server.generate_protocol import _StrictModel
from rlserve.server.openai_responses import ModelCard

if TYPE_CHECKING:
    from rlserve.engine.frontend.async_llm import AsyncLLM

RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
RUNTIME_LORA_UPDATING_OFF = (
    "runtime LoRA updating is off; start the server with --enable-runtime-lora-updating (or "
    f"{RUNTIME_LORA_UPDATING_ENV}=true, vLLM's switch)"
)


class LoadLoRAAdapterRequest(_StrictModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_StrictModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class LoRAAdapters:
    """The adapters this server serves, by name; ids are handed out from 1 up, a reload keeps its name's id."""

    def __init__(self, engine: AsyncLLM, base_model_names: Sequence[str]) -> None:
        self.engine = engine
        self.base_model_names = list(base_model_names)
        self.loaded: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no name)."""
        if model is None or model in self.base_model_names:
            return None
        adapter = self.loaded.get(model)
        if adapter is None:
            # vLLM's words, and no list: a caller is not told which names and adapters the server has (/v1/models,
            # behind the key, lists them).
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return adapter

    async def load(self, name: str, path: str, load_inplace: bool = False, base_model_name: str | None = None) -> str:
        if not self.engine.config.enable_lora:
            raise APIError(400, "lora_name: LoRA adapters need the server started with --enable-lora", "lora_name")
        if name in self.base_model_names:
            raise APIError(400, f"lora_name: the adapter {name!r} conflicts with a served base model", "lora_name")
        async with self._locks[name]:
            previous = self.loaded.get(name)
            if previous is not None and not load_inplace:
                raise APIError(
                    400,
                    f"lora_name: the adapter {name!r} has already been loaded; set load_inplace to reload it",
                    "lora_name",
                )
            adapter = LoRARequest(
                lora_name=name,
                lora_int_id=previous.lora_int_id if previous is not None else next(self._ids),
                lora_path=path,
                base_model_name=base_model_name,
                load_inplace=previous is not None,
            )
            try:
                await self.engine.add_lora(adapter)
            except ValueError as e:
                status = 409 if "max_loras" in str(e) else 400
                raise APIError(status, f"lora_path: {e}", "lora_path") from e
            # Requests name the adapter without asking for a reload.
            self.loaded[name] = LoRARequest(
                lora_name=name, lora_int_id=adapter.lora_int_id, lora_path=path, base_model_name=base_model_name
            )
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str, lora_int_id: int | None = None) -> str:
        async with self._locks[name]:
            adapter = self.loaded.get(name)
            if adapter is None or (lora_int_id is not None and lora_int_id != adapter.lora_int_id):
                raise APIError(404, f"lora_name: the adapter {name!r} cannot be found", "lora_name")
            del self.loaded[name]  # new requests no longer find it; those that did finish with it
            await self.engine.remove_lora(adapter.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def cards(self, max_model_len: int) -> list[ModelCard]:
        return [
            ModelCard(
                id=adapter.lora_name,
                root=adapter.lora_path,
                parent=adapter.base_model_name or self.base_model_names[0],
                max_model_len=max_model_len,
            )
            for adapter in self.loaded.values()
        ]


def runtime_lora_updating_env() -> bool:
    """vLLM's switch for the load and unload routes, read as vLLM reads it."""
    return os.environ.get(RUNTIME_LORA_UPDATING_ENV, "0").strip().lower() in ("1", "true")


def build_lora_router(
    adapters: LoRAAdapters, allowed_dirs: Collection[str] = (), runtime_updating: bool = False
) -> APIRouter:
    """`runtime_updating`: whether the load and unload routes may change the adapters served; `allowed_dirs`: where
    an adapter may be loaded from."""
    router = APIRouter(tags=["lora"])

    def require_runtime_updating() -> None:
        if not runtime_updating:
            raise APIError(404, f"/v1/load_lora_adapter, /v1/unload_lora_adapter: {RUNTIME_LORA_UPDATING_OFF}")

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> str:
        """Load a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) under `lora_name`, or
        reload it in place (`load_inplace`): requests then name it as their `model`."""
        require_runtime_updating()
        path = confined_dir(req.lora_path, allowed_dirs, "lora_path")
        return await adapters.load(req.lora_name, path, req.load_inplace)

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> str:
        """Stop serving an adapter: new requests no longer find it; those running finish with it."""
        require_runtime_updating()
        return await adapters.unload(req.lora_name, req.lora_int_id)

    return router
