"""OpenAI wire format: request and response models, and the conversions between them and rlserve's engine types.

No request field is dropped unread: each of vLLM's is implemented or, in `REFUSED_FIELDS`, refused with a 400
naming it and the reason unless it has its "off" value; a field neither vLLM nor rlserve knows is refused as unknown.
Wrong types are 400s too (the server's validation handler). Sampling values are checked by `SamplingParams` and the
engine; `APIError` carries their complaint to the client as OpenAI's error JSON, naming the field.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from rlserve.outputs import CompletionOutput, Logprob, PositionLogprobs, npy_bytes
from rlserve.sampling_params import RequestOutputKind, SamplingParams

# OpenAI's convention for a logprob of -inf (JSON has no infinity).
NEG_INF_LOGPROB = -9999.0

# Error types by status, as the OpenAI Python client names its exceptions.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",  # vLLM's type for a retryable refusal (a pause) and an unavailable engine
}


# ---- errors ----


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}` with HTTP status `code`."""

    def __init__(self, code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def response(self) -> ErrorResponse:
        info = ErrorInfo(
            message=self.message, type=ERROR_TYPES.get(self.code, "APIError"), param=self.param, code=self.code
        )
        return ErrorResponse(error=info)

    @classmethod
    def from_value_error(
        cls, exc: ValueError, fields: Collection[str], default: str | None, rename: Mapping[str, str] | None = None
    ) -> APIError:
        """400 for a ValueError from rlserve, whose messages start with the offending field ("temperature must ...",
        "prompt: ..."); `rename` maps engine names to this request's names (chat's top_logprobs)."""
        message = str(exc)
        match = re.match(r"(\w+)[: ]", message)
        param = match.group(1) if match and match.group(1) in fields else default
        if param is not None and rename and param in rename:
            param = rename[param]
        return cls(400, message, param)


# ---- requests ----


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The location ("messages.0.content") of the first string in `value` that is not Unicode text: a lone surrogate,
    which JSON's "\\ud800" escape makes. Tokenizers raise TypeError on such strings and UTF-8 cannot encode them."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "request body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = lone_surrogate_path(key, where) or lone_surrogate_path(item, where)
            if found:
                return found
    elif isinstance(value, list):
        # A list of numbers (token ids, up to millions of them) is not walked: a string among them fails the schema.
        if value and isinstance(value[0], int | float):
            return None
        for i, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


def _may_hold_lone_surrogate(value: Any) -> bool:
    """False when `value` is JSON whose strings are all Unicode text, found by msgspec's encoder (which refuses
    them) in a tenth of the time the walk of lone_surrogate_path takes over a large body; True when the walk must
    look (a lone surrogate, or objects the encoder does not know)."""
    try:
        msgspec.json.encode(value)
    except (UnicodeEncodeError, TypeError, ValueError, OverflowError):
        return True
    return False


class OpenAIBaseModel(BaseModel):
    # NaN and infinities (Python's JSON parser reads them) are no number a request can mean: a 400 naming the field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        """400 naming the field for a string that is not Unicode text; checked by the outermost model first, so the
        location is the whole path."""
        where = lone_surrogate_path(data) if _may_hold_lone_surrogate(data) else None
        if where is not None:
            top = where.split(".", 1)[0]
            raise APIError(400, f"{where}: holds a lone surrogate (\\ud800-\\udfff): not Unicode text", top)
        return data


@dataclass(frozen=True)
class Refused:
    reason: str
    off: tuple[Any, ...] = (None,)  # the values that ask for nothing: accepted, as no request for the feature


_TEXT_ONLY = "rlserve serves text-only models"
_NO_DISAGG = "rlserve has no disaggregated serving"
_NO_GUIDED = "rlserve has no guided (structured) decoding"
# vLLM 0.33's request fields that rlserve does not implement, on /v1/completions and /v1/chat/completions (a request
# model that declares one of these names implements it: chat's include_reasoning and reasoning_effort). Sent
# with an "off" value, a field is accepted; with any other, refused by name with the reason: a client must not get
# output that silently ignored its request.
REFUSED_FIELDS: dict[str, Refused] = {
    "user": Refused("rlserve keeps no per-user records (OpenAI's abuse-monitoring id); omit it"),
    "use_beam_search": Refused("beam search is not implemented", (None, False)),
    "length_penalty": Refused("beam search is not implemented", (None, 1.0)),
    "watermarking": Refused("watermarking is not implemented", (None, False)),
    "spaces_between_special_tokens": Refused("detokenization is not configurable in rlserve", (None, True)),
    "logprob_token_ids": Refused("logprobs of chosen token ids are not implemented; use logprobs / top_logprobs"),
    "prompt_embeds": Refused("prompt embeddings are not supported: send text or token ids"),
    "response_format": Refused(f"{_NO_GUIDED}: only {{'type': 'text'}}", (None, {"type": "text"})),
    "structured_outputs": Refused(_NO_GUIDED),
    "priority": Refused("rlserve has no priority scheduling (first come, first served): only 0", (None, 0)),
    "session_id": Refused("one engine per server: there is no session routing"),
    "return_token_offsets": Refused("token offsets are not returned", (None, False)),
    "return_prompt_text": Refused("not implemented: /v1/chat/completions/render returns the prompt", (None, False)),
    "mm_payload": Refused(_TEXT_ONLY, (None, "tensors")),
    "return_mm_kwargs": Refused(_TEXT_ONLY),
    "media_io_kwargs": Refused(_TEXT_ONLY),
    "mm_processor_kwargs": Refused(_TEXT_ONLY),
    "kv_transfer_params": Refused(_NO_DISAGG),
    "ec_transfer_params": Refused(_NO_DISAGG),
    "vllm_xargs": Refused("rlserve has no extensions that read request arguments"),
    "repetition_detection": Refused("repetition detection is not implemented"),
    "thinking_token_budget": Refused("thinking budgets are not implemented", (None, -1)),
    "reasoning_effort": Refused("it reaches the chat template: /v1/chat/completions only"),
    "include_reasoning": Refused("reasoning is parsed on /v1/chat/completions only", (None, True)),
    "parallel_tool_calls": Refused("every tool call the model makes is returned: only true", (None, True)),
    "stream_interval": Refused("rlserve streams every token: only 1", (None, 1)),
    # SGLang's fields, which vllm-router (0.1.17) adds to every completion and chat body it forwards, at these values
    "no_stop_trim": Refused("stop strings are trimmed unless include_stop_str_in_output: only false", (None, False)),
    "return_hidden_states": Refused("hidden states are not returned: only false", (None, False)),
    "separate_reasoning": Refused("reasoning is separated whenever --reasoning-parser is set: only true", (None, True)),
    "stream_reasoning": Refused("reasoning is streamed as it is generated: only true", (None, True)),
}


def _is_off(value: Any, off: Any) -> bool:
    if off is None or value is None:
        return value is off
    if isinstance(value, bool) or isinstance(off, bool):  # JSON's true is not 1
        return type(value) is type(off) and value == off
    return value == off


def _refuse_fields(model: type[BaseModel], data: Any) -> Any:
    """`data` without the fields of `REFUSED_FIELDS` that `model` lacks and that ask for nothing; 400 for the others."""
    if not isinstance(data, dict):
        return data
    refused = [name for name in data if name in REFUSED_FIELDS and name not in model.model_fields]
    for name in refused:
        entry, value = REFUSED_FIELDS[name], data[name]
        if not any(_is_off(value, off) for off in entry.off):
            raise APIError(400, f"{name}: {entry.reason} (got {value!r})", name)
    return {k: v for k, v in data.items() if k not in refused}


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


# Options rlserve does not implement, with the values that mean "off": any other value is refused rather than
# silently ignored (a client asking for penalties must not get unpenalized samples without knowing).
_ONLY_OFF: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}


class _GenerationRequest(OpenAIBaseModel):
    """Fields common to completions and chat: OpenAI's plus vLLM's sampling extras."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None  # OpenAI's keys are token ids as strings
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    best_of: int | None = None
    # vLLM's: keep only the prompt's last N tokens (-1: up to max_model_len), or its first N with truncation_side
    # "right".
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool  # whether the tokenizer adds its special tokens (BOS) to the prompt; defaults differ
    # The client's name for the request: /abort_requests takes it, and the engine's request ids derive from it.
    request_id: str | None = Field(default=None, min_length=1)
    # A prefix-cache namespace: requests with different salts never share cached blocks (vLLM's limits).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # vLLM's: each choice's weight_versions as spans [{version, start, end}] of its output tokens (in a stream, on the
    # choice's last chunk). Without it, no weight versions (vLLM's default).
    return_weight_versions: bool = False
    # rlserve's: each choice's token_weight_versions, the version of each of its tokens (in a stream, those of the
    # chunk's tokens); a separate field, so a client parsing weight_versions with vLLM's schema never sees strings.
    return_token_weight_versions: bool = False
    # vLLM's: with --enable-return-routed-experts, the prompt tokens whose routing each choice leaves out.
    routed_experts_prompt_start: int = Field(default=0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        return _refuse_fields(cls, data)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's tokens as `truncate_prompt_tokens` and `truncation_side` keep them."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == -1:
            keep = max_model_len
        elif keep > max_model_len:
            raise APIError(
                400,
                f"truncate_prompt_tokens: {keep} is more than the model's maximum context length ({max_model_len})",
                "truncate_prompt_tokens",
            )
        if len(token_ids) <= keep:
            return token_ids
        return token_ids[:keep] if self.truncation_side == "right" else token_ids[len(token_ids) - keep :]

    def check_supported(self) -> None:
        for name, off in _ONLY_OFF.items():
            value = getattr(self, name, None)
            if value not in off:
                raise APIError(400, f"{name}: not supported by rlserve (got {value!r})", name)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            routed_experts_prompt_start=self.routed_experts_prompt_start,
        )

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias: dict[int, float] = {}
        for token, value in self.logit_bias.items():
            try:
                bias[int(token)] = value
            except ValueError:
                raise APIError(400, f"logit_bias: keys must be token ids, got {token!r}", "logit_bias") from None
        return bias


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's default for completions
    # vLLM's: each choice starts with its prompt (completion_echo.py); with max_tokens 0, it is the prompt scored.
    echo: bool = False

    def sampling_params(self) -> SamplingParams:
        self.check_supported()
        if not self.echo:
            return self._sampling_params(self.max_tokens, self.logprobs)
        # vLLM's: the engine samples one token that the choice leaves out, and the prompt is scored at the logprobs
        # depth unless prompt_logprobs is given.
        params = self._sampling_params(1 if self.max_tokens == 0 else self.max_tokens, self.logprobs)
        if self.prompt_logprobs is None and self.logprobs is not None:
            params = replace(params, prompt_logprobs=self.logprobs)
        return params

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or token list, or a batch of them."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        if not p:
            raise APIError(400, "prompt: must not be empty", "prompt")
        return list(p)


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's)


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls, sent back in a multi-turn conversation
    tool_call_id: str | None = None  # a tool message's answer to that call
    # An assistant turn's reasoning, sent back (vLLM's name; `reasoning_content` its older one): templates that
    # render earlier thinking (Qwen3's) read it.
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The message's text: text content only."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise APIError(400, "messages: only text content parts are supported", "messages")
            content = "".join(part.text for part in content)
        return content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: its text, and its tool fields when it has them. A call's
        arguments reach the template as an object, as vLLM passes them (templates write them with `tojson`)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            if self.role != "assistant":
                raise APIError(400, f"messages: reasoning is for assistant turns, not {self.role!r} ones", "messages")
            # Under both names, as vLLM passes it: templates read one or the other.
            message["reasoning"] = message["reasoning_content"] = reasoning
        if self.tool_calls is not None:
            calls = []
            for call in self.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError as e:
                    raise APIError(400, f"messages: tool call arguments are not JSON: {e}", "messages") from e
                calls.append({**call.model_dump(), "function": {"name": call.function.name, "arguments": arguments}})
            message["tool_calls"] = calls
        return message


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: dict[str, Any]


# A chat's messages, at most this many: counted before any is validated (validating 200,000 held the event loop,
# which /health shares, for seconds). The context bounds them further before rendering (guards.py).
MAX_CHAT_MESSAGES = 16384


def _at_most_max_chat_messages(value: Any) -> Any:
    if isinstance(value, list) and len(value) > MAX_CHAT_MESSAGES:
        raise ValueError(f"at most {MAX_CHAT_MESSAGES} messages, got {len(value)}")
    return value


ChatMessages = Annotated[list[ChatMessage], BeforeValidator(_at_most_max_chat_messages)]


class ChatCompletionRequest(_GenerationRequest):
    messages: ChatMessages
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last message is left open for the model to continue (a prefilled turn); no generation prompt.
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's default for chat: the template places the special tokens
    chat_template: str | None = None  # this request's Jinja template, in place of the server's
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # for templates that render retrieved documents
    tools: list[Tool] | None = None
    # vLLM's default: "auto" when tools are sent, else "none".
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # vLLM's: the reply starts with the last message's content, when that message has the reply's role.
    echo: bool = False
    # vLLM's, with --reasoning-parser: false leaves the reasoning out of the reply (and the logprobs and token ids,
    # which would show it).
    include_reasoning: bool = True
    # vLLM's: passed to the chat template, which also gets enable_thinking (false for "none") unless the request's
    # chat_template_kwargs set it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        explicit_prompt = self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set
        if self.continue_final_message and explicit_prompt:
            raise APIError(
                400, "continue_final_message: cannot be used with add_generation_prompt=true", "continue_final_message"
            )
        if self.tools is not None and not self.tools:
            raise APIError(400, "tools: must not be empty; omit the field for no tools", "tools")
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        elif self.tool_choice != "none" and not self.tools:
            raise APIError(400, "tool_choice: needs tools", "tool_choice")
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            raise APIError(
                400,
                f"tool_choice: only 'auto' and 'none' are implemented: forcing a call needs guided decoding, which "
                f"rlserve has not (got {self.tool_choice!r})",
                "tool_choice",
            )
        return self

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and what reasoning_effort adds to them (vLLM's
        rules). The reasoning parser reads enable_thinking from them too."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        kwargs = {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}
        kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    @property
    def generation_prompt(self) -> bool:
        """Whether the template adds the assistant's header: not when continuing the final message."""
        return self.add_generation_prompt and not self.continue_final_message

    def echoed(self) -> str:
        """What echo prepends to each reply: the last message's text, when its role is the reply's (vLLM's rule)."""
        if not self.echo or not self.messages:
            return ""
        last = self.messages[-1]
        role = "assistant" if self.generation_prompt else last.role
        return last.text() if last.role == role else ""

    def sampling_params(self) -> SamplingParams:
        self.check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs)


# ---- responses ----


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class WeightVersionSpan(BaseModel):
    """vLLM's: output tokens [start, end) were sampled by the weights labelled `version`."""

    version: str
    start: int
    end: int


def weight_version_spans(versions: list[str]) -> list[WeightVersionSpan]:
    spans: list[WeightVersionSpan] = []
    for i, version in enumerate(versions):
        if spans and spans[-1].version == version:
            spans[-1].end = i + 1
        else:
            spans.append(WeightVersionSpan(version=version, start=i, end=i + 1))
    return spans


class _ChoiceExtras(BaseModel):
    """rlserve/vLLM extensions on every choice."""

    stop_reason: int | str | None = None
    # The weight versions that sampled the output, as the request asks: vLLM's spans (return_weight_versions) and
    # rlserve's version of each token (return_token_weight_versions): RL clients see which policy produced what.
    weight_versions: list[WeightVersionSpan] | None = None
    token_weight_versions: list[str] | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    # vLLM's: with --enable-return-routed-experts, on a finished choice, CompletionOutput.routed_experts as base64 of
    # its .npy bytes (np.load(io.BytesIO(base64.b64decode(s)))).
    routed_experts: str | None = None


def routed_experts_field(sample: CompletionOutput) -> str | None:
    """A choice's `routed_experts`: the sample's routed experts, base64 of their .npy bytes; None without them."""
    if sample.routed_experts is None:
        return None
    return base64.b64encode(npy_bytes(sample.routed_experts)).decode("ascii")


class CompletionResponseChoice(_ChoiceExtras):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class _CompletionBody(BaseModel):
    """OpenAI gives a completion and each chunk of a streamed one the same shape."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class CompletionResponse(_CompletionBody):
    pass


class CompletionStreamResponse(_CompletionBody):
    """One SSE chunk: a choice's new text, or (last, with include_usage) no choice and the usage."""


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatLogprobContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning: str | None = None  # with --reasoning-parser (vLLM's name; it no longer sends reasoning_content)


class ChatCompletionResponseChoice(_ChoiceExtras):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaToolCall(ToolCall):
    index: int  # the call's place among the choice's calls (OpenAI's streaming shape)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(_ChoiceExtras):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "rlserve"
    root: str
    parent: str | None = None  # an adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- engine outputs -> OpenAI shapes ----


def finite(logprob: float) -> float:
    return NEG_INF_LOGPROB if logprob == -math.inf else logprob


class TokenFormatter:
    """How tokens appear in logprobs: their text, or `token_id:N` with return_tokens_as_token_ids."""

    def __init__(self, as_token_ids: bool) -> None:
        self.as_token_ids = as_token_ids

    def __call__(self, token_id: int, logprob: Logprob) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        return logprob.decoded_token or ""


def prompt_logprobs(entries: list[PositionLogprobs | None] | None, fmt: TokenFormatter) -> PromptLogprobs | None:
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            tid: PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank, decoded_token=fmt(tid, lp))
            for tid, lp in entry.items()
        }
        for entry in entries
    ]


def completion_logprobs(
    token_ids: list[int],
    entries: list[PositionLogprobs | None],
    fmt: TokenFormatter,
    text_offset: int,
    decode: Callable[[int], str],
) -> tuple[CompletionLogProbs, int]:
    """OpenAI completions logprobs of `token_ids` (a sample's, or with echo the prompt's too), whose offsets count from
    `text_offset` (the text of earlier deltas); also returns the offset after the last token, where the next delta
    starts. A position without an entry (a prompt's first token) is unscored: its logprob and top logprobs are null and
    its text is `decode`d (vLLM's)."""
    out = CompletionLogProbs()
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            token = f"token_id:{token_id}" if fmt.as_token_ids else decode(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(text_offset)
            text_offset += len(decode(token_id))
            continue
        token = fmt(token_id, entry[token_id])
        out.tokens.append(token)
        out.token_logprobs.append(finite(entry[token_id].logprob))
        out.top_logprobs.append({fmt(tid, lp): finite(lp.logprob) for tid, lp in entry.items()})
        out.text_offset.append(text_offset)
        text_offset += len(entry[token_id].decoded_token or "")
    return out, text_offset


def _chat_top(token: str, logprob: float) -> ChatTopLogprob:
    return ChatTopLogprob(token=token, logprob=finite(logprob), bytes=list(token.encode("utf-8", errors="replace")))


def chat_logprobs(sample: CompletionOutput, fmt: TokenFormatter, top_k: int) -> ChatCompletionLogProbs:
    content = []
    for token_id, entry in zip(sample.token_ids, sample.logprobs or [], strict=True):
        chosen = entry[token_id]
        # The entry holds the top k plus the sampled token when it ranks lower: keep the k best, by rank.
        ranked = sorted(((lp.rank or 0, tid, lp) for tid, lp in entry.items() if lp.rank and lp.rank <= top_k))
        top = [_chat_top(fmt(tid, lp), lp.logprob) for _, tid, lp in ranked[:top_k]]
        item = _chat_top(fmt(token_id, chosen), chosen.logprob)
        content.append(ChatLogprobContent(**item.model_dump(), top_logprobs=top))
    return ChatCompletionLogProbs(content=content)
