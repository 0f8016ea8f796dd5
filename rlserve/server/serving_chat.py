"""POST /v1/chat/completions: messages rendered by the chat template, OpenAI chat completions out, whole or streamed
as Server-Sent Events. With --reasoning-parser the reply's thinking is split from its content, and with
--enable-auto-tool-choice its tool calls are parsed from the content."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from rlserve.engine.frontend.llm import ValidatedPrompt, render_chat
from rlserve.outputs import CompletionOutput, RequestOutput
from rlserve.sampling_params import SamplingParams
from rlserve.server.chat_requests import ChatCompletionRequest, ToolCall
from rlserve.server.defaults import ServingDefaults
from rlserve.server.errors import APIError
from rlserve.server.guards import check_chat_size, check_prompt_chars
from rlserve.server.openai_responses import (
    ChatCompletionLogProbs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    DeltaToolCall,
    UsageInfo,
    now,
)
from rlserve.server.reasoning_parsers import (
    READS_SPECIAL_TOKENS,
    Reasoned,
    ReasoningParser,
    ReasoningStream,
    reasoning_parser,
)
from rlserve.server.response_fields import (
    TokenFormatter,
    Usage,
    WeightVersions,
    chat_logprobs,
    prompt_logprobs,
    routed_experts_field,
)
from rlserve.server.serving import SAMPLING_FIELDS, OpenAIServing, cancel_on_disconnect
from rlserve.server.streaming import ChunkTemplate, PositionLogprobsList, SSEResponse, stream_events
from rlserve.server.tool_parsers import StreamingToolCalls, parse_hermes


async def create_chat_completion(serving: OpenAIServing, req: ChatCompletionRequest, raw: Request) -> Response:
    lora = serving.check_model(req.model)
    rename = chat_field_names(req)
    try:
        params = serving.defaults.sampling_params(req, **_special_token_overrides(serving.defaults, req))
    except ValueError as e:
        raise APIError.from_value_error(e, SAMPLING_FIELDS, None, rename) from e
    parse_tools = _parses_tool_calls(serving.defaults, req)

    def prepare() -> tuple[list[ValidatedPrompt], ReasoningParser | None]:
        validated = serving.validate([chat_prompt(serving, req)], params, rename, lora)
        return validated, _reasoning_parser(serving, req, validated[0])

    prompts, reasoning = await serving.off_loop(prepare)
    serving.check_serving()
    response_id, request_id = serving.request_ids(req, "chatcmpl")
    choices = _ChatChoices(serving, req, response_id, serving.model_for(lora), params, reasoning, parse_tools)
    if req.stream:
        outputs = serving.generate(request_id, prompts, raw, streaming=True)
        first_chunks = choices.first_chunks()
        body = stream_events(
            outputs, params.n, params.n, req.include_usage, choices.chunk, choices.usage_chunk, first_chunks
        )
        return SSEResponse(body)

    finals = await cancel_on_disconnect(raw, serving.final_outputs(request_id, prompts, raw))
    if finals is None:
        return Response(status_code=499)
    (out,) = finals
    return Response(choices.response(out).model_dump_json(), media_type="application/json")


def chat_field_names(req: ChatCompletionRequest) -> dict[str, str]:
    """Chat's names of the fields an engine error names (its `rename` for APIError.from_value_error)."""
    rename = {"logprobs": "top_logprobs", "prompt": "messages", "prompt_token_ids": "messages"}
    if req.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    return rename


def chat_prompt(serving: OpenAIServing, req: ChatCompletionRequest) -> dict[str, Any]:
    """The engine prompt of a chat request (blocking: call it off the event loop)."""
    defaults, engine = serving.defaults, serving.engine
    if req.chat_template is not None and not defaults.trust_request_chat_template:
        # vLLM's rule: a template is code the server runs (Jinja loops can spin for hours), so only a server
        # that trusts its clients lets them send one.
        raise APIError(
            400,
            "chat_template: a request's own chat template needs the server started with --trust-request-chat-template",
            "chat_template",
        )
    tokenizer = engine.tokenizer
    check_chat_size(req.messages, engine.max_model_len)
    try:
        text = render_chat(
            tokenizer,
            [m.template_dict() for m in req.messages],
            chat_template=req.chat_template or defaults.chat_template,
            add_generation_prompt=req.generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools],
            documents=req.documents,
            chat_template_kwargs=req.template_kwargs(),
        )
    except ValueError as e:
        raise APIError.from_value_error(e, {"messages", "chat_template_kwargs"}, "messages") from e
    check_prompt_chars(text, engine.max_model_len, "messages")
    # By default (vLLM's for chat) the template alone places the special tokens: none are added a second time.
    return serving.tokenized(req, text, tokenizer(text, add_special_tokens=req.add_special_tokens).input_ids)


def _special_token_overrides(defaults: ServingDefaults, req: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's: a model's tool-call (or thinking) tags may be special tokens, which the parser must see, so they are
    kept unless the request says otherwise (tools asked for without the server's flag are refused after the params
    are built, by _parses_tool_calls, as before)."""
    parses_tools = bool(req.tools) and req.tool_choice == "auto" and defaults.enable_auto_tool_choice
    reads_special_tokens = parses_tools or defaults.reasoning_parser in READS_SPECIAL_TOKENS
    if reads_special_tokens and "skip_special_tokens" not in req.model_fields_set:
        return {"skip_special_tokens": False}
    return {}


def _parses_tool_calls(defaults: ServingDefaults, req: ChatCompletionRequest) -> bool:
    """Whether the output is parsed for tool calls: tools offered with tool_choice "auto", which needs the
    server's --enable-auto-tool-choice (vLLM's rule)."""
    if not req.tools or req.tool_choice != "auto":
        return False
    if not defaults.enable_auto_tool_choice:
        raise APIError(
            400,
            'tool_choice: "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser',
            "tool_choice",
        )
    return True


def _reasoning_parser(
    serving: OpenAIServing, req: ChatCompletionRequest, prompt: ValidatedPrompt
) -> ReasoningParser | None:
    """The request's --reasoning-parser, which reads its chat template kwargs and whether its prompt has closed
    the thinking already; None without the flag. Blocking (it may decode the prompt): call it off the loop."""
    name = serving.defaults.reasoning_parser
    if name is None:
        return None
    text = prompt.text if prompt.text is not None else serving.engine.tokenizer.decode(prompt.token_ids)
    return reasoning_parser(name, req.template_kwargs(), text)


def _finish_reason(engine_reason: str | None, tool_calls: Sequence[ToolCall]) -> str | None:
    """vLLM's: "tool_calls" when the model stopped by itself after calling tools (a length cut stays visible)."""
    return "tool_calls" if tool_calls and engine_reason == "stop" else engine_reason


class _ChatChoices:
    """One request's choices in OpenAI's chat shape, as stream chunks or as the whole response: each reply split into
    reasoning, content and tool calls as the server's parsers read it, and the fields the request asks for."""

    def __init__(
        self,
        serving: OpenAIServing,
        req: ChatCompletionRequest,
        response_id: str,
        model: str,
        params: SamplingParams,
        reasoning: ReasoningParser | None,
        parse_tools: bool,
    ) -> None:
        self.req = req
        self.response_id = response_id
        self.model = model
        self.n = params.n
        self.reasoning = reasoning
        self.parse_tools = parse_tools
        self.fmt = TokenFormatter(serving.defaults.tokens_as_token_ids(req))
        self.weight_versions = WeightVersions.of(req)
        self.echoed = req.echoed()
        self.top_k = params.logprobs or 0
        # vLLM's: a reply without its reasoning has no logprobs or token ids either (they would show it), on a
        # server that parses output.
        parses_output = serving.defaults.reasoning_parser is not None or serving.defaults.enable_auto_tool_choice
        self.hidden = not req.include_reasoning and parses_output
        # A streamed choice's parsers, which hold back what may be the start of a tag until the next chunk.
        self.reasoning_streams: dict[int, ReasoningStream] = {}
        self.tool_streams: dict[int, StreamingToolCalls] = {}
        self.created = now()  # one time for every chunk of a stream, as OpenAI's
        self.templates: dict[int, ChunkTemplate] = {}  # each choice's plain chunks
        # Its chunks' deltas are the sample's text as it is (no parser holds part of it back).
        self.text_deltas = reasoning is None and not parse_tools

    def _logprobs(self, s: CompletionOutput) -> ChatCompletionLogProbs | None:
        return None if s.logprobs is None or self.hidden else chat_logprobs(s, self.fmt, self.top_k)

    def _token_ids(self, s: CompletionOutput) -> list[int] | None:
        return s.token_ids if self.req.return_token_ids and not self.hidden else None

    # ---- streamed ----

    def first_chunks(self) -> list[BaseModel]:
        """Each choice's role, then (echo) the text its reply continues, as vLLM streams them."""
        chunks = [self._preamble(DeltaMessage(role="assistant", content=""), i) for i in range(self.n)]
        if self.echoed:
            chunks += [self._preamble(DeltaMessage(content=self.echoed), i) for i in range(self.n)]
        return chunks

    def _preamble(self, delta: DeltaMessage, index: int) -> BaseModel:
        return self._stream_chunk([ChatCompletionStreamChoice(index=index, delta=delta)])

    def chunk(
        self,
        index: int,
        out: RequestOutput,
        s: CompletionOutput,
        first: bool,
        prompt_lps: PositionLogprobsList | None,
    ) -> BaseModel | bytes:
        versions = self.weight_versions(index, s)
        # Chat has the prompt's logprobs at the top level: sent once, with the first choice's first chunk.
        top_level = prompt_logprobs(prompt_lps, self.fmt) if index == 0 else None
        no_logprobs = s.logprobs is None or self.hidden
        if self.text_deltas and top_level is None and s.finish_reason is None and no_logprobs:
            return self._template(index).render(s.text, versions.get("token_weight_versions"), self._token_ids(s))
        delta, finish_reason = self._delta(index, s)
        choice = ChatCompletionStreamChoice(
            index=index,
            delta=delta,
            logprobs=self._logprobs(s),
            finish_reason=finish_reason,
            stop_reason=s.stop_reason,
            **versions,
            routed_experts=routed_experts_field(s),
            token_ids=self._token_ids(s),
        )
        return self._stream_chunk([choice], prompt_logprobs=top_level)

    def _template(self, index: int) -> ChunkTemplate:
        """Choice `index`'s chunks with nothing but content and, as asked, each token's version and id: not its
        last, nor one with logprobs or the prompt's, nor any where a parser splits the text."""
        template = self.templates.get(index)
        if template is None:

            def chunk(text: str, versions: list[str], token_ids: list[int]) -> BaseModel:
                choice = ChatCompletionStreamChoice(
                    index=index, delta=DeltaMessage(content=text), token_weight_versions=versions, token_ids=token_ids
                )
                return self._stream_chunk([choice])

            template = self.templates[index] = ChunkTemplate(chunk, ("str", "strs", "ints"))
        return template

    def _stream_chunk(self, choices: list[ChatCompletionStreamChoice], **fields: Any) -> BaseModel:
        return ChatCompletionStreamResponse(
            id=self.response_id, created=self.created, model=self.model, choices=choices, **fields
        )

    def _delta(self, index: int, s: CompletionOutput) -> tuple[DeltaMessage, str | None]:
        """The choice's new reasoning and content, and on its last chunk its tool calls (with the finish reason they
        make), as its stream parsers let them out."""
        finish_reason, finished = s.finish_reason, s.finish_reason is not None
        thought, content = "", s.text
        if self.reasoning is not None:
            thinking = self.reasoning_streams.setdefault(index, self.reasoning.stream())
            thought, content = thinking.feed(s.text)
            if finished:
                rest_thought, rest_content = thinking.finish()
                thought, content = thought + rest_thought, content + rest_content
        delta = DeltaMessage(reasoning=thought if thought and self.req.include_reasoning else None)
        if self.parse_tools:  # in the content only: a call while thinking is no call (vLLM's)
            tools = self.tool_streams.setdefault(index, StreamingToolCalls())
            content = tools.feed(content)
            if finished:
                parsed = tools.finish()
                content += parsed.content
                calls = [DeltaToolCall(index=k, **c.model_dump()) for k, c in enumerate(parsed.tool_calls)]
                delta.tool_calls = calls
                finish_reason = _finish_reason(s.finish_reason, parsed.tool_calls)
        delta.content = content if content or delta.reasoning is None else None
        return delta, finish_reason

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._stream_chunk([], usage=usage)

    # ---- whole ----

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        usage = Usage()
        usage.add(0, out)
        return ChatCompletionResponse(
            id=self.response_id,
            model=self.model,
            choices=[self._choice(s) for s in out.outputs],
            usage=usage.info(),
            prompt_logprobs=prompt_logprobs(out.prompt_logprobs, self.fmt),
            prompt_token_ids=out.prompt_token_ids if self.req.return_token_ids else None,
        )

    def _choice(self, s: CompletionOutput) -> ChatCompletionResponseChoice:
        reasoned = self.reasoning.parse(s.text) if self.reasoning is not None else Reasoned(None, s.text)
        content, calls = reasoned.content, []
        if self.parse_tools:  # in the content only: a call while thinking is no call (vLLM's)
            parsed = parse_hermes(content or "")
            if parsed.tool_calls:
                # vLLM's: beside tool calls, content that is only whitespace is none.
                content, calls = parsed.content if parsed.content.strip() else None, parsed.tool_calls
        if self.req.echo:
            content = self.echoed + (content or "")
        reasoning = reasoned.reasoning if self.req.include_reasoning else None
        message = ChatResponseMessage(content=content, tool_calls=calls, reasoning=reasoning)
        return ChatCompletionResponseChoice(
            index=s.index,
            message=message,
            logprobs=self._logprobs(s),
            finish_reason=_finish_reason(s.finish_reason, calls),
            stop_reason=s.stop_reason,
            **self.weight_versions(s.index, s),
            routed_experts=routed_experts_field(s),
            token_ids=self._token_ids(s),
        )
