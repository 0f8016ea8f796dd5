"""SkyRL's routes (a9564572, `inference_servers/vllm_server_actor.py`): `POST /skyrl/v1/generate` (token ids in;
token ids, finish reason, `{"logprob"}` per token and its packed `routed_experts` out), `POST
/skyrl/v1/load_lora_adapter` (load or reload in place, with the adapter's id), and `POST /fetch_weights` (its worker
extension's `fetch_weights`, through collective_rpc: served only when --worker-extension-cls defines it).

The generate and LoRA routes need the /v1 key, as their vLLM counterparts; /fetch_weights, a control route, the RL
key (it is served with prime-rl's and PipelineRL's routes, framework_routes.py).
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Collection
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictInt, StrictStr

from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.server.access import confined_dir
from rlserve.server.engine_calls import engine_call
from rlserve.server.errors import APIError
from rlserve.server.generate_protocol import GenerateRequest, parse_body
from rlserve.server.lora_routes import RUNTIME_LORA_UPDATING_OFF
from rlserve.server.request_base import OpenAIBaseModel
from rlserve.server.serving import OpenAIServing
from rlserve.server.serving_generate import generate_tokens

CLAMPED_LOGPROB = -9999.0  # SkyRL's floor for a missing or non-finite sampled logprob (and vLLM's)


class SkyRLGenerateRequest(OpenAIBaseModel):
    """SkyRL's `/skyrl/v1/generate` body, as its RemoteInferenceClient sends it."""

    token_ids: list[StrictInt] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: StrictStr | None = None
    cache_salt: StrictStr | None = None


class SkyRLLoadLoRARequest(OpenAIBaseModel):
    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1)


class FetchWeightsRequest(OpenAIBaseModel):
    target_version: StrictInt
    sync_dir: StrictStr | None = None
    uri: StrictStr | None = None


def build_skyrl_router(serving: OpenAIServing, allowed_dirs: Collection[str], runtime_lora_updating: bool) -> APIRouter:
    """SkyRL's data-plane routes, behind the /v1 key (the server's access guard); its adapter route as vLLM's
    /v1/load_lora_adapter: only with runtime LoRA updating on, from an allowed directory."""
    router = APIRouter(tags=["frameworks"])
    engine = serving.engine

    @router.post("/skyrl/v1/generate")
    async def skyrl_generate(body: SkyRLGenerateRequest, raw: Request) -> Response:
        """SkyRL's generate: /inference/v1/generate's output as SkyRL reads it, routed experts packed
        ({"data": base64, "shape": [tokens, layers, top_k], "dtype"}); refused with --enable-lora, as SkyRL does."""
        if engine.config.enable_lora:
            raise APIError(400, "/skyrl/v1/generate does not support LoRA (SkyRL's own rule).", "model")
        # GenerateRequest's own checks (cache_salt's length, ...), a 400 naming the field like /inference/v1/generate's.
        request = parse_body(body.model_dump(exclude_none=True), GenerateRequest)
        response = await generate_tokens(serving, request, raw)
        if response.status_code != 200:  # the client went away
            return response
        choice = json.loads(response.body)["choices"][0]
        return JSONResponse({"choices": [_skyrl_choice(choice)]})

    @router.post("/skyrl/v1/load_lora_adapter")
    async def skyrl_load_lora_adapter(body: SkyRLLoadLoRARequest) -> dict[str, Any]:
        """SkyRL's: load `lora_name`, or reload it in place from a new `lora_path`."""
        if not runtime_lora_updating:
            raise APIError(404, RUNTIME_LORA_UPDATING_OFF, "lora_name")
        path = confined_dir(body.lora_path, allowed_dirs, "lora_path")
        await serving.adapters.load(body.lora_name, path, load_inplace=True)
        lora_int_id = serving.adapters.loaded[body.lora_name].lora_int_id
        return {"status": "ok", "lora_name": body.lora_name, "lora_int_id": lora_int_id}

    return router


def add_fetch_weights_route(router: APIRouter, engine: AsyncLLM) -> None:
    """SkyRL's /fetch_weights, a control route: added to the router of the other frameworks' control routes."""

    @router.post("/fetch_weights")
    async def fetch_weights(body: FetchWeightsRequest) -> dict[str, Any]:
        """SkyRL's checkpoint-delta fetch: its worker extension's `fetch_weights(target_version, sync_dir, uri)` on
        every worker, through collective_rpc."""
        if "fetch_weights" not in engine.worker_extension_methods():
            message = (
                "target_version: /fetch_weights calls the worker extension's fetch_weights (SkyRL's "
                "NewInferenceWorkerWrap); this server's --worker-extension-cls has none"
            )
            raise APIError(400, message, "target_version")
        kwargs = body.model_dump(exclude_none=True)
        result = await engine_call(engine.collective_rpc("fetch_weights", None, (), kwargs), "target_version")
        return {"status": "ok", "result": result}


def _skyrl_choice(choice: dict[str, Any]) -> dict[str, Any]:
    content = (choice.get("logprobs") or {}).get("content")
    logprobs = None
    if content is not None:
        logprobs = {"content": [{"logprob": _clamped(entry.get("logprob"))} for entry in content]}
    routed = choice.get("routed_experts")
    return {
        "token_ids": choice["token_ids"],
        "finish_reason": choice["finish_reason"],
        "logprobs": logprobs,
        "routed_experts": None if routed is None else _pack_routed_experts(routed),
    }


def _clamped(logprob: float | None) -> float:
    return CLAMPED_LOGPROB if logprob is None or not math.isfinite(logprob) else logprob


def _pack_routed_experts(npy_base64: str) -> dict[str, Any]:
    """rlserve's routed experts (base64 of .npy) in SkyRL's packing: the raw bytes in the smallest of its dtypes."""
    experts = np.load(io.BytesIO(base64.b64decode(npy_base64)), allow_pickle=False)
    top = int(experts.max(initial=0))
    dtype = np.uint8 if top < 2**8 else np.int16 if top < 2**15 else np.int32
    compact = np.ascontiguousarray(experts, dtype=dtype)
    return {
        "data": base64.b64encode(compact.tobytes()).decode("ascii"),
        "shape": list(compact.shape),
        "dtype": compact.dtype.name,
    }
