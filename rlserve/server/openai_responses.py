"""OpenAI's response shapes (and vLLM's and rlserve's fields on them): completions, chat completions, their
streamed chunks, usage and the model list."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from rlserve.server.chat_requests import ToolCall


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
    # A list in every vLLM release's model (0.23-0.33 checked), never null: a null fails their validation. Left out
    # of a chunk without calls, as vLLM 0.24+ serializes it.
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _without_empty_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


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
