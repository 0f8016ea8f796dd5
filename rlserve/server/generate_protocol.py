"""vLLM's token-in/token-out wire format (`POST /inference/v1/generate`, and the `/v1/*/render` routes that produce
its requests): token ids in, token ids and logprobs with integer token ids out.

Every bad input (malformed JSON, a wrong type, an unknown field, a bad sampling value) is a 400 naming the field, as
the OpenAI SDK's `BadRequestError` expects: from the server's validation handler, or `parse_body` where a route
parses a body itself.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from rlserve.outputs import CompletionOutput
from rlserve.sampling_params import RequestOutputKind, SamplingParams
from rlserve.server.protocol import (
    _ONLY_OFF,
    APIError,
    OpenAIBaseModel,
    PromptLogprobs,
    StreamOptions,
    UsageInfo,
    _ChoiceExtras,
    finite,
    now,
)

M = TypeVar("M", bound=BaseModel)

# The server decides how outputs are delivered (stream or not); the engine's extras and the bad words' token ids (the
# tokenizer's) are not a client's to set.
_SERVER_SET = frozenset({"output_kind", "extra_args", "_bad_words_token_ids"})
SAMPLING_KEYS = frozenset(SamplingParams.__dataclass_fields__) - _SERVER_SET
_SAMPLING_ADAPTER = TypeAdapter(SamplingParams)  # non-finite floats: SamplingParams refuses them itself


def validation_error(exc: ValidationError, prefix: str = "") -> APIError:
    """A 400 naming the first bad field (`prefix` + its top-level name), or, for a check across fields (a value
    error from SamplingParams.__post_init__), the field its message starts with."""
    first = exc.errors()[0]
    loc = first.get("loc", ())
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if loc:
        name = str(loc[0])
    else:
        match = re.match(r"(\w+)[: ]", message)
        name = match.group(1) if match else None
    param = f"{prefix}{name}" if name else None
    return APIError(400, f"{param or 'request body'}: {message}", param)


def parse_body(body: dict[str, Any], model: type[M]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from e


def sampling_params_from_dict(fields: dict[str, Any], stream: bool) -> SamplingParams:
    """vLLM's `sampling_params` object as rlserve's SamplingParams, checked as the OpenAI routes check theirs.

    A field rlserve lacks is refused by name, except vLLM's options of the OpenAI routes at their "off" values. An
    absent `max_tokens` means "up to max_model_len", as vLLM's generate route defaults it (not SamplingParams' 16).
    """
    fields = dict(fields)
    for name, value in list(fields.items()):
        if name in SAMPLING_KEYS:
            continue
        param = f"sampling_params.{name}"
        if name in _ONLY_OFF and value in _ONLY_OFF[name]:
            del fields[name]
            continue
        reason = f"not supported by rlserve (got {value!r})" if name in _ONLY_OFF else "unknown sampling parameter"
        raise APIError(400, f"{param}: {reason}", param)
    fields.setdefault("max_tokens", None)
    fields["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return _SAMPLING_ADAPTER.validate_python(fields)
    except ValidationError as e:
        raise validation_error(e, "sampling_params.") from e


def sampling_params_dict(params: SamplingParams) -> dict[str, Any]:
    """The client-settable fields of `params`, as `sampling_params_from_dict` reads them back (for /render)."""
    return {k: v for k, v in asdict(params).items() if k in SAMPLING_KEYS}


class _StrictModel(OpenAIBaseModel):
    """vLLM fields rlserve does not implement (multimodal features, disaggregated-serving parameters, text and
    derender output modes, ...) are refused by name rather than dropped; numbers are finite, strings Unicode text."""


class GenerateRequest(_StrictModel):
    request_id: str | None = Field(default=None, min_length=1)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    # vLLM's limits: a salt is a secret namespace, 1 to 1024 characters.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # the prompt's token ids in the response (vLLM's)
    return_token_weight_versions: bool = False  # rlserve's: each choice's token_weight_versions (see protocol.py)
    output_mode: Literal["tokens"] = "tokens"
    priority: Literal[0] = 0  # rlserve schedules first come, first served

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class GenerateLogProb(BaseModel):
    """vLLM 0.33's integer `token_id` and `rank`, and beside them the `token` string "token_id:N" of vLLM up to 0.24,
    whose generate route sent OpenAI chat logprobs (prime-rl's renderers client checks it): both schemas validate."""

    token: str
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    # The sampled token first, then the other candidates by rank (vLLM's order).
    top_logprobs: list[GenerateLogProb] = Field(default_factory=list)


class GenerateLogProbs(BaseModel):
    content: list[GenerateLogProbsContent] | None = None


class GenerateChoice(_ChoiceExtras):
    index: int
    logprobs: GenerateLogProbs | None = None
    finish_reason: str | None = None


class _GenerateBody(BaseModel):
    request_id: str
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class GenerateResponse(_GenerateBody):
    model: str
    created: int = Field(default_factory=now)
    prompt_logprobs: PromptLogprobs | None = None


class GenerateStreamResponse(_GenerateBody):
    """One SSE chunk: a choice's new token ids, or (last, with include_usage) no choice and the usage."""


def _logprob(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"token": f"token_id:{token_id}", "token_id": token_id, "logprob": finite(logprob), "rank": rank}


def tokens_logprobs(sample: CompletionOutput) -> GenerateLogProbs:
    content = []
    for token_id, entry in zip(sample.token_ids, sample.logprobs or [], strict=True):
        chosen = _logprob(token_id, entry[token_id].logprob, entry[token_id].rank)
        others = sorted((lp.rank or 0, tid, lp.logprob) for tid, lp in entry.items() if tid != token_id)
        top = [GenerateLogProb(**chosen)] + [GenerateLogProb(**_logprob(t, lp, r)) for r, t, lp in others]
        content.append(GenerateLogProbsContent(**chosen, top_logprobs=top))
    return GenerateLogProbs(content=content)
