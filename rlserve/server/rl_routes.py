"""vLLM's RL control routes (paths and bodies of its dev-mode RLHF router), and its profiling routes, behind the
server's RL key.

Unlike vLLM, which serves them unauthenticated in dev mode, every route here needs `--rl-api-key` (access.py checks
it before the body is read): these routes pause generation and overwrite the model. Errors: a ValueError (bad input)
is a 400 naming the field, a RuntimeError (a call out of lifecycle order, e.g. update before start) a 409; neither
takes the server down.

Bodies are pydantic models (in the OpenAPI document, so clients and fuzzers see them): malformed JSON, a body that
is not UTF-8, a wrong type or an unknown field is a 400 naming the field (the server's validation handler).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BeforeValidator, Field, StrictBool, StrictInt, StrictStr

from rlserve.engine.frontend.async_llm import AsyncLLM, EngineDeadError, RequestRefusedError
from rlserve.engine.wire.call_policy import check_rpc_method
from rlserve.engine.wire.messages import SLEEP_MODES
from rlserve.engine.wire.profiling import NOT_ENABLED, profiling_enabled
from rlserve.server.access import RendezvousHosts, confined_dir
from rlserve.server.engine_calls import engine_call
from rlserve.server.errors import APIError
from rlserve.server.framework_routes import FrameworkState
from rlserve.server.metrics import ServerMetrics
from rlserve.server.request_base import OpenAIBaseModel
from rlserve.weight_transfer.checksum import compare_checksums

logger = logging.getLogger(__name__)

# The shortest /collective_rpc timeout accepted. The engine core runs a call between steps and cannot interrupt it,
# so a call that times out still runs to its end; and it starts only after the step in progress (up to hundreds of
# milliseconds under load). A shorter timeout would measure that queue rather than the method, and leave most calls
# running with nobody waiting for them.
MIN_RPC_TIMEOUT_S = 1.0

# A weight version: a string, or an integer (step counters), never a boolean or a float that str() would mangle.
Version = StrictStr | StrictInt


class InitWeightTransferRequest(OpenAIBaseModel):
    init_info: dict[str, Any]  # the backend's rendezvous fields, checked by the backend


class StartWeightUpdateRequest(OpenAIBaseModel):
    is_checkpoint_format: StrictBool = True


class UpdateWeightsRequest(OpenAIBaseModel):
    """vLLM's `update_info` (or a list of them), or prime-rl's `weight_dir`: exactly one."""

    update_info: dict[str, Any] | Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None
    weight_dir: StrictStr | None = None


class FinishWeightUpdateRequest(OpenAIBaseModel):
    weight_version: Version | None = None


class UpdateWeightVersionRequest(OpenAIBaseModel):
    new_version: Version


class CollectiveRPCRequest(OpenAIBaseModel):
    method: StrictStr
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = Field(default=None, ge=MIN_RPC_TIMEOUT_S)


class AbortRequestsRequest(OpenAIBaseModel):
    request_ids: list[StrictStr] | None = None  # None: every request in flight


class ChecksumsBody(OpenAIBaseModel):
    checksums: dict[str, str]


class StartProfileRequest(OpenAIBaseModel):
    """vLLM 0.33's optional overrides of one profiling session (see LLM.start_profile)."""

    profile_prefix: StrictStr | None = None
    delay_iterations: StrictInt | None = Field(default=None, ge=0)
    max_iterations: StrictInt | None = Field(default=None, ge=0)
    profiler_kwargs: dict[str, StrictBool] | None = None


def _checksum_response_or_map(value: Any) -> Any:
    """A baseline with a `checksums` field is a checksum response: anything but an object there is a 400 naming
    `baseline.checksums`, not a map of one tensor named "checksums" that matches nothing."""
    if isinstance(value, dict) and "checksums" in value and not isinstance(value["checksums"], dict):
        got = type(value["checksums"]).__name__
        message = f"baseline.checksums: must be an object of tensor name -> checksum, got a {got}"
        raise APIError(400, message, "baseline.checksums")
    return value


class WeightCheckerRequest(OpenAIBaseModel):
    action: Literal["checksum", "compare", "reset"]
    # compare's expected checksums (required): a map of them, or a checksum response
    baseline: Annotated[dict[str, StrictStr] | ChecksumsBody | None, BeforeValidator(_checksum_response_or_map)] = None


def _check_reload_args(body: CollectiveRPCRequest, allowed_weight_dirs: Collection[str]) -> None:
    """reload_weights over HTTP: by keyword only, and a `weights_path` only under an allowed directory (as
    /update_weights {"weight_dir"}): the caller must not make the server read any directory it can name."""
    keywords = ["weights_path", "is_checkpoint_format"]
    if body.args:
        raise APIError(400, f"args: reload_weights takes keywords over HTTP ({keywords})", "args")
    unknown = sorted(set(body.kwargs) - set(keywords))
    if unknown:
        raise APIError(400, f"kwargs: reload_weights over HTTP takes {keywords}, not {unknown}", "kwargs")
    path = body.kwargs.get("weights_path")
    if path is not None:
        if not isinstance(path, str):
            raise APIError(400, f"kwargs: weights_path must be a string, got {path!r}", "kwargs")
        body.kwargs["weights_path"] = confined_dir(path, allowed_weight_dirs, "weight_dir")


def build_rl_routers(
    engine: AsyncLLM,
    active_requests: Mapping[str, list[str]],
    metrics: ServerMetrics,
    allowed_weight_dirs: Collection[str],
    rendezvous_hosts: RendezvousHosts,
    frameworks: FrameworkState | None = None,
) -> list[APIRouter]:
    """The RL routers, one per concern, each timing its calls into `metrics`. `active_requests`: the server's
    in-flight requests (response id -> engine request ids), for /abort_requests. `allowed_weight_dirs`: where
    `/update_weights {"weight_dir"}` may load checkpoints from; `rendezvous_hosts`: where
    /init_weight_transfer_engine may connect. `frameworks`: the framework routes' state (after prime-rl's
    /init_broadcaster, a weight_dir update comes over its broadcast)."""
    timed = Depends(_rl_call_timer(metrics))
    return [
        _pause_router(engine, metrics, timed),
        _sleep_router(engine, timed),
        _weight_update_router(engine, metrics, allowed_weight_dirs, rendezvous_hosts, frameworks, timed),
        _workers_router(engine, allowed_weight_dirs, timed),
        _requests_router(engine, active_requests, timed),
        _weight_checker_router(engine, timed),
        _recovery_router(engine, timed),
        _profile_router(engine, timed),
    ]


def _rl_call_timer(metrics: ServerMetrics) -> Callable[[Request], AsyncIterator[None]]:
    """A dependency of every RL route: how long the call took, by route."""

    async def timed(request: Request) -> AsyncIterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            metrics.observe_rl_call(request.scope["route"].path, time.perf_counter() - start)

    return timed


def _rl_router(timed: Any) -> APIRouter:
    return APIRouter(dependencies=[timed], tags=["rl"])


def _pause_router(engine: AsyncLLM, metrics: ServerMetrics, timed: Any) -> APIRouter:
    router = _rl_router(timed)

    @router.post("/pause")
    async def pause(
        mode: str = "abort", clear_cache: bool = True, wait_for_inflight_requests: bool | None = None
    ) -> dict[str, str]:
        pause_call = engine.pause_generation(
            mode=mode, clear_cache=clear_cache, wait_for_inflight_requests=wait_for_inflight_requests
        )
        await engine_call(pause_call, "query.mode")
        metrics.generation_paused()
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> dict[str, str]:
        await engine_call(engine.resume_generation())
        metrics.generation_resumed()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await engine.is_paused()}

    return router


def _sleep_router(engine: AsyncLLM, timed: Any) -> APIRouter:
    router = _rl_router(timed)

    @router.post("/sleep")
    async def sleep(level: int = 1, mode: str = "abort") -> dict[str, Any]:
        # vLLM's default mode: the requests in flight end (finish_reason "abort") before the engine sleeps.
        if mode not in SLEEP_MODES:
            raise APIError(400, f"query.mode: must be one of {list(SLEEP_MODES)}, got {mode!r}", "query.mode")
        await engine_call(engine.sleep(level, mode), "query.level")
        return {"status": "sleeping", "level": level}

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict[str, Any]:
        awake = await engine_call(engine.wake_up(tags), "query.tags")
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await engine.is_sleeping()}

    return router


def _weight_update_router(
    engine: AsyncLLM,
    metrics: ServerMetrics,
    allowed_weight_dirs: Collection[str],
    rendezvous_hosts: RendezvousHosts,
    frameworks: FrameworkState | None,
    timed: Any,
) -> APIRouter:
    """vLLM's weight-update lifecycle: the transfer engine's rendezvous, start, updates, finish, and the version."""
    router = _rl_router(timed)

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitWeightTransferRequest) -> dict[str, str]:
        """Blocks until the trainer joins the group (the trainer calls trainer_init concurrently). A rendezvous that
        fails is one answer whatever the reason, its details in the log: what a port answered (its banner), whether
        it is open, and the core's pid are nobody's business but the operator's."""
        await rendezvous_hosts.check(body.init_info)
        await _init_weight_transfer(engine, body.init_info)
        return {"message": "Weight transfer initialized"}

    @router.post("/start_weight_update")
    async def start_weight_update(body: StartWeightUpdateRequest | None = None) -> dict[str, str]:
        is_checkpoint_format = True if body is None else body.is_checkpoint_format
        await engine_call(engine.start_weight_update(is_checkpoint_format), "is_checkpoint_format")
        metrics.weight_update_started()
        return {"message": "Weight update started"}

    @router.post("/start_draft_weight_update")
    async def start_draft_weight_update() -> dict[str, str]:
        await engine_call(engine.start_draft_weight_update())
        return {"message": "Draft weight update started"}

    @router.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest) -> dict[str, Any]:
        """vLLM's `{"update_info": {...}}` or a list of them, applied in order (an update refused part-way leaves
        the earlier ones applied, as in vLLM); or prime-rl's `{"weight_dir": PATH}`, a checkpoint directory the
        trainer wrote, loaded in place (checked whole first, so a refused one changes nothing)."""
        if body.weight_dir is not None:
            return await _update_weights_from_dir(engine, body, allowed_weight_dirs, frameworks)
        if body.update_info is None:
            raise APIError(400, "update_info: required (or weight_dir)", "update_info")
        updates = body.update_info if isinstance(body.update_info, list) else [body.update_info]
        for update in updates:
            await engine_call(engine.update_weights({"update_info": update}), "update_info", data_param="update_info")
        return {"message": "Weights updated"}

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> dict[str, str]:
        await engine_call(engine.shutdown_weight_transfer_engine())
        return {"message": "Weight transfer shut down"}

    @router.post("/finish_weight_update")
    async def finish_weight_update(body: FinishWeightUpdateRequest | None = None) -> dict[str, str]:
        version = None if body is None else body.weight_version
        await engine_call(engine.finish_weight_update(None if version is None else str(version)), "weight_version")
        metrics.weight_update_finished()
        return {"message": "Weight update finished"}

    @router.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionRequest) -> dict[str, Any]:
        version = str(body.new_version)
        await engine_call(engine.update_weight_version(version), "new_version")
        return {"success": True, "new_version": version}

    @router.get("/weight_version")
    @router.get("/weight_info")
    async def weight_version() -> dict[str, str]:
        return {"weight_version": await engine.get_weight_version()}

    return router


async def _init_weight_transfer(engine: AsyncLLM, init_info: dict[str, Any]) -> None:
    """Join the trainer's group; a rendezvous that does not complete is one 409, its reason logged."""
    try:
        await engine_call(
            engine.init_weight_transfer_engine({"init_info": init_info}), "init_info", data_param="init_info"
        )
    except APIError as e:
        if e.code != 409 or engine.config.weight_transfer_config is None:  # no backend: the core says which flag
            raise
        logger.warning("init_weight_transfer_engine failed: %s", e.message)
        timeout_s = engine.config.weight_transfer_timeout_s
        message = (
            f"init_info: the weight-transfer rendezvous did not complete within {timeout_s:g} s (no trainer's "
            "group joined at master_address:master_port); the server's log has the details"
        )
        raise APIError(409, message, "init_info") from None


async def _update_weights_from_dir(
    engine: AsyncLLM,
    body: UpdateWeightsRequest,
    allowed_weight_dirs: Collection[str],
    frameworks: FrameworkState | None,
) -> dict[str, Any]:
    """prime-rl's `/update_weights {"weight_dir"}`: over its broadcast once /init_broadcaster has joined it, else
    the checkpoint loaded from the directory, which must be under an allowed one."""
    if body.update_info is not None:
        raise APIError(400, "weight_dir: send weight_dir or update_info, not both", "weight_dir")
    if frameworks is not None and frameworks.weight_dir_by_broadcast is not None:
        return await frameworks.weight_dir_by_broadcast(body.weight_dir)
    weight_dir = confined_dir(body.weight_dir, allowed_weight_dirs, "weight_dir")
    await engine_call(engine.load_weights_from_dir(weight_dir), "weight_dir")
    return {"message": "Weights updated"}


def _workers_router(engine: AsyncLLM, allowed_weight_dirs: Collection[str], timed: Any) -> APIRouter:
    """Calls of the --worker-extension-cls methods on every worker, and the workers' count."""
    router = _rl_router(timed)
    # /collective_rpc calls whose caller timed out (method -> the call): the core still runs them.
    timed_out_rpcs: dict[str, asyncio.Future] = {}

    @router.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRPCRequest) -> dict[str, list[Any]]:
        """`timeout`: at least MIN_RPC_TIMEOUT_S. When it expires the answer is a 504, and since the core cannot
        interrupt a call, the call still runs: until it returns, further calls are refused (409) rather than queued
        behind it unseen, and its end is logged."""
        # Only the methods of the server's --worker-extension-cls, never the worker's own attributes: the caller
        # names code the operator installed, it cannot reach into the engine.
        method = body.method
        try:
            check_rpc_method(method, engine.worker_extension_methods())
        except ValueError as e:
            raise APIError(400, str(e), "method") from e
        if method == "reload_weights":
            _check_reload_args(body, allowed_weight_dirs)
        for earlier, running in list(timed_out_rpcs.items()):
            if running.done():
                del timed_out_rpcs[earlier]
            else:
                message = f"method: an earlier call of {earlier!r} timed out and still runs in the engine core"
                raise APIError(409, message, "method")
        call = asyncio.ensure_future(engine.collective_rpc(method, None, tuple(body.args), body.kwargs))
        try:
            # shield: a timeout must not cancel the call's future, whose result the core still sends.
            results = await engine_call(
                asyncio.wait_for(asyncio.shield(call), body.timeout), "method", data_param="args"
            )
        except TimeoutError:
            timed_out_rpcs[method] = call
            call.add_done_callback(_log_late_rpc(method, time.monotonic()))
            message = (
                f"timeout: {method!r} did not return within {body.timeout:g} s; the engine core cannot interrupt it, "
                "so it runs on (other calls are refused until it returns) and its result is dropped"
            )
            raise APIError(504, message, "timeout") from None
        except (APIError, EngineDeadError, RequestRefusedError):
            raise
        except Exception as e:  # the extension's own error (a KeyError, a TypeError of its arguments): the call's
            raise APIError(400, f"method: {method!r} raised {type(e).__name__}: {e}", "method") from e
        return {"results": [_jsonable(r) for r in results]}

    @router.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> dict[str, int]:
        return {"world_size": engine.get_world_size(include_dp)}

    return router


def _requests_router(engine: AsyncLLM, active_requests: Mapping[str, list[str]], timed: Any) -> APIRouter:
    """The requests in flight and the prefix cache they fill."""
    router = _rl_router(timed)

    @router.post("/abort_requests")
    async def abort_requests(body: AbortRequestsRequest | None = None) -> dict[str, Any]:
        wanted = None if body is None else body.request_ids
        ids = list(active_requests) if wanted is None else [r for r in wanted if r in active_requests]
        engine_ids = [e for rid in ids for e in active_requests.get(rid, [])]
        if engine_ids:
            await engine_call(engine.abort(engine_ids))
        return {"status": "aborted", "aborted": len(ids)}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> dict[str, bool]:
        """vLLM's: `success` is always true here, since a reset never waits on blocks in use (they stay with
        their requests and are not shared again). `reset_external`: rlserve has no external (connector) cache,
        so there is nothing more to reset."""
        await engine_call(engine.reset_prefix_cache(reset_running_requests))
        return {"success": True}

    return router


def _weight_checker_router(engine: AsyncLLM, timed: Any) -> APIRouter:
    router = _rl_router(timed)

    @router.post("/weight_checker")
    async def weight_checker(body: WeightCheckerRequest) -> dict[str, Any]:
        """vLLM 0.33's: `checksum`: SHA-256 per checkpoint tensor; `compare`: against `baseline` (a checksum map, or
        a checksum response): `match` and the sorted names that differ, are missing or are extra (`mismatches`);
        `reset`: zero every weight, to check that the next update writes them all (until it has, generation is
        refused rather than served from zeros)."""
        action = body.action
        if action == "reset":
            await engine_call(engine.collective_rpc("reset_weights"))
            return {"status": "reset"}
        if action == "compare" and body.baseline is None:
            raise APIError(400, "baseline: action='compare' requires a 'baseline' object", "baseline")
        checksums = await engine_call(engine.weight_checksums())
        if action == "checksum":
            return {"checksums": checksums}
        baseline = body.baseline.checksums if isinstance(body.baseline, ChecksumsBody) else body.baseline
        compared = compare_checksums(baseline, checksums)
        mismatches = sorted(compared["mismatches"] + compared["missing"] + compared["unexpected"])
        return {"match": compared["match"], "mismatches": mismatches}

    return router


def _log_late_rpc(method: str, since: float) -> Callable[[asyncio.Future], None]:
    def done(call: asyncio.Future) -> None:
        error = None if call.cancelled() else call.exception()  # retrieved: no "never retrieved" warning
        logger.warning(
            "collective_rpc %r ended %.1f s after its caller timed out (%s); its result was dropped",
            method,
            time.monotonic() - since,
            "cancelled" if call.cancelled() else f"failed: {error!r}" if error else "returned",
        )

    return done


def _recovery_router(engine: AsyncLLM, timed: Any) -> APIRouter:
    """Routes for an operator whose trainer died (issue 20.1)."""
    router = _rl_router(timed)

    @router.post("/abandon_weight_update")
    async def abandon_weight_update() -> dict[str, str]:
        """Give up the weight update in progress; `weights`: "restored" (--weight-update-snapshot put the previous
        ones back), "incomplete" (generation is refused until a full update) or "unchanged" (none was written)."""
        outcome = await engine_call(engine.abandon_weight_update())
        return {"message": "Weight update abandoned", "weights": outcome}

    return router


def _profile_router(engine: AsyncLLM, timed: Any) -> APIRouter:
    """vLLM 0.33's `POST /start_profile` and `POST /stop_profile` (an empty 200, as vLLM answers), under the RL
    key. vLLM serves them whenever --profiler-config is set, without authentication (its --api-key guards /v1 only);
    here they are control routes like the other RL routes: a session slows every step and writes files on the
    server's disk, which no caller without the key may do. Without --profiler-config they answer 404, as vLLM does
    (it serves no such route), with the flag to set; starting while a session is active is vLLM's 409, stopping
    without one is a no-op (vLLM's too). An unknown body field is a 400, as on every route here (vLLM ignores it)."""
    router = _rl_router(timed)
    fields = ("profile_prefix", "delay_iterations", "max_iterations", "profiler_kwargs")

    def require_profiler() -> None:
        if not profiling_enabled(engine.config):
            raise APIError(404, f"/start_profile, /stop_profile: {NOT_ENABLED}")

    @router.post("/start_profile")
    async def start_profile(body: StartProfileRequest | None = None) -> Response:
        require_profiler()
        overrides = {} if body is None else body.model_dump(exclude_none=True)
        await engine_call(engine.start_profile(**overrides), fields=fields)
        return Response(status_code=200)

    @router.post("/stop_profile")
    async def stop_profile() -> Response:
        require_profiler()
        await engine_call(engine.stop_profile())
        return Response(status_code=200)

    return router


def _jsonable(value: Any) -> Any:
    """The value itself when JSON can carry it, else its str() (as vLLM's /collective_rpc does)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value
