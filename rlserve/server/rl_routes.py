"""vLLM's RL control routes (paths and bodies of its dev-mode RLHF router), behind the server's API key.

Unlike vLLM, which serves them unauthenticated in dev mode, every route here depends on `auth`: these routes pause
generation and overwrite the model. Errors: a ValueError (bad input) is a 400 naming the field, a RuntimeError (a call
out of lifecycle order, e.g. update before start) a 409; neither takes the server down.

Bodies are read by hand rather than by pydantic so that malformed JSON is a 400, as in vLLM.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Query, Request

from rlserve.engine.async_llm import AsyncLLM
from rlserve.engine.messages import SLEEP_MODES
from rlserve.server.metrics import ServerMetrics
from rlserve.server.protocol import APIError
from rlserve.weight_transfer.checksum import compare_checksums

T = TypeVar("T")


async def _json_body(request: Request, required: bool = False) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise APIError(400, "request body: expected a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body: not valid JSON ({e})") from e
    if not isinstance(body, dict):
        raise APIError(400, f"request body: expected a JSON object, got {type(body).__name__}")
    return body


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], required: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(400, f"{name}: required", name)
        return None
    if not isinstance(value, kind):
        raise APIError(400, f"{name}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}", name)
    return value


async def _engine_call(call: Awaitable[T], param: str | None = None, fields: Collection[str] = ()) -> T:
    try:
        return await call
    except ValueError as e:
        raise APIError.from_value_error(e, fields, param) from e
    except RuntimeError as e:
        raise APIError(409, str(e), param) from e


def _allowed_weight_dir(weight_dir: str, allowed: Collection[str]) -> str:
    """The real path of `weight_dir` if it lies under a directory the operator allowed (--allowed-weight-dirs);
    links are resolved first, so none leads out of them."""
    real = os.path.realpath(weight_dir)
    roots = [os.path.realpath(a) for a in allowed]
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        why = "no directory is allowed (--allowed-weight-dirs)" if not roots else f"allowed: {roots}"
        raise APIError(403, f"weight_dir: {weight_dir!r} is not under an allowed directory; {why}", "weight_dir")
    if not os.path.isdir(real):
        raise APIError(400, f"weight_dir: {weight_dir!r} is not a directory", "weight_dir")
    return real


def build_rl_router(
    engine: AsyncLLM,
    active_requests: Mapping[str, list[str]],
    auth: Callable[..., Awaitable[None]],
    metrics: ServerMetrics,
    allowed_weight_dirs: Collection[str] = (),
) -> APIRouter:
    """`active_requests`: the server's in-flight requests (response id -> engine request ids), for /abort_requests.
    `allowed_weight_dirs`: where `/update_weights {"weight_dir"}` may load checkpoints from."""

    async def timed(request: Request) -> AsyncIterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            metrics.observe_rl_call(request.scope["route"].path, time.perf_counter() - start)

    router = APIRouter(dependencies=[Depends(auth), Depends(timed)], tags=["rl"])
    checksum_baseline: dict[str, dict[str, str]] = {}  # "baseline" -> the last checksum taken, for compare

    @router.post("/pause")
    async def pause(
        mode: str = "abort", clear_cache: bool = True, wait_for_inflight_requests: bool | None = None
    ) -> dict[str, str]:
        pause_call = engine.pause_generation(
            mode=mode, clear_cache=clear_cache, wait_for_inflight_requests=wait_for_inflight_requests
        )
        await _engine_call(pause_call, "query.mode")
        metrics.generation_paused()
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> dict[str, str]:
        await _engine_call(engine.resume_generation())
        metrics.generation_resumed()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await engine.is_paused()}

    @router.post("/sleep")
    async def sleep(level: int = 1, mode: str = "abort") -> dict[str, Any]:
        # vLLM's default mode: the requests in flight end (finish_reason "abort") before the engine sleeps.
        if mode not in SLEEP_MODES:
            raise APIError(400, f"query.mode: must be one of {list(SLEEP_MODES)}, got {mode!r}", "query.mode")
        await _engine_call(engine.sleep(level, mode), "query.level")
        return {"status": "sleeping", "level": level}

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict[str, str]:
        await _engine_call(engine.wake_up(tags), "query.tags")
        return {"status": "sleeping" if await engine.is_sleeping() else "awake"}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await engine.is_sleeping()}

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> dict[str, str]:
        # Blocks until the trainer joins the group (the trainer calls trainer_init concurrently).
        init_info = _field(await _json_body(request, required=True), "init_info", dict, required=True)
        await _engine_call(engine.init_weight_transfer_engine({"init_info": init_info}), "init_info")
        return {"message": "Weight transfer initialized"}

    @router.post("/start_weight_update")
    async def start_weight_update(request: Request) -> dict[str, str]:
        body = await _json_body(request)
        if _field(body, "is_checkpoint_format", bool) is False:
            raise APIError(
                400, "is_checkpoint_format: rlserve loads checkpoint-format names only", "is_checkpoint_format"
            )
        await _engine_call(engine.start_weight_update())
        metrics.weight_update_started()
        return {"message": "Weight update started"}

    @router.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, str]:
        """vLLM's `{"update_info": {...}}` or a list of them, applied in order (an update refused part-way leaves
        the earlier ones applied, as in vLLM); or prime-rl's `{"weight_dir": PATH}`, a checkpoint directory the
        trainer wrote, loaded in place (checked whole first, so a refused one changes nothing)."""
        body = await _json_body(request, required=True)
        if "weight_dir" in body:
            if "update_info" in body:
                raise APIError(400, "weight_dir: send weight_dir or update_info, not both", "weight_dir")
            weight_dir = _allowed_weight_dir(_field(body, "weight_dir", str, required=True), allowed_weight_dirs)
            await _engine_call(engine.load_weights_from_dir(weight_dir), "weight_dir")
            return {"message": "Weights updated"}
        update_info = _field(body, "update_info", (dict, list), required=True)
        updates = update_info if isinstance(update_info, list) else [update_info]
        if not updates or not all(isinstance(u, dict) for u in updates):
            raise APIError(400, "update_info: expected an object or a non-empty list of objects", "update_info")
        for update in updates:
            await _engine_call(engine.update_weights({"update_info": update}), "update_info")
        return {"message": "Weights updated"}

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> dict[str, str]:
        await _engine_call(engine.shutdown_weight_transfer_engine())
        return {"message": "Weight transfer shut down"}

    @router.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> dict[str, str]:
        version = _field(await _json_body(request), "weight_version", (str, int))
        await _engine_call(engine.finish_weight_update(None if version is None else str(version)), "weight_version")
        metrics.weight_update_finished()
        return {"message": "Weight update finished"}

    @router.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        version = str(_field(await _json_body(request, required=True), "new_version", (str, int), required=True))
        await _engine_call(engine.update_weight_version(version), "new_version")
        return {"success": True, "new_version": version}

    @router.get("/weight_version")
    @router.get("/weight_info")
    async def weight_version() -> dict[str, str]:
        return {"weight_version": await engine.get_weight_version()}

    @router.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict[str, list[Any]]:
        # Only the methods of the server's --worker-extension-cls, never the worker's own attributes: the caller
        # names code the operator installed, it cannot reach into the engine.
        body = await _json_body(request, required=True)
        method = _field(body, "method", str, required=True)
        allowed = engine.worker_extension_methods()
        if method not in allowed:
            message = f"method: {method!r} is not a method of the worker extension (callable: {sorted(allowed)})"
            raise APIError(400, message, "method")
        args = _field(body, "args", list) or []
        kwargs = _field(body, "kwargs", dict) or {}
        timeout = _field(body, "timeout", (int, float))
        results = await _engine_call(engine.collective_rpc(method, timeout, tuple(args), kwargs), "method")
        return {"results": [_jsonable(r) for r in results]}

    @router.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> dict[str, int]:
        return {"world_size": 1}  # one engine, one worker: no TP/PP/DP yet

    @router.post("/abort_requests")
    async def abort_requests(request: Request) -> dict[str, Any]:
        wanted = _field(await _json_body(request), "request_ids", list)
        ids = list(active_requests) if wanted is None else [r for r in wanted if r in active_requests]
        engine_ids = [e for rid in ids for e in active_requests.get(rid, [])]
        if engine_ids:
            await _engine_call(engine.abort(engine_ids))
        return {"status": "aborted", "aborted": len(ids)}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> dict[str, bool]:
        """vLLM's: `success` is always true here, since a reset never waits on blocks in use (they stay with
        their requests and are not shared again). `reset_external`: rlserve has no external (connector) cache,
        so there is nothing more to reset."""
        await _engine_call(engine.reset_prefix_cache(reset_running_requests))
        return {"success": True}

    @router.post("/weight_checker")
    async def weight_checker(request: Request) -> dict[str, Any]:
        """`checksum`: SHA-256 per checkpoint tensor (kept as the baseline); `compare`: against `baseline` (a
        checksum map, or a checksum response) or the kept one; `reset`: forget the kept baseline."""
        body = await _json_body(request, required=True)
        action = _field(body, "action", str, required=True)
        if action == "checksum":
            checksums = await _engine_call(engine.weight_checksums())
            checksum_baseline["baseline"] = checksums
            return {"checksums": checksums}
        if action == "compare":
            baseline = _field(body, "baseline", dict) or checksum_baseline.get("baseline")
            if baseline is None:
                raise APIError(400, "baseline: no baseline given and none taken with action=checksum", "baseline")
            baseline = baseline.get("checksums", baseline)
            return compare_checksums(baseline, await _engine_call(engine.weight_checksums()))
        if action == "reset":
            checksum_baseline.clear()
            return {"status": "reset"}
        raise APIError(400, f"action: must be checksum, compare or reset, got {action!r}", "action")

    _add_recovery_routes(router, engine)
    return router


def _add_recovery_routes(router: APIRouter, engine: AsyncLLM) -> None:
    """Routes for an operator whose trainer died (issue 20.1), under the router's key."""

    @router.post("/abandon_weight_update")
    async def abandon_weight_update() -> dict[str, str]:
        """Give up the weight update in progress; `weights`: "restored" (--weight-update-snapshot put the previous
        ones back), "incomplete" (generation is refused until a full update) or "unchanged" (none was written)."""
        outcome = await _engine_call(engine.abandon_weight_update())
        return {"message": "Weight update abandoned", "weights": outcome}


def _jsonable(value: Any) -> Any:
    """The value itself when JSON can carry it, else its str() (as vLLM's /collective_rpc does)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value
