"""The routes of vLLM's OpenAI-compatible server that every client calls: its probes and facts (`/health`,
`/version`, `/metrics`, served to anyone) and the OpenAI API (`/v1/models`, `/v1/completions`,
`/v1/chat/completions`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

import rlserve
from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.server.chat_requests import ChatCompletionRequest
from rlserve.server.errors import APIError, error_response
from rlserve.server.metrics import ServerMetrics
from rlserve.server.openai_requests import CompletionRequest
from rlserve.server.openai_responses import ModelCard, ModelList
from rlserve.server.serving import OpenAIServing
from rlserve.server.serving_chat import create_chat_completion
from rlserve.server.serving_completions import create_completion


def build_service_router(engine: AsyncLLM, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    @router.get("/health/", include_in_schema=False)  # TRL's spelling: answered here, not with a redirect
    async def health() -> Response:
        # A failed engine step leaves the engine refusing work: say so, so orchestrators restart it. Weights
        # missing (sleep level 2, an abandoned update) refuse generation too, until an update: 503 with the reason.
        if engine.error is not None:
            return Response(status_code=503)
        not_serving = engine.not_serving
        if not_serving is not None:
            return error_response(APIError(503, f"generation refused: {not_serving}"))
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": rlserve.__version__}

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = await metrics.render()
        return Response(body, media_type=content_type)

    return router


def build_openai_router(serving: OpenAIServing) -> APIRouter:
    engine = serving.engine
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> ModelList:
        base = [
            ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len)
            for name in serving.model_names
        ]
        return ModelList(data=base + serving.adapters.cards(engine.max_model_len))

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(serving, req, raw)

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(serving, req, raw)

    return router
