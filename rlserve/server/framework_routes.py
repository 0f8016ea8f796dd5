"""The routes RL frameworks' own inference servers add around vLLM, which their trainers and orchestrators call, on
rlserve's weight-update machinery (the engine's start / update / finish, its rollback and abandon on failure).

- prime-rl (559b4477, `prime_rl/inference/vllm/server.py`): `POST /init_broadcaster` joins its trainer's broadcast
  group (backend `prime_rl`, `rlserve/weight_transfer/framework_backends.py`); after it, `POST /update_weights
  {"weight_dir"}` is its NCCL mode: the directory holds only the orchestrator's `NCCL_READY` marker (the trainer
  sends once it exists) and the weights come over the group. `POST /load_lora_adapter` always reloads in place (its
  adapter name is fixed, the path changes per step); `GET /liveness` answers once the engine core answers.
- PipelineRL (58d39345, `pipelinerl/vllm1.py`): its flags `--weight-update-group-init-method`,
  `--weight-update-group-world-size`, `--actor-llm-idx` join its trainer's group as the server starts (backend
  `pipelinerl`); `POST /receive_weight_update {version, parameters_info}` pauses (keep), receives the broadcast
  parameters, and resumes.

- SkyRL (a9564572, `inference_servers/vllm_server_actor.py`): `POST /skyrl/v1/generate` (token ids in; token ids,
  finish reason, `{"logprob"}` per token and its packed `routed_experts` out), `POST /skyrl/v1/load_lora_adapter`
  (load or reload in place, with the adapter's id), `POST /fetch_weights` (its worker extension's `fetch_weights`,
  through collective_rpc: served only when --worker-extension-cls defines it).

The control routes need the RL API key, as the other control routes (`/liveness`, a probe, does not); SkyRL's
generate and LoRA routes the /v1 key, as their vLLM counterparts. Errors are the RL routes': a bad field is a 400
naming it, a call out of order a 409.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.server.access import RendezvousHosts, confined_dir
from rlserve.server.generate_protocol import GenerateRequest, parse_body
from rlserve.server.lora_routes import RUNTIME_LORA_UPDATING_OFF, LoadLoRAAdapterRequest, LoRAAdapters
from rlserve.server.metrics import ServerMetrics
from rlserve.server.protocol import APIError, OpenAIBaseModel
from rlserve.server.rl_routes import _engine_call
from rlserve.weight_transfer.framework_backends import FP8_NOT_YET, dtype_name_of, pipelinerl_update_info

if TYPE_CHECKING:
    from rlserve.server.app import OpenAIServing

logger = logging.getLogger(__name__)

NCCL_READY_MARKER = "NCCL_READY"  # prime-rl's orchestrator writes it into weight_dir; its trainer then broadcasts
FRAMEWORK_PUBLIC_PATHS = frozenset({"/liveness"})  # a probe, as prime-rl serves it
LIVENESS_TIMEOUT_S = 30.0  # prime-rl's default liveness_timeout_seconds
_INIT_FIELDS = ("host", "port", "rank_offset", "inference_world_size", "timeout", "quantize_in_weight_transfer")


class InitBroadcasterRequest(OpenAIBaseModel):
    """prime-rl's `/init_broadcaster` body (its `init_nccl_broadcast` client sends all but session_id)."""

    host: StrictStr = Field(min_length=1)
    port: StrictInt = Field(ge=1, le=65535)
    rank_offset: StrictInt = Field(ge=0)
    inference_world_size: StrictInt = Field(ge=1)
    timeout: StrictInt | StrictFloat = Field(gt=0)  # seconds the rendezvous and each receive wait
    quantize_in_weight_transfer: StrictBool = False
    session_id: StrictStr = "default"


class ParameterInfo(OpenAIBaseModel):
    name: StrictStr
    shape: list[StrictInt]
    dtype: StrictStr  # str(torch.dtype): "torch.bfloat16"


class ReceiveWeightUpdateRequest(OpenAIBaseModel):
    """PipelineRL's `WeightUpdateRequest`, as its trainer posts it (`model_dump()`)."""

    kind: Literal["weight_update_request"] = "weight_update_request"
    version: StrictInt
    parameters_info: list[ParameterInfo]
    timestamp: StrictFloat | StrictInt | None = None


class FrameworkState:
    """What the framework routes remember between calls: how prime-rl's weight_dir updates arrive once its broadcaster
    is up, PipelineRL's group join, and the lock that orders PipelineRL's updates."""

    def __init__(self) -> None:
        # prime-rl's NCCL-mode /update_weights {"weight_dir"}, once /init_broadcaster has joined its trainer's group
        self.weight_dir_by_broadcast: Callable[[str], Awaitable[dict[str, str]]] | None = None
        self.pipelinerl_join: asyncio.Task | None = None
        self.update_lock = asyncio.Lock()


async def _broadcast_update(engine: AsyncLLM, metrics: ServerMetrics, update_info: dict, version: str | None) -> None:
    """One weight update over the engine's machinery; an update that fails is abandoned (rolled back with
    --weight-update-snapshot), so the engine is never left with an open one."""
    await _engine_call(engine.start_weight_update(True))
    metrics.weight_update_started()
    try:
        await _engine_call(engine.update_weights({"update_info": update_info}), "update_info", data_param="update_info")
        await _engine_call(engine.finish_weight_update(version), "version")
    except BaseException:
        with contextlib.suppress(RuntimeError):  # the engine already abandoned it (trainer lost)
            await engine.abandon_weight_update()
        raise
    finally:
        metrics.weight_update_finished()


async def update_weights_from_broadcast(
    engine: AsyncLLM, metrics: ServerMetrics, state: FrameworkState, weight_dir: str
) -> dict[str, str]:
    """prime-rl's NCCL-mode `/update_weights {"weight_dir"}`: nothing is read from the directory, which must hold
    the orchestrator's NCCL_READY marker (without it the trainer never sends, and the receive would wait out its
    timeout)."""
    if not os.path.isfile(os.path.join(weight_dir, NCCL_READY_MARKER)):
        message = (
            f"weight_dir: no {NCCL_READY_MARKER} marker in {weight_dir!r}; prime-rl's trainer broadcasts only once "
            "the orchestrator has written it"
        )
        raise APIError(409, message, "weight_dir")
    async with state.update_lock:
        await _broadcast_update(engine, metrics, {}, None)
    return {"status": "ok"}


def build_framework_router(
    engine: AsyncLLM,
    adapters: LoRAAdapters,
    metrics: ServerMetrics,
    state: FrameworkState,
    allowed_dirs: Collection[str],
    rendezvous_hosts: RendezvousHosts,
) -> APIRouter:
    """prime-rl's and PipelineRL's routes: behind the RL key (the server's access guard), but /liveness.
    `rendezvous_hosts`: where /init_broadcaster may connect, as /init_weight_transfer_engine."""
    router = APIRouter(tags=["rl", "frameworks"])

    @router.post("/init_broadcaster")
    async def init_broadcaster(body: InitBroadcasterRequest) -> dict[str, str]:
        """prime-rl: join its trainer's weight broadcast (blocks until the trainer and every server have joined).
        Only at a host the operator allows; a rendezvous that fails is one answer whatever the reason, as
        /init_weight_transfer_engine's (no port scanner)."""
        if body.quantize_in_weight_transfer:
            raise APIError(400, FP8_NOT_YET, "quantize_in_weight_transfer")
        await rendezvous_hosts.check_host(body.host, "host")
        init = engine.init_weight_transfer_engine({"init_info": body.model_dump()}, backend="prime_rl")
        try:
            await _engine_call(init, "init_info", fields=_INIT_FIELDS, data_param="init_info")
        except (ConnectionError, APIError) as e:
            configured = engine.config.weight_transfer_config
            other_backend = configured is not None and configured.backend != "prime_rl"
            if isinstance(e, APIError) and (e.code != 409 or other_backend):
                raise  # a bad field, or an engine started for another transfer (the core's message says which flag)
            logger.warning("init_broadcaster failed: %s", e)
            message = (
                f"host: the broadcast rendezvous did not complete within {body.timeout:g} s (no trainer's group "
                "joined at host:port); the server's log has the details"
            )
            raise APIError(409, message, "host") from None
        state.weight_dir_by_broadcast = lambda weight_dir: update_weights_from_broadcast(
            engine, metrics, state, weight_dir
        )
        return {"status": "ok"}

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> dict[str, str]:
        """prime-rl: load or reload (always in place) the adapter `lora_name` from `lora_path`."""
        path = confined_dir(body.lora_path, allowed_dirs, "lora_path")
        await adapters.load(body.lora_name, path, load_inplace=True)
        return {"status": "ok"}

    @router.get("/liveness")
    async def liveness() -> JSONResponse:
        """prime-rl: 200 once the engine core answers a no-op call, 503 {"status": "engine_unresponsive"} if it
        does not within 30 s."""
        try:
            await asyncio.wait_for(engine.is_paused(), LIVENESS_TIMEOUT_S)
        except TimeoutError:
            return JSONResponse({"status": "engine_unresponsive"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.post("/receive_weight_update")
    async def receive_weight_update(body: ReceiveWeightUpdateRequest) -> dict[str, str]:
        """PipelineRL: pause (keep), receive the parameters its trainer broadcasts in `parameters_info` order, set
        the weight version to `version`, resume."""
        await _joined_pipelinerl_group(state)
        update_info = _pipelinerl_update_info(body)
        async with state.update_lock, _paused(engine, metrics):
            await _broadcast_update(engine, metrics, update_info, str(body.version))
        return {"status": "ok"}

    add_fetch_weights_route(router, engine)
    return router


def _pipelinerl_update_info(body: ReceiveWeightUpdateRequest) -> dict[str, Any]:
    for index, info in enumerate(body.parameters_info):
        try:
            dtype_name_of(info.dtype)
        except ValueError as e:
            raise APIError(400, f"parameters_info[{index}].dtype: {e}", "parameters_info") from e
    return pipelinerl_update_info([info.model_dump() for info in body.parameters_info])


@contextlib.asynccontextmanager
async def _paused(engine: AsyncLLM, metrics: ServerMetrics) -> AsyncIterator[None]:
    """PipelineRL's pause around an update: requests in flight keep their KV cache and go on after it."""
    await _engine_call(engine.pause_generation(mode="keep", clear_cache=False))
    metrics.generation_paused()
    try:
        yield
    finally:
        await engine.resume_generation()
        metrics.generation_resumed()


async def _joined_pipelinerl_group(state: FrameworkState) -> None:
    join = state.pipelinerl_join
    if join is None:
        message = (
            "parameters_info: no PipelineRL weight-update group: start rlserve serve with "
            "--weight-update-group-init-method tcp://HOST:PORT and --weight-update-group-world-size N"
        )
        raise APIError(409, message, "parameters_info")
    try:
        await asyncio.shield(join)
    except APIError as e:
        raise APIError(409, f"the PipelineRL weight-update group could not be joined: {e.message}") from e


# --- PipelineRL's flags ------------------------------------------------------------------------------------------


def add_pipelinerl_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("PipelineRL", "PipelineRL's weight-update group (pipelinerl/vllm1.py)")
    group.add_argument(
        "--weight-update-group-init-method",
        default=None,
        help="tcp://HOST:PORT of the PipelineRL trainer's group, joined as the server starts",
    )
    group.add_argument("--weight-update-group-world-size", type=int, default=None, help="the group's size")
    group.add_argument("--actor-llm-idx", type=int, default=0, help="this server's index among PipelineRL's actors")
    group.add_argument(
        "--disable-weight-updates", action="store_true", help="PipelineRL's: join no weight-update group"
    )


def check_pipelinerl_arguments(args: argparse.Namespace) -> None:
    if (args.weight_update_group_init_method is None) != (args.weight_update_group_world_size is None):
        raise ValueError("--weight-update-group-init-method and --weight-update-group-world-size go together")
    if args.weight_update_group_init_method is not None and not args.disable_weight_updates and not args.enable_rl_api:
        raise ValueError(
            "--weight-update-group-init-method: PipelineRL's updates come through /receive_weight_update, an RL "
            "route: add --enable-rl-api (or --disable-weight-updates)"
        )


def start_pipelinerl_join(engine: AsyncLLM, args: argparse.Namespace, state: FrameworkState) -> None:
    """Join PipelineRL's group in the background as the server starts (PipelineRL's server joins before serving;
    here /health answers meanwhile, and /receive_weight_update waits for the join)."""
    if args.disable_weight_updates or args.weight_update_group_init_method is None:
        return
    config = engine.config
    init_info = {
        "init_method": args.weight_update_group_init_method,
        "world_size": args.weight_update_group_world_size,
        "actor_llm_idx": args.actor_llm_idx,
        "actor_ngpus": config.tensor_parallel_size * config.data_parallel_size,
    }

    async def join() -> None:
        call = engine.init_weight_transfer_engine({"init_info": init_info}, backend="pipelinerl")
        try:
            await _engine_call(call, "init_info", data_param="init_info")
        except APIError as e:
            logger.error("PipelineRL weight-update group: %s", e.message)
            raise
        logger.info("joined PipelineRL's weight-update group at %s", args.weight_update_group_init_method)

    task = state.pipelinerl_join = asyncio.create_task(join())
    # Logged in join(); /receive_weight_update reports it. Retrieved here so asyncio does not report it again.
    task.add_done_callback(lambda done: done.cancelled() or done.exception())


# --- SkyRL -------------------------------------------------------------------------------------------------------

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
        response = await serving.generate_tokens(request, raw)
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
        result = await _engine_call(engine.collective_rpc("fetch_weights", None, (), kwargs), "target_version")
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
