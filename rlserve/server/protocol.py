"""OpenAI wire format: request and response models, and the conversions between them and rlserve's engine types.

Requests ignore unknown fields (OpenAI clients send extras) but reject fields of the wrong type (FastAPI answers
422). Sampling values are checked by `SamplingParams` and the engine; `APIError` carries their complaint to the
client as OpenAI's error JSON, naming the field.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Collection, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlserve.outputs import CompletionOutput, Logprob, PositionLogprobs
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


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


# Options rlserve does not implement, with the values that mean "off": any other value is refused rather than
# silently ignored (a client asking for penalties must not get unpenalized samples without knowing).
_ONLY_OFF: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

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
    echo: bool = False
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        self.check_supported()
        return self._sampling_params(self.max_tokens, self.logprobs)

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


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None

    def template_dict(self) -> dict[str, str]:
        """The message as chat templates expect it: text content only."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise APIError(400, "messages: only text content parts are supported", "messages")
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

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


class _ChoiceExtras(BaseModel):
    """rlserve/vLLM extensions on every choice."""

    stop_reason: int | str | None = None
    # The weight version that sampled each output token (rlserve): RL clients see which policy produced what.
    weight_versions: list[str] | None = None
    token_ids: list[int] | None = None  # with return_token_ids


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


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


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
    sample: CompletionOutput, fmt: TokenFormatter, text_offset: int
) -> tuple[CompletionLogProbs, int]:
    """OpenAI completions logprobs of the sample's tokens, whose offsets count from `text_offset` (the text of earlier
    deltas); also returns the offset after the last token, where the next delta starts."""
    out = CompletionLogProbs()
    for token_id, entry in zip(sample.token_ids, sample.logprobs or [], strict=True):
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
