"""vLLM's token-in/token-out route, POST /inference/v1/generate (token ids in; token ids and logprobs with integer
token ids out, whole or streamed), and the routes that render what it would be sent: /v1/completions/render and
/v1/chat/completions/render."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from rlserve.engine.frontend.llm import PromptType
from rlserve.outputs import CompletionOutput, RequestOutput
from rlserve.sampling_params import SamplingParams
from rlserve.server.chat_requests import ChatCompletionRequest
from rlserve.server.errors import APIError
from rlserve.server.generate_protocol import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamResponse,
    sampling_params_dict,
    sampling_params_from_dict,
    tokens_logprobs,
)
from rlserve.server.openai_requests import CompletionRequest
from rlserve.server.openai_responses import UsageInfo, new_id
from rlserve.server.response_fields import TokenFormatter, Usage, WeightVersions, prompt_logprobs, routed_experts_field
from rlserve.server.serving import SAMPLING_FIELDS, OpenAIServing, cancel_on_disconnect
from rlserve.server.serving_chat import chat_field_names, chat_prompt
from rlserve.server.serving_completions import completion_prompts
from rlserve.server.streaming import PositionLogprobsList, SSEResponse, stream_events


async def generate_tokens(serving: OpenAIServing, req: GenerateRequest, raw: Request) -> Response:
    """Token ids in, token ids (and logprobs with integer token ids) out. The client's `request_id` names the
    request for /abort_requests."""
    lora = serving.check_model(req.model)
    model = serving.model_for(lora)
    params = sampling_params_from_dict(req.sampling_params, req.stream)
    rename = {name: f"sampling_params.{name}" for name in SamplingParams.__dataclass_fields__}
    rename |= {"prompt": "token_ids", "prompt_token_ids": "token_ids"}
    prompt = {"prompt_token_ids": req.token_ids, "cache_salt": req.cache_salt}
    prompts = await serving.off_loop(lambda: serving.validate([prompt], params, rename, lora))
    serving.check_serving()
    request_id = req.request_id or new_id("generate")
    serving.claim(request_id)
    # vLLM's generate route sends the spans on every finished choice, unasked.
    weight_versions = WeightVersions(spans=True, per_token=req.return_token_weight_versions)

    def choice(s: CompletionOutput) -> GenerateChoice:
        return GenerateChoice(
            index=s.index,
            token_ids=s.token_ids,
            logprobs=None if s.logprobs is None else tokens_logprobs(s),
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            **weight_versions(s.index, s),
            routed_experts=routed_experts_field(s),
        )

    if req.stream:

        def chunk(
            index: int, out: RequestOutput, s: CompletionOutput, first: bool, _: PositionLogprobsList | None
        ) -> BaseModel:
            prompt_ids = out.prompt_token_ids if first and req.return_token_ids else None
            return GenerateStreamResponse(request_id=request_id, choices=[choice(s)], prompt_token_ids=prompt_ids)

        def usage_chunk(usage: UsageInfo) -> BaseModel:
            return GenerateStreamResponse(request_id=request_id, choices=[], usage=usage)

        body = stream_events(
            serving.generate(request_id, prompts, raw, streaming=True),
            params.n,
            params.n,
            req.include_usage,
            chunk,
            usage_chunk,
            [],
        )
        return SSEResponse(body)

    finals = await cancel_on_disconnect(raw, serving.final_outputs(request_id, prompts, raw))
    if finals is None:
        return Response(status_code=499)
    (out,) = finals
    usage = Usage()
    usage.add(0, out)
    response = GenerateResponse(
        request_id=request_id,
        model=model,
        choices=[choice(s) for s in out.outputs],
        usage=usage.info(),
        prompt_logprobs=prompt_logprobs(out.prompt_logprobs, TokenFormatter(False)),
        prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None,
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _render(
    serving: OpenAIServing,
    request_id: str,
    req: CompletionRequest | ChatCompletionRequest,
    prompt: PromptType,
    rename: Mapping[str, str],
) -> dict:
    """One vLLM GenerateRequest: what /inference/v1/generate would be sent for this prompt, checked as the
    generating route checks it."""
    try:
        params = req.sampling_params()
    except ValueError as e:
        raise APIError.from_value_error(e, SAMPLING_FIELDS, None, rename) from e
    (checked,) = serving.validate([prompt], params, rename)
    return {
        "request_id": request_id,
        "token_ids": checked.token_ids,
        "sampling_params": sampling_params_dict(checked.params),
        "model": req.model,
        "stream": req.stream,
        "return_token_ids": req.return_token_ids,
        "cache_salt": checked.cache_salt,
    }


async def render_completion_requests(serving: OpenAIServing, req: CompletionRequest) -> list[dict]:
    serving.check_model(req.model)

    def render() -> list[dict]:
        prompts = completion_prompts(serving, req)
        base = new_id("cmpl")
        ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        rename = {"prompt_token_ids": "prompt"}
        return [_render(serving, rid, req, p, rename) for rid, p in zip(ids, prompts, strict=True)]

    return await serving.off_loop(render)


async def render_chat_request(serving: OpenAIServing, req: ChatCompletionRequest) -> dict:
    """vLLM's GenerateRequest, plus `prompt`: the text the chat template made (rlserve's); of a truncated
    prompt, the text of the tokens kept."""
    serving.check_model(req.model)
    rename = chat_field_names(req)

    def render() -> dict:
        prompt = chat_prompt(serving, req)
        text = prompt.get("prompt") or serving.engine.tokenizer.decode(prompt["prompt_token_ids"])
        return {**_render(serving, new_id("chatcmpl"), req, prompt, rename), "prompt": text}

    return await serving.off_loop(render)
