"""The HTTP server: OpenAI-compatible completions and chat over an AsyncLLM, plus (opt-in) vLLM's RL control routes.

`build_app` only composes; the engine belongs to the caller (`rlserve serve` creates it, runs uvicorn, shuts it
down). Streams are Server-Sent Events with one chunk per new token of a choice; a client that goes away, streaming
or not, aborts its request so the engine stops spending steps on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import html
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import rlserve
from rlserve.engine.frontend.async_llm import (
    AsyncLLM,
    EngineDeadError,
    RequestIdInUseError,
    RequestRefusedError,
    RetryableRequestError,
)
from rlserve.engine.frontend.llm import PromptType, ValidatedPrompt, render_chat
from rlserve.engine.wire.messages import PAUSED_REFUSAL
from rlserve.lora import LoRARequest
from rlserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from rlserve.sampling_params import SamplingParams
from rlserve.server.access import PUBLIC_PATHS, AccessGuard, AccessPolicy, RendezvousHosts
from rlserve.server.completion_echo import CompletionEcho
from rlserve.server.defaults import ServingDefaults
from rlserve.server.framework_routes import (
    FRAMEWORK_PUBLIC_PATHS,
    FrameworkState,
    build_framework_router,
    build_skyrl_router,
)
from rlserve.server.generate_protocol import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamResponse,
    sampling_params_dict,
    sampling_params_from_dict,
    tokens_logprobs,
)
from rlserve.server.guards import (
    RequestGuard,
    check_chat_size,
    check_prompt_chars,
    check_sampling_limits,
    error_response,
)
from rlserve.server.lora_routes import LoRAAdapters, build_lora_router
from rlserve.server.metrics import ServerMetrics
from rlserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DeltaToolCall,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenFormatter,
    ToolCall,
    UsageInfo,
    _GenerationRequest,
    chat_logprobs,
    completion_logprobs,
    new_id,
    prompt_logprobs,
    routed_experts_field,
    weight_version_spans,
)
from rlserve.server.reasoning_parsers import (
    READS_SPECIAL_TOKENS,
    Reasoned,
    ReasoningParser,
    ReasoningStream,
    reasoning_parser,
)
from rlserve.server.rl_routes import build_rl_router
from rlserve.server.tool_parsers import StreamingToolCalls, parse_hermes
from rlserve.server.vllm_routes import build_vllm_router

logger = logging.getLogger(__name__)

T = TypeVar("T")
PositionLogprobsList = list[PositionLogprobs | None]

API_KEY_ENV = "RLSERVE_API_KEY"
RL_API_KEY_ENV = "RLSERVE_RL_API_KEY"
SESSION_HEADER = "X-Session-ID"  # vLLM's (and vllm-router's) session affinity
# Names a ValueError from SamplingParams or the engine may start with (see APIError.from_value_error).
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__) | {"prompt", "prompt_token_ids"}


# JSON may hold U+0085, U+2028 and U+2029 raw, and clients that split lines as str.splitlines does (httpx's
# aiter_lines) would cut an event there: escaped, every event is one line.
_LINE_BREAKS = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def _sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    if not data.isascii():  # rare characters, sought with `in` (a C scan) rather than a per-character translate
        for raw, escaped in _LINE_BREAKS:
            if raw in data:
                data = data.replace(raw, escaped)
    return f"data: {data}\n\n"


def _id_conflict(error: RequestIdInUseError) -> APIError:
    return APIError(409, f"{error} (the engine still ends an earlier request of that id)", "request_id")


class _Usage:
    """Token counts of one API request, summed over its prompts and choices."""

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def add(self, index: int, out: RequestOutput) -> None:
        self.prompt_tokens[index] = len(out.prompt_token_ids)
        self.cached_tokens[index] = out.num_cached_tokens
        self.completion_tokens += sum(len(s.token_ids) for s in out.outputs)

    def info(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())),
        )


def _finish_reason(engine_reason: str | None, tool_calls: Sequence[ToolCall]) -> str | None:
    """vLLM's: "tool_calls" when the model stopped by itself after calling tools (a length cut stays visible)."""
    return "tool_calls" if tool_calls and engine_reason == "stop" else engine_reason


class _WeightVersions:
    """Each choice's weight-version fields as the request asks: vLLM's `weight_versions`, spans over all its tokens
    on its last chunk, and rlserve's `token_weight_versions`, the version of each token of the chunk."""

    def __init__(self, spans: bool, per_token: bool) -> None:
        self.spans = spans
        self.per_token = per_token
        self.seen: dict[int, list[str]] = {}

    @classmethod
    def of(cls, req: _GenerationRequest) -> _WeightVersions:
        return cls(req.return_weight_versions, req.return_token_weight_versions)

    def __call__(self, index: int, sample: CompletionOutput) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.per_token:
            fields["token_weight_versions"] = sample.weight_versions
        if self.spans:
            versions = self.seen.setdefault(index, [])
            versions += sample.weight_versions or []
            if sample.finish_reason is not None:
                fields["weight_versions"] = weight_version_spans(versions)
        return fields


async def _cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine requests) and return None."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Cancellation completes only when the task next runs; wait for it so its result is readable.
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses and chunks."""

    def __init__(self, engine: AsyncLLM, model_names: Sequence[str], defaults: ServingDefaults) -> None:
        self.engine = engine
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]  # responses name the first, as vLLM's (or the adapter asked for)
        self.adapters = LoRAAdapters(engine, self.model_names)
        self.defaults = defaults
        # In-flight API requests: response id -> engine request ids (POST /abort_requests reads it).
        self.active: dict[str, list[str]] = {}
        # Tokenizing and chat templates run here, not on the event loop, which every stream and /health share: a
        # long prompt takes the tokenizer seconds. One thread: HF tokenizers are not safe to call from several.
        self._prompt_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlserve-prompts")

    async def off_loop(self, work: Callable[[], T]) -> T:
        """`work()` (prompt preparation: tokenizing, rendering, validating) on the prompt thread."""
        return await asyncio.get_running_loop().run_in_executor(self._prompt_thread, work)

    # ---- shared ----

    def _claim(self, key: str) -> None:
        # The engine holds an id a little past its stream's end: until the core has ended an aborted request, whose
        # late outputs would otherwise reach a new request of the same id.
        if key in self.active or self.engine.request_in_use(key):
            raise APIError(409, f"request_id: {key!r} is already in flight", "request_id")

    def _request_ids(self, req: _GenerationRequest, prefix: str) -> tuple[str, str]:
        """(the response's id, the request's key): the client's request_id when it sends one (the response id is
        vLLM's `{prefix}-{request_id}`), which /abort_requests takes and the engine's request ids derive from."""
        if req.request_id is None:
            response_id = new_id(prefix)
            return response_id, response_id
        self._claim(req.request_id)
        return f"{prefix}-{req.request_id}", req.request_id

    def _tokenized(self, req: _GenerationRequest, text: str | None, token_ids: list[int]) -> dict[str, Any]:
        """An engine prompt of `token_ids` (tokenized from `text`, if any), truncated as the request asks, with its
        cache salt."""
        truncated = req.truncate(token_ids, self.engine.max_model_len)
        prompt: dict[str, Any] = {"prompt_token_ids": truncated, "cache_salt": req.cache_salt}
        if text is not None and truncated is token_ids:  # a cut prompt's text is no longer the request's
            prompt["prompt"] = text
        return prompt

    def _completion_prompts(self, req: CompletionRequest) -> list[PromptType]:
        prompts: list[PromptType] = []
        for p in req.prompts():
            if isinstance(p, str):
                check_prompt_chars(p, self.engine.max_model_len, "prompt")
                ids = self.engine.tokenizer(p, add_special_tokens=req.add_special_tokens).input_ids
                prompts.append(self._tokenized(req, p, ids))
            else:
                prompts.append(self._tokenized(req, None, p))
        return prompts

    def _check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a name not served."""
        return self.adapters.resolve(model)

    def _validate(
        self,
        prompts: list[PromptType],
        params: SamplingParams,
        rename: Mapping[str, str],
        lora_request: LoRARequest | None = None,
    ) -> list[ValidatedPrompt]:
        """Refuse a bad request before any of its prompts reaches the engine (and before a stream starts). Each
        validated prompt carries the adapter it runs with to the engine."""
        max_model_len = self.engine.max_model_len
        try:
            check_sampling_limits(params, len(prompts))
        except ValueError as e:
            raise APIError.from_value_error(e, _SAMPLING_FIELDS, None, rename) from e
        validated = []
        for prompt in prompts:
            try:
                checked = self.engine.validate_prompt(prompt, params, lora_request)
            except ValueError as e:
                raise APIError.from_value_error(e, _SAMPLING_FIELDS, None, rename) from e
            # The engine would silently cut such a request short; OpenAI and vLLM refuse it.
            if params.max_tokens is not None and len(checked.token_ids) + params.max_tokens > max_model_len:
                param = rename.get("max_tokens", "max_tokens")
                raise APIError(
                    400,
                    f"{param}: this model's maximum context length is {max_model_len} tokens, but "
                    f"{len(checked.token_ids)} prompt tokens + {params.max_tokens} completion tokens were requested",
                    param,
                )
            validated.append(checked)
        return validated

    def _check_serving(self) -> None:
        """A 503 before a stream starts when the core is known to refuse generation (it refuses each request too:
        this is what lets a streaming client get the status rather than an error event)."""
        not_serving = self.engine.not_serving
        if not_serving is not None:
            raise APIError(503, f"generation refused: {not_serving}")
        if self.engine.rejecting_new_requests:
            raise APIError(503, PAUSED_REFUSAL)

    async def _generate(
        self, request_id: str, prompts: list[ValidatedPrompt], raw: Request, streaming: bool = False
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The engine outputs of every prompt of one API request, tagged with the prompt's index. `X-Session-ID`
        (vLLM's routing affinity) sends a session's requests to one data-parallel rank, whose prefix cache holds
        the earlier turns. `streaming`: the response has begun, so a prompt that an abort pause refused on its way
        to the core (it was accepted before the pause) ends as the pause ended the others, with finish_reason
        "abort", rather than with a retryable error that a begun stream can only carry as an error event."""
        session_id = raw.headers.get(SESSION_HEADER)
        self._claim(request_id)  # again: another request may have taken the id since this one was checked
        if len(prompts) == 1:
            self.active[request_id] = [request_id]
            try:
                async with aclosing(
                    self.engine.generate(prompts[0], request_id=request_id, session_id=session_id)
                ) as outputs:
                    async for out in outputs:
                        yield 0, out
            except RetryableRequestError as e:
                if not streaming or e.final_output is None:
                    raise
                yield 0, e.final_output
            except RequestIdInUseError as e:  # one of its n samples' ids, which the core still holds
                raise _id_conflict(e) from e
            finally:
                self.active.pop(request_id, None)
            return
        engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.active[request_id] = engine_ids
        queue: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async with aclosing(
                    self.engine.generate(prompts[i], request_id=engine_ids[i], session_id=session_id)
                ) as outputs:
                    async for out in outputs:
                        queue.put_nowait((i, out, None))
            except RetryableRequestError as e:
                ended = streaming and e.final_output is not None
                queue.put_nowait((i, e.final_output, None) if ended else (i, None, e))
            except Exception as e:
                queue.put_nowait((i, None, e))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
        try:
            remaining = len(prompts)
            while remaining:
                i, out, error = await queue.get()
                if isinstance(error, RequestIdInUseError):
                    raise _id_conflict(error) from error
                if error is not None:
                    raise error
                yield i, out
                remaining -= out.finished
        finally:
            # Cancelling a pump closes its engine stream, which aborts what is left of that prompt.
            for task in tasks:
                task.cancel()
            self.active.pop(request_id, None)

    async def _final_outputs(
        self, request_id: str, prompts: list[ValidatedPrompt], raw: Request
    ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async with aclosing(self._generate(request_id, prompts, raw)) as outputs:
            async for i, out in outputs:
                finals[i] = out
        return finals

    async def _stream(
        self,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        n: int,
        include_usage: bool,
        make_chunk: Callable[[int, RequestOutput, CompletionOutput, bool, PositionLogprobsList | None], BaseModel],
        make_usage_chunk: Callable[[UsageInfo], BaseModel],
        preamble: list[BaseModel],
    ) -> AsyncIterator[str]:
        """SSE: one chunk per choice per engine delta, `finish_reason` on each choice's last, then usage and [DONE].

        `make_chunk(index, output, sample, first, prompt_logprobs)`: `first` marks the choice's first chunk, which
        also gets the prompt's logprobs (if requested).
        """
        usage = _Usage()
        # DELTA outputs carry prompt logprobs once, in the prompt's first output, which may hold no token yet.
        prompt_lps: dict[int, PositionLogprobsList] = {}
        started: set[int] = set()
        finished: set[int] = set()
        try:
            for chunk in preamble:
                yield _sse(chunk)
            async with aclosing(outputs) as stream:
                async for i, out in stream:
                    usage.add(i, out)
                    if out.prompt_logprobs is not None:
                        prompt_lps.setdefault(i, out.prompt_logprobs)
                    for sample in out.outputs:
                        index = i * n + sample.index
                        if index in finished or not (sample.token_ids or sample.text or sample.finish_reason):
                            continue
                        first = index not in started
                        started.add(index)
                        yield _sse(make_chunk(index, out, sample, first, prompt_lps.get(i) if first else None))
                        if sample.finish_reason is not None:
                            finished.add(index)
            if include_usage:
                yield _sse(make_usage_chunk(usage.info()))
        except APIError as e:
            yield _sse(e.response())
        except EngineDeadError as e:
            yield _sse(APIError(503, f"the engine is gone: {e}").response())
        except RequestRefusedError as e:
            yield _sse(APIError(503, str(e)).response())
        except Exception as e:
            logger.exception("stream failed")
            yield _sse(APIError(500, f"generation failed: {e}").response())
        yield _sse("[DONE]")

    # ---- /v1/completions ----

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        lora = self._check_model(req.model)
        model = self.model_name if lora is None else lora.lora_name
        rename = {"prompt_token_ids": "prompt"}
        try:
            params = self.defaults.apply(req, req.sampling_params())
        except ValueError as e:
            raise APIError.from_value_error(e, _SAMPLING_FIELDS, "prompt", rename) from e
        prompts = await self.off_loop(lambda: self._validate(self._completion_prompts(req), params, rename, lora))
        self._check_serving()
        response_id, request_id = self._request_ids(req, "cmpl")
        fmt = TokenFormatter(self.defaults.tokens_as_token_ids(req))
        weight_versions = _WeightVersions.of(req)
        n = params.n
        tokenizer = self.engine.tokenizer
        echo = CompletionEcho(req.echo, req.max_tokens == 0, not req.return_token_ids, tokenizer.decode)

        def decode(token_id: int) -> str:
            return tokenizer.decode([token_id])

        if req.stream:
            text_offsets: dict[int, int] = {}

            def chunk(
                index: int,
                out: RequestOutput,
                s: CompletionOutput,
                first: bool,
                prompt_lps: PositionLogprobsList | None,
            ) -> BaseModel:
                content = echo.content(out, s, first, prompt_lps)
                logprobs = None
                if content.logprobs is not None:
                    logprobs, text_offsets[index] = completion_logprobs(
                        content.token_ids, content.logprobs, fmt, text_offsets.get(index, 0), decode
                    )
                choice = CompletionResponseChoice(
                    index=index,
                    text=content.text,
                    logprobs=logprobs,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    **weight_versions(index, s),
                    routed_experts=routed_experts_field(s),
                    token_ids=s.token_ids if req.return_token_ids else None,
                    prompt_logprobs=prompt_logprobs(prompt_lps, fmt),
                    prompt_token_ids=out.prompt_token_ids if first and req.return_token_ids else None,
                )
                return CompletionStreamResponse(id=response_id, model=model, choices=[choice])

            def usage_chunk(usage: UsageInfo) -> BaseModel:
                return CompletionStreamResponse(id=response_id, model=model, choices=[], usage=usage)

            outputs = self._generate(request_id, prompts, raw, streaming=True)
            body = self._stream(outputs, n, req.include_usage, chunk, usage_chunk, [])
            return StreamingResponse(body, media_type="text/event-stream")

        finals = await _cancel_on_disconnect(raw, self._final_outputs(request_id, prompts, raw))
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        usage = _Usage()
        choices = []
        for i, out in enumerate(finals):
            usage.add(i, out)
            for s in out.outputs:
                content = echo.content(out, s, True, out.prompt_logprobs)
                choices.append(
                    CompletionResponseChoice(
                        index=i * n + s.index,
                        text=content.text,
                        logprobs=None
                        if content.logprobs is None
                        else completion_logprobs(content.token_ids, content.logprobs, fmt, 0, decode)[0],
                        finish_reason=s.finish_reason,
                        stop_reason=s.stop_reason,
                        **weight_versions(i * n + s.index, s),
                        routed_experts=routed_experts_field(s),
                        token_ids=s.token_ids if req.return_token_ids else None,
                        prompt_logprobs=prompt_logprobs(out.prompt_logprobs, fmt),
                        prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None,
                    )
                )
        response = CompletionResponse(id=response_id, model=model, choices=choices, usage=usage.info())
        return Response(response.model_dump_json(), media_type="application/json")

    # ---- /v1/chat/completions ----

    def _chat_prompt(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """The engine prompt of a chat request (blocking: call it off the event loop)."""
        if req.chat_template is not None and not self.defaults.trust_request_chat_template:
            # vLLM's rule: a template is code the server runs (Jinja loops can spin for hours), so only a server
            # that trusts its clients lets them send one.
            raise APIError(
                400,
                "chat_template: a request's own chat template needs the server started with "
                "--trust-request-chat-template",
                "chat_template",
            )
        tokenizer = self.engine.tokenizer
        check_chat_size(req.messages, self.engine.max_model_len)
        try:
            text = render_chat(
                tokenizer,
                [m.template_dict() for m in req.messages],
                chat_template=req.chat_template or self.defaults.chat_template,
                add_generation_prompt=req.generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools],
                documents=req.documents,
                chat_template_kwargs=req.template_kwargs(),
            )
        except ValueError as e:
            raise APIError.from_value_error(e, {"messages", "chat_template_kwargs"}, "messages") from e
        check_prompt_chars(text, self.engine.max_model_len, "messages")
        # By default (vLLM's for chat) the template alone places the special tokens: none are added a second time.
        return self._tokenized(req, text, tokenizer(text, add_special_tokens=req.add_special_tokens).input_ids)

    def _parses_tool_calls(self, req: ChatCompletionRequest) -> bool:
        """Whether the output is parsed for tool calls: tools offered with tool_choice "auto", which needs the
        server's --enable-auto-tool-choice (vLLM's rule)."""
        if not req.tools or req.tool_choice != "auto":
            return False
        if not self.defaults.enable_auto_tool_choice:
            raise APIError(
                400,
                'tool_choice: "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser',
                "tool_choice",
            )
        return True

    def _reasoning_parser(self, req: ChatCompletionRequest, prompt: ValidatedPrompt) -> ReasoningParser | None:
        """The request's --reasoning-parser, which reads its chat template kwargs and whether its prompt has closed
        the thinking already; None without the flag. Blocking (it may decode the prompt): call it off the loop."""
        name = self.defaults.reasoning_parser
        if name is None:
            return None
        text = prompt.text if prompt.text is not None else self.engine.tokenizer.decode(prompt.token_ids)
        return reasoning_parser(name, req.template_kwargs(), text)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        lora = self._check_model(req.model)
        model = self.model_name if lora is None else lora.lora_name
        rename = {"logprobs": "top_logprobs", "prompt": "messages", "prompt_token_ids": "messages"}
        if req.max_completion_tokens is not None:
            rename["max_tokens"] = "max_completion_tokens"
        try:
            params = self.defaults.apply(req, req.sampling_params())
        except ValueError as e:
            raise APIError.from_value_error(e, _SAMPLING_FIELDS, None, rename) from e
        parse_tools = self._parses_tool_calls(req)
        name = self.defaults.reasoning_parser
        if (parse_tools or name in READS_SPECIAL_TOKENS) and "skip_special_tokens" not in req.model_fields_set:
            # vLLM's: a model's tool-call (or thinking) tags may be special tokens, which the parser must see.
            params = dataclasses.replace(params, skip_special_tokens=False)

        def prepare() -> tuple[list[ValidatedPrompt], ReasoningParser | None]:
            validated = self._validate([self._chat_prompt(req)], params, rename, lora)
            return validated, self._reasoning_parser(req, validated[0])

        prompts, reasoning = await self.off_loop(prepare)
        self._check_serving()
        response_id, request_id = self._request_ids(req, "chatcmpl")
        fmt = TokenFormatter(self.defaults.tokens_as_token_ids(req))
        weight_versions = _WeightVersions.of(req)
        echoed = req.echoed()
        top_k = params.logprobs or 0
        # vLLM's: a reply without its reasoning has no logprobs or token ids either (they would show it), on a
        # server that parses output.
        hidden = not req.include_reasoning and (name is not None or self.defaults.enable_auto_tool_choice)

        def logprobs(s: CompletionOutput) -> Any:
            return None if s.logprobs is None or hidden else chat_logprobs(s, fmt, top_k)

        def token_ids(s: CompletionOutput) -> list[int] | None:
            return s.token_ids if req.return_token_ids and not hidden else None

        if req.stream:
            reasoning_streams: dict[int, ReasoningStream] = {}
            tool_streams: dict[int, StreamingToolCalls] = {}

            def chunk(
                index: int,
                out: RequestOutput,
                s: CompletionOutput,
                first: bool,
                prompt_lps: PositionLogprobsList | None,
            ) -> BaseModel:
                finish_reason, finished = s.finish_reason, s.finish_reason is not None
                thought, content = "", s.text
                if reasoning is not None:
                    thinking = reasoning_streams.setdefault(index, reasoning.stream())
                    thought, content = thinking.feed(s.text)
                    if finished:
                        rest_thought, rest_content = thinking.finish()
                        thought, content = thought + rest_thought, content + rest_content
                delta = DeltaMessage(reasoning=thought if thought and req.include_reasoning else None)
                if parse_tools:  # in the content only: a call while thinking is no call (vLLM's)
                    tools = tool_streams.setdefault(index, StreamingToolCalls())
                    content = tools.feed(content)
                    if finished:
                        parsed = tools.finish()
                        content += parsed.content
                        calls = [DeltaToolCall(index=k, **c.model_dump()) for k, c in enumerate(parsed.tool_calls)]
                        delta.tool_calls = calls or None
                        finish_reason = _finish_reason(s.finish_reason, parsed.tool_calls)
                delta.content = content if content or delta.reasoning is None else None
                choice = ChatCompletionStreamChoice(
                    index=index,
                    delta=delta,
                    logprobs=logprobs(s),
                    finish_reason=finish_reason,
                    stop_reason=s.stop_reason,
                    **weight_versions(index, s),
                    routed_experts=routed_experts_field(s),
                    token_ids=token_ids(s),
                )
                # Chat has the prompt's logprobs at the top level: sent once, with the first choice's first chunk.
                top_level = prompt_logprobs(prompt_lps, fmt) if index == 0 else None
                return ChatCompletionStreamResponse(
                    id=response_id, model=model, choices=[choice], prompt_logprobs=top_level
                )

            def usage_chunk(usage: UsageInfo) -> BaseModel:
                return ChatCompletionStreamResponse(id=response_id, model=model, choices=[], usage=usage)

            def preamble(delta: DeltaMessage, i: int) -> BaseModel:
                choice = ChatCompletionStreamChoice(index=i, delta=delta)
                return ChatCompletionStreamResponse(id=response_id, model=model, choices=[choice])

            # Each choice's role, then (echo) the text its reply continues, as vLLM streams them.
            first_chunks = [preamble(DeltaMessage(role="assistant", content=""), i) for i in range(params.n)]
            if echoed:
                first_chunks += [preamble(DeltaMessage(content=echoed), i) for i in range(params.n)]
            outputs = self._generate(request_id, prompts, raw, streaming=True)
            body = self._stream(outputs, params.n, req.include_usage, chunk, usage_chunk, first_chunks)
            return StreamingResponse(body, media_type="text/event-stream")

        finals = await _cancel_on_disconnect(raw, self._final_outputs(request_id, prompts, raw))
        if finals is None:
            return Response(status_code=499)
        (out,) = finals
        usage = _Usage()
        usage.add(0, out)
        choices = []
        for s in out.outputs:
            reasoned = reasoning.parse(s.text) if reasoning is not None else Reasoned(None, s.text)
            content, calls = reasoned.content, []
            if parse_tools:  # in the content only: a call while thinking is no call (vLLM's)
                parsed = parse_hermes(content or "")
                if parsed.tool_calls:
                    # vLLM's: beside tool calls, content that is only whitespace is none.
                    content, calls = parsed.content if parsed.content.strip() else None, parsed.tool_calls
            if req.echo:
                content = echoed + (content or "")
            message = ChatResponseMessage(
                content=content, tool_calls=calls, reasoning=reasoned.reasoning if req.include_reasoning else None
            )
            choices.append(
                ChatCompletionResponseChoice(
                    index=s.index,
                    message=message,
                    logprobs=logprobs(s),
                    finish_reason=_finish_reason(s.finish_reason, calls),
                    stop_reason=s.stop_reason,
                    **weight_versions(s.index, s),
                    routed_experts=routed_experts_field(s),
                    token_ids=token_ids(s),
                )
            )
        response = ChatCompletionResponse(
            id=response_id,
            model=model,
            choices=choices,
            usage=usage.info(),
            prompt_logprobs=prompt_logprobs(out.prompt_logprobs, fmt),
            prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None,
        )
        return Response(response.model_dump_json(), media_type="application/json")

    # ---- /inference/v1/generate (vLLM's token-in/token-out route) ----

    async def generate_tokens(self, req: GenerateRequest, raw: Request) -> Response:
        """Token ids in, token ids (and logprobs with integer token ids) out. The client's `request_id` names the
        request for /abort_requests."""
        lora = self._check_model(req.model)
        model = self.model_name if lora is None else lora.lora_name
        params = sampling_params_from_dict(req.sampling_params, req.stream)
        rename = {name: f"sampling_params.{name}" for name in SamplingParams.__dataclass_fields__}
        rename |= {"prompt": "token_ids", "prompt_token_ids": "token_ids"}
        prompt = {"prompt_token_ids": req.token_ids, "cache_salt": req.cache_salt}
        prompts = await self.off_loop(lambda: self._validate([prompt], params, rename, lora))
        self._check_serving()
        request_id = req.request_id or new_id("generate")
        self._claim(request_id)
        # vLLM's generate route sends the spans on every finished choice, unasked.
        weight_versions = _WeightVersions(spans=True, per_token=req.return_token_weight_versions)

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

            body = self._stream(
                self._generate(request_id, prompts, raw, streaming=True),
                params.n,
                req.include_usage,
                chunk,
                usage_chunk,
                [],
            )
            return StreamingResponse(body, media_type="text/event-stream")

        finals = await _cancel_on_disconnect(raw, self._final_outputs(request_id, prompts, raw))
        if finals is None:
            return Response(status_code=499)
        (out,) = finals
        usage = _Usage()
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

    # ---- /v1/completions/render, /v1/chat/completions/render ----

    def _render(
        self,
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
            raise APIError.from_value_error(e, _SAMPLING_FIELDS, None, rename) from e
        (checked,) = self._validate([prompt], params, rename)
        return {
            "request_id": request_id,
            "token_ids": checked.token_ids,
            "sampling_params": sampling_params_dict(checked.params),
            "model": req.model,
            "stream": req.stream,
            "return_token_ids": req.return_token_ids,
            "cache_salt": checked.cache_salt,
        }

    async def render_completion(self, req: CompletionRequest) -> list[dict]:
        self._check_model(req.model)

        def render() -> list[dict]:
            prompts = self._completion_prompts(req)
            base = new_id("cmpl")
            ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
            rename = {"prompt_token_ids": "prompt"}
            return [self._render(rid, req, p, rename) for rid, p in zip(ids, prompts, strict=True)]

        return await self.off_loop(render)

    async def render_chat(self, req: ChatCompletionRequest) -> dict:
        """vLLM's GenerateRequest, plus `prompt`: the text the chat template made (rlserve's); of a truncated
        prompt, the text of the tokens kept."""
        self._check_model(req.model)
        rename = {"logprobs": "top_logprobs", "prompt": "messages", "prompt_token_ids": "messages"}
        if req.max_completion_tokens is not None:
            rename["max_tokens"] = "max_completion_tokens"

        def render() -> dict:
            prompt = self._chat_prompt(req)
            text = prompt.get("prompt") or self.engine.tokenizer.decode(prompt["prompt_token_ids"])
            return {**self._render(new_id("chatcmpl"), req, prompt, rename), "prompt": text}

        return await self.off_loop(render)


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

    @app.get("/health")
    @app.get("/health/", include_in_schema=False)  # TRL's spelling: answered here, not with a redirect
    async def health() -> Response:
        # A failed engine step leaves the engine refusing work: say so, so orchestrators restart it. Weights
        # missing (sleep level 2, an abandoned update) refuse generation too, until an update: 503 with the reason.
        if engine.error is not None:
            return Response(status_code=503)
        not_serving = engine.not_serving
        if not_serving is not None:
            return error_response(APIError(503, f"generation refused: {not_serving}"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": rlserve.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = await metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", responses=errors)
    async def models() -> ModelList:
        base = [ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len) for name in model_names]
        return ModelList(data=base + serving.adapters.cards(engine.max_model_len))

    @app.post("/v1/completions", responses=errors)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions", responses=errors)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(req, raw)

    vllm_router = build_vllm_router(serving)
    lora_router = build_lora_router(serving.adapters, allowed_weight_dirs, runtime_lora_updating)
    skyrl_router = build_skyrl_router(serving, allowed_weight_dirs, runtime_lora_updating)
    for router in (vllm_router, lora_router, skyrl_router):
        app.include_router(router, responses=errors)
    app.state.lora_adapters = serving.adapters  # the server loads --lora-modules through it before serving
    rl_paths: frozenset[str] = frozenset()
    if enable_rl_api:
        rendezvous_hosts = RendezvousHosts.allow(allowed_rendezvous_hosts, bound_host)
        frameworks = app.state.frameworks = FrameworkState()
        rl_router = build_rl_router(engine, serving.active, metrics, allowed_weight_dirs, rendezvous_hosts, frameworks)
        app.include_router(rl_router, responses=errors)
        framework_router = build_framework_router(
            engine, serving.adapters, metrics, frameworks, allowed_weight_dirs, rendezvous_hosts
        )
        app.include_router(framework_router, responses=errors)
        rl_routes = [*rl_router.routes, *framework_router.routes]
        rl_paths = frozenset(route.path for route in rl_routes) - FRAMEWORK_PUBLIC_PATHS
    _add_docs_page(app)
    # Outermost: a refused caller costs no body reading, no parsing, no route.
    # Paths from each router itself: FastAPI 0.16x nests an included router's routes instead of copying them.
    routes = [*app.routes, *vllm_router.routes, *lora_router.routes, *skyrl_router.routes]
    api_paths = frozenset(route.path for route in routes if hasattr(route, "path")) - rl_paths - PUBLIC_PATHS
    app.add_middleware(AccessGuard, policy=AccessPolicy(api_keys, rl_keys, api_paths, rl_paths, bound_host))
    return app


def _keys(given: str | Sequence[str] | None) -> tuple[str, ...]:
    return (given,) if isinstance(given, str) else tuple(given or ())


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
