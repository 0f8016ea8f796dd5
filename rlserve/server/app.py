"""The HTTP server: OpenAI-compatible completions and chat over an AsyncLLM, plus (opt-in) vLLM's RL control routes.

`build_app` only composes: middleware, error handlers and the routers (each route family in its own module). The
engine belongs to the caller (`rlserve serve` creates it, runs uvicorn, shuts it down).
"""

from __future__ import annotations

import html
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import rlserve
from rlserve.engine.frontend.async_llm import (
    AsyncLLM,
    EngineDeadError,
    RequestRefusedError,
)
from rlserve.server.access import PUBLIC_PATHS, AccessGuard, AccessPolicy, RendezvousHosts
from rlserve.server.defaults import ServingDefaults
from rlserve.server.errors import APIError, ErrorResponse, error_response
from rlserve.server.framework_routes import FRAMEWORK_PUBLIC_PATHS, FrameworkState, build_framework_router
from rlserve.server.guards import RequestGuard
from rlserve.server.lora_routes import build_lora_router
from rlserve.server.metrics import ServerMetrics
from rlserve.server.openai_routes import build_openai_router, build_service_router
from rlserve.server.rl_routes import build_rl_routers
from rlserve.server.serving import OpenAIServing
from rlserve.server.skyrl_routes import build_skyrl_router
from rlserve.server.vllm_routes import build_vllm_routers


def build_app(
    engine: AsyncLLM,
    api_key: str | Sequence[str] | None,
    enable_rl_api: bool,
    served_model_name: str | Sequence[str],
    *,
    rl_api_keyed: bool = True,
    rl_api_key: str | Sequence[str] | None = None,
    defaults: ServingDefaults | None = None,
    allowed_weight_dirs: Collection[str] = (),
    bound_host: str = "127.0.0.1",
    runtime_lora_updating: bool = False,
    allowed_rendezvous_hosts: Sequence[str] | None = None,
) -> FastAPI:
    """`api_key`: the keys /v1 accepts, any of them; `rl_api_key`: the RL routes' (default: `api_key`'s), unless
    `rl_api_keyed=False`, vLLM dev mode's keyless RL routes; `served_model_name`: the names requests may send, the
    first in responses. `allowed_weight_dirs`: where /update_weights {"weight_dir"} may load checkpoints from.
    `bound_host`: the address the server listens on (a keyless RL route's `Host` may name it).
    `runtime_lora_updating`: whether /v1/load_lora_adapter may load adapters (from `allowed_weight_dirs`).
    `allowed_rendezvous_hosts`: where /init_weight_transfer_engine may connect ("*": any; None: this machine)."""
    api_keys = _keys(api_key)
    rl_keys = (_keys(rl_api_key) or api_keys) if rl_api_keyed else ()
    model_names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if enable_rl_api and rl_api_keyed and not rl_keys:
        raise ValueError(
            "the RL API (pause, weight updates) needs an API key: pass api_key or rl_api_key (--api-key, "
            "--rl-api-key or $RLSERVE_API_KEY)"
        )
    defaults = defaults or ServingDefaults()
    # FastAPI's /docs and /redoc load their scripts from a CDN, blank offline: /docs is a page of our own instead.
    app = FastAPI(title="rlserve", version=rlserve.__version__, docs_url=None, redoc_url=None)
    app.add_middleware(RequestGuard, max_body_bytes=defaults.max_request_body_bytes)
    metrics = ServerMetrics(engine, model_names[0])
    serving = OpenAIServing(engine, model_names, defaults)
    _install_error_handlers(app)
    errors = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413)}
    service_router = build_service_router(engine, metrics)
    app.include_router(service_router)
    api_routers = [
        build_openai_router(serving),
        *build_vllm_routers(serving),
        build_lora_router(serving.adapters, allowed_weight_dirs, runtime_lora_updating),
        build_skyrl_router(serving, allowed_weight_dirs, runtime_lora_updating),
    ]
    app.state.lora_adapters = serving.adapters  # the server loads --lora-modules through it before serving
    rl_routers: list[APIRouter] = []
    if enable_rl_api:
        rendezvous_hosts = RendezvousHosts.allow(allowed_rendezvous_hosts, bound_host)
        frameworks = app.state.frameworks = FrameworkState()
        rl_routers = [
            *build_rl_routers(engine, serving.active, metrics, allowed_weight_dirs, rendezvous_hosts, frameworks),
            build_framework_router(
                engine, serving.adapters, metrics, frameworks, allowed_weight_dirs, rendezvous_hosts
            ),
        ]
    for router in [*api_routers, *rl_routers]:
        app.include_router(router, responses=errors)
    _add_docs_page(app)
    # Outermost: a refused caller costs no body reading, no parsing, no route.
    # Paths from each router itself: FastAPI 0.16x nests an included router's routes instead of copying them.
    rl_paths = _paths(rl_routers) - FRAMEWORK_PUBLIC_PATHS
    api_paths = _paths([app.router, service_router, *api_routers]) - rl_paths - PUBLIC_PATHS
    app.add_middleware(AccessGuard, policy=AccessPolicy(api_keys, rl_keys, api_paths, rl_paths, bound_host))
    return app


def _paths(routers: Iterable[APIRouter]) -> frozenset[str]:
    return frozenset(route.path for router in routers for route in router.routes if hasattr(route, "path"))


def _keys(given: str | Sequence[str] | None) -> tuple[str, ...]:
    return (given,) if isinstance(given, str) else tuple(given or ())


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # 400 as vLLM and OpenAI answer (the OpenAI SDK's BadRequestError), not FastAPI's 422.
        errors = exc.errors()
        # The top-level field: deeper locations name union members ("prompt.list[int].0"); the message has them.
        fields = [e["loc"][1] for e in errors if len(e.get("loc", ())) > 1 and e["loc"][0] == "body"]
        param = str(fields[0]) if fields else None

        def describe(error: Mapping[str, Any]) -> str:
            if error.get("type") == "extra_forbidden":
                return "unknown field: neither vLLM nor rlserve has it"
            return str(error.get("msg"))

        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {describe(e)}" for e in errors)
        return error_response(APIError(400, message or "invalid request", param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(APIError(503, f"the engine is gone: {exc}"))

    @app.exception_handler(RequestRefusedError)
    async def request_refused(_: Request, exc: RequestRefusedError) -> JSONResponse:
        return error_response(APIError(503, str(exc)))

    # Any other exception: RequestGuard's 500 (a handler for Exception would run in Starlette's outermost
    # middleware, which re-raises it after answering, and uvicorn then drops the client's connection).


def _add_docs_page(app: FastAPI) -> None:
    """GET /docs: every route with its summary, and a link to /openapi.json (the schema, for any OpenAPI viewer); a
    static page that needs nothing from the network."""

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        schema = app.openapi()
        rows = "".join(
            f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code></td>"
            f"<td>{html.escape(op.get('summary', ''))}</td></tr>"
            for path, ops in schema["paths"].items()
            for method, op in ops.items()
        )
        body = (
            "<!doctype html><html><head><meta charset='utf-8'><title>rlserve API</title>"
            "</head><body><h1>rlserve API</h1><p>The full schema (request and response bodies): "
            "<a href='/openapi.json'>/openapi.json</a>, for any OpenAPI viewer.</p>"
            f"<table><tr><th>method</th><th>path</th><th>summary</th></tr>{rows}</table></body></html>"
        )
        return HTMLResponse(body)
