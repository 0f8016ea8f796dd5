"""vLLM's routes beyond the OpenAI ones that RL frameworks call: token-in/token-out generation
(`/inference/v1/generate`), prompt rendering (`/v1/completions/render`, `/v1/chat/completions/render`), tokenization
(`/tokenize`, `/detokenize`) and server facts (`/server_info`, `/load`).

Authentication (access.py): every route here but the load figure needs `--api-key` when one is set, tokenization
included (vLLM leaves it open; here it runs on the prompt thread that /v1 shares, so an open one let anyone delay
keyed requests).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
from typing import Annotated, Any

import torch
from fastapi import APIRouter, Body, Request
from fastapi.responses import Response
from pydantic import BaseModel

import rlserve
from rlserve.model.loader import load_hf_config, resolve_dtype
from rlserve.server.chat_requests import ChatCompletionRequest, ChatMessages
from rlserve.server.errors import APIError
from rlserve.server.generate_protocol import GenerateRequest, _StrictModel, parse_body
from rlserve.server.guards import check_prompt_chars
from rlserve.server.openai_requests import CompletionRequest
from rlserve.server.serving import OpenAIServing
from rlserve.server.serving_chat import chat_prompt
from rlserve.server.serving_generate import generate_tokens, render_chat_request, render_completion_requests


class TokenizeCompletionRequest(_StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_StrictModel):
    model: str | None = None
    messages: ChatMessages
    add_generation_prompt: bool = True
    # The chat template places BOS and role markers itself (vLLM's default for chat).
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_StrictModel):
    model: str | None = None
    tokens: list[int]


# Environment variables whose names hold one of these words carry secrets: /server_info shows their names only.
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|PRIVATE|CERT|COOKIE|SESSION|SIGNATURE|SALT|PWD")
REDACTED = "<redacted>"


def _shown_value(name: str, value: str) -> str:
    return REDACTED if SECRET_NAME.search(name.upper()) else value


def build_vllm_routers(serving: OpenAIServing) -> list[APIRouter]:
    return [_generate_router(serving), _tokenizer_router(serving), _server_facts_router(serving)]


def _generate_router(serving: OpenAIServing) -> APIRouter:
    """Token-in/token-out generation, and the rendering of its requests."""
    router = APIRouter(tags=["vllm"])

    @router.post("/inference/v1/generate")
    async def generate(req: GenerateRequest, raw: Request) -> Response:
        return await generate_tokens(serving, req, raw)

    @router.post("/v1/completions/render")
    async def render_completion(req: CompletionRequest) -> list[dict]:
        return await render_completion_requests(serving, req)

    @router.post("/v1/chat/completions/render")
    async def render_chat(req: ChatCompletionRequest) -> dict:
        return await render_chat_request(serving, req)

    return router


def _tokenizer_router(serving: OpenAIServing) -> APIRouter:
    engine = serving.engine
    tokenizer = engine.tokenizer
    router = APIRouter(tags=["vllm"])

    @router.post("/tokenize")
    async def tokenize(body: Annotated[dict[str, Any], Body()]) -> TokenizeResponse:
        # One route, two bodies told apart by `messages` (vLLM's): parsed here, so that an error names the field of
        # the body meant rather than a member of a union.
        req: TokenizeCompletionRequest | TokenizeChatRequest
        if "messages" in body:
            req = parse_body(body, TokenizeChatRequest)
            serving.check_model(req.model)
            chat = ChatCompletionRequest(
                messages=req.messages,
                add_generation_prompt=req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs,
            )

            def text() -> str:
                return chat_prompt(serving, chat)["prompt"]

        else:
            req = parse_body(body, TokenizeCompletionRequest)
            serving.check_model(req.model)

            def text() -> str:
                check_prompt_chars(req.prompt, engine.max_model_len, "prompt")
                return req.prompt

        def tokenize_text() -> TokenizeResponse:
            tokens = tokenizer(text(), add_special_tokens=req.add_special_tokens).input_ids
            token_strs = tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
            return TokenizeResponse(
                count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=token_strs
            )

        return await serving.off_loop(tokenize_text)

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        serving.check_model(req.model)
        # Checked before any other work: a detokenized text is a prompt or an output, neither longer than the context.
        if len(req.tokens) > engine.max_model_len:
            message = f"tokens: {len(req.tokens)} ids, more than max_model_len={engine.max_model_len}"
            raise APIError(400, message, "tokens")
        vocab_size = engine.limits.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"tokens: ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", "tokens")
        return {"prompt": await serving.off_loop(lambda: tokenizer.decode(req.tokens))}

    return router


def _server_facts_router(serving: OpenAIServing) -> APIRouter:
    engine = serving.engine
    router = APIRouter(tags=["vllm"])

    @router.get("/server_info")
    async def server_info(config_format: str = "text") -> dict[str, Any]:
        """vLLM's shape: the engine's configuration (its `vllm_config`), the VLLM_/RLSERVE_ environment (secrets
        redacted), and the system."""
        if config_format not in ("text", "json"):
            message = f"query.config_format: must be text or json, got {config_format!r}"
            raise APIError(400, message, "query.config_format")
        config = engine.config
        as_json = json.loads(json.dumps(dataclasses.asdict(config), default=str))
        # vLLM's nesting of what clients read from it (TRL's async GRPO reads model_config.dtype, a torch dtype as
        # str() writes it), beside rlserve's own flat fields.
        dtype = await serving.off_loop(lambda: resolve_dtype(config.dtype, load_hf_config(config.model)))
        as_json["model_config"] = {"model": config.model, "dtype": str(dtype), "max_model_len": engine.max_model_len}
        env = {k: _shown_value(k, v) for k, v in os.environ.items() if k.startswith(("VLLM_", "RLSERVE_"))}
        system = {
            "rlserve_version": rlserve.__version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "platform": platform.platform(),
            "cuda_available": torch.cuda.is_available(),
        }
        return {
            "vllm_config": as_json if config_format == "json" else str(config),
            "vllm_env": env,
            "system_env": system,
        }

    @router.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's: the generation requests this API server has in flight (a load balancer's figure)."""
        return {"server_load": len(serving.active)}

    return router
