"""POST /v1/completions: text or token-id prompts (or a batch of them) in, OpenAI completions out, whole or streamed
as Server-Sent Events with one chunk per new token of a choice; with `echo`, each choice starts with its prompt."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from rlserve.engine.frontend.llm import PromptType
from rlserve.outputs import CompletionOutput, RequestOutput
from rlserve.server.completion_echo import CompletionEcho
from rlserve.server.errors import APIError
from rlserve.server.guards import check_prompt_chars
from rlserve.server.openai_requests import CompletionRequest
from rlserve.server.openai_responses import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from rlserve.server.response_fields import (
    TokenFormatter,
    Usage,
    WeightVersions,
    completion_logprobs,
    prompt_logprobs,
    routed_experts_field,
)
from rlserve.server.serving import SAMPLING_FIELDS, OpenAIServing, cancel_on_disconnect
from rlserve.server.streaming import PositionLogprobsList, stream_events


async def create_completion(serving: OpenAIServing, req: CompletionRequest, raw: Request) -> Response:
    lora = serving.check_model(req.model)
    rename = {"prompt_token_ids": "prompt"}
    try:
        params = serving.defaults.sampling_params(req)
    except ValueError as e:
        raise APIError.from_value_error(e, SAMPLING_FIELDS, "prompt", rename) from e
    prompts = await serving.off_loop(lambda: serving.validate(completion_prompts(serving, req), params, rename, lora))
    serving.check_serving()
    response_id, request_id = serving.request_ids(req, "cmpl")
    choices = _CompletionChoices(serving, req, response_id, serving.model_for(lora), params.n)
    if req.stream:
        outputs = serving.generate(request_id, prompts, raw, streaming=True)
        body = stream_events(outputs, params.n, req.include_usage, choices.chunk, choices.usage_chunk, [])
        return StreamingResponse(body, media_type="text/event-stream")

    finals = await cancel_on_disconnect(raw, serving.final_outputs(request_id, prompts, raw))
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return Response(choices.response(finals).model_dump_json(), media_type="application/json")


def completion_prompts(serving: OpenAIServing, req: CompletionRequest) -> list[PromptType]:
    """The engine prompts of the request's prompts, text tokenized (blocking: call it off the event loop)."""
    engine = serving.engine
    prompts: list[PromptType] = []
    for p in req.prompts():
        if isinstance(p, str):
            check_prompt_chars(p, engine.max_model_len, "prompt")
            ids = engine.tokenizer(p, add_special_tokens=req.add_special_tokens).input_ids
            prompts.append(serving.tokenized(req, p, ids))
        else:
            prompts.append(serving.tokenized(req, None, p))
    return prompts


class _CompletionChoices:
    """One request's choices in OpenAI's completion shape, as stream chunks or as the whole response: the text (after
    the prompt, with echo), the logprobs, and the fields the request asks for. Choice `index` is the prompt's index
    times `n` plus the sample's."""

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, response_id: str, model: str, n: int) -> None:
        self.req = req
        self.response_id = response_id
        self.model = model
        self.n = n
        self.tokenizer = serving.engine.tokenizer
        self.fmt = TokenFormatter(serving.defaults.tokens_as_token_ids(req))
        self.weight_versions = WeightVersions.of(req)
        self.echo = CompletionEcho(req.echo, req.max_tokens == 0, not req.return_token_ids, self.tokenizer.decode)
        # A streamed choice's text so far, where the offsets of its next chunk's logprobs start.
        self.text_offsets: dict[int, int] = {}

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _choice(
        self,
        index: int,
        sample: CompletionOutput,
        text: str,
        logprobs: CompletionLogProbs | None,
        prompt_lps: PositionLogprobsList | None,
        prompt_token_ids: list[int] | None,
    ) -> CompletionResponseChoice:
        return CompletionResponseChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            **self.weight_versions(index, sample),
            routed_experts=routed_experts_field(sample),
            token_ids=sample.token_ids if self.req.return_token_ids else None,
            prompt_logprobs=prompt_logprobs(prompt_lps, self.fmt),
            prompt_token_ids=prompt_token_ids,
        )

    def chunk(
        self,
        index: int,
        out: RequestOutput,
        sample: CompletionOutput,
        first: bool,
        prompt_lps: PositionLogprobsList | None,
    ) -> BaseModel:
        content = self.echo.content(out, sample, first, prompt_lps)
        logprobs = None
        if content.logprobs is not None:
            offset = self.text_offsets.get(index, 0)
            logprobs, self.text_offsets[index] = completion_logprobs(
                content.token_ids, content.logprobs, self.fmt, offset, self._decode
            )
        prompt_token_ids = out.prompt_token_ids if first and self.req.return_token_ids else None
        choice = self._choice(index, sample, content.text, logprobs, prompt_lps, prompt_token_ids)
        return CompletionStreamResponse(id=self.response_id, model=self.model, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return CompletionStreamResponse(id=self.response_id, model=self.model, choices=[], usage=usage)

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        usage = Usage()
        choices = []
        for i, out in enumerate(finals):
            usage.add(i, out)
            for sample in out.outputs:
                content = self.echo.content(out, sample, True, out.prompt_logprobs)
                logprobs = None
                if content.logprobs is not None:
                    logprobs = completion_logprobs(content.token_ids, content.logprobs, self.fmt, 0, self._decode)[0]
                prompt_token_ids = out.prompt_token_ids if self.req.return_token_ids else None
                index = i * self.n + sample.index
                choices.append(
                    self._choice(index, sample, content.text, logprobs, out.prompt_logprobs, prompt_token_ids)
                )
        return CompletionResponse(id=self.response_id, model=self.model, choices=choices, usage=usage.info())
