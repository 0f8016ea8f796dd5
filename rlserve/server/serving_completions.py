"""POST /v1/completions: text or token-id prompts (or a batch of them) in, OpenAI completions out, whole or streamed
as Server-Sent Events with one chunk per new token of a choice; with `echo`, each choice starts with its prompt."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response
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
    now,
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
from rlserve.server.streaming import ChunkTemplate, PositionLogprobsList, SSEResponse, stream_events


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
        num_choices = params.n * len(prompts)
        body = stream_events(outputs, params.n, num_choices, req.include_usage, choices.chunk, choices.usage_chunk, [])
        return SSEResponse(body)

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
        self.created = now()  # one time for every chunk of a stream, as OpenAI's
        self.templates: dict[int, ChunkTemplate] = {}  # each choice's plain chunks

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
        versions: dict[str, Any],
    ) -> CompletionResponseChoice:
        return CompletionResponseChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            **versions,
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
    ) -> BaseModel | bytes:
        versions = self.weight_versions(index, sample)
        plain = not (first and (self.echo.echo or prompt_lps is not None or self.req.return_token_ids))
        if plain and sample.logprobs is None and sample.finish_reason is None:
            token_ids = sample.token_ids if self.req.return_token_ids else None
            return self._template(index).render(sample.text, versions.get("token_weight_versions"), token_ids)
        content = self.echo.content(out, sample, first, prompt_lps)
        logprobs = None
        if content.logprobs is not None:
            offset = self.text_offsets.get(index, 0)
            logprobs, self.text_offsets[index] = completion_logprobs(
                content.token_ids, content.logprobs, self.fmt, offset, self._decode
            )
        prompt_token_ids = out.prompt_token_ids if first and self.req.return_token_ids else None
        choice = self._choice(index, sample, content.text, logprobs, prompt_lps, prompt_token_ids, versions)
        return self._stream_chunk([choice])

    def _template(self, index: int) -> ChunkTemplate:
        """Choice `index`'s chunks with nothing but text and, as asked, each token's version and id: neither its
        first with echo or the prompt's fields, nor its last, nor one with logprobs."""
        template = self.templates.get(index)
        if template is None:

            def chunk(text: str, versions: list[str], token_ids: list[int]) -> BaseModel:
                choice = CompletionResponseChoice(
                    index=index, text=text, token_weight_versions=versions, token_ids=token_ids
                )
                return self._stream_chunk([choice])

            template = self.templates[index] = ChunkTemplate(chunk, ("str", "strs", "ints"))
        return template

    def _stream_chunk(self, choices: list[CompletionResponseChoice], usage: UsageInfo | None = None) -> BaseModel:
        return CompletionStreamResponse(
            id=self.response_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._stream_chunk([], usage)

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
                versions = self.weight_versions(index, sample)
                choices.append(
                    self._choice(index, sample, content.text, logprobs, out.prompt_logprobs, prompt_token_ids, versions)
                )
        return CompletionResponse(id=self.response_id, model=self.model, choices=choices, usage=usage.info())
