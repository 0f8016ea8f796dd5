"""The routes prime-rl's and PipelineRL's own inference servers add around vLLM, which their trainers and
orchestrators call, on rlserve's weight-update machinery (the engine's start / update / finish, its rollback and
abandon on failure). SkyRL's are in skyrl_routes.py.

- prime-rl (559b4477, `prime_rl/inference/vllm/server.py`): `POST /init_broadcaster` joins its trainer's broadcast
  group (backend `prime_rl`, `rlserve/weight_transfer/framework_backends.py`); after it, `POST /update_weights
  {"weight_dir"}` is its NCCL mode: the directory holds only the orchestrator's `NCCL_READY` marker (the trainer
  sends once it exists) and the weights come over the group. `POST /load_lora_adapter` always reloads in place (its
  adapter name is fixed, the path changes per step); `GET /liveness` answers once the engine core answers.
- PipelineRL (58d39345, `pipelinerl/vllm1.py`): its flags `--weight-update-group-init-method`,
  `--weight-update-group-world-size`, `--actor-llm-idx` join its trainer's group as the server starts (backend
  `pipelinerl`, pipelinerl_group.py); `POST /receive_weight_update {version, parameters_info}` pauses (keep),
  receives the broadcast parameters, and resumes.

These control routes need the RL API key, as the other control routes (`/liveness`, a probe, does not). Errors are
the RL routes': a bad field is a 400 naming it, a call out of order a 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.server.access import RendezvousHosts, confined_dir
from rlserve.server.engine_calls import engine_call
from rlserve.server.errors import APIError
from rlserve.server.lora_routes import LoadLoRAAdapterRequest, LoRAAdapters
from rlserve.server.metrics import ServerMetrics
from rlserve.server.request_base import OpenAIBaseModel
from rlserve.server.skyrl_routes import add_fetch_weights_route
from rlserve.weight_transfer.framework_backends import dtype_name_of, pipelinerl_update_info

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
    await engine_call(engine.start_weight_update(True))
    metrics.weight_update_started()
    try:
        await engine_call(engine.update_weights({"update_info": update_info}), "update_info", data_param="update_info")
        await engine_call(engine.finish_weight_update(version), "version")
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
        await rendezvous_hosts.check_host(body.host, "host")
        init = engine.init_weight_transfer_engine({"init_info": body.model_dump()}, backend="prime_rl")
        try:
            await engine_call(init, "init_info", fields=_INIT_FIELDS, data_param="init_info")
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
    await engine_call(engine.pause_generation(mode="keep", clear_cache=False))
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
