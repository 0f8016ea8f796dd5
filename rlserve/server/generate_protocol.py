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
from rlserve.server.errors import APIError
from rlserve.server.openai_requests import StreamOptions
from rlserve.server.openai_responses import PromptLogprobs, UsageInfo, _ChoiceExtras, now
from rlserve.server.refused_fields import _ONLY_OFF
from rlserve.server.request_base import OpenAIBaseModel
from rlserve.server.response_fields import finite

M = TypeVar("M", bound=BaseModel)

# The bad words' token ids are the server's tokenizer's, not a client's to set; output_kind is checked on its own.
_SERVER_SET = frozenset({"output_kind", "_bad_words_token_ids"})
SAMPLING_KEYS = frozenset(SamplingParams.__dataclass_fields__) - _SERVER_SET
_SAMPLING_ADAPTER = TypeAdapter(SamplingParams)  # non-finite floats: SamplingParams refuses them itself
# vLLM's engine-side choice of its logprobs container (FlatLogprobs or a list of dicts): the wire is the same either
# way, in vLLM as in rlserve, so any bool is accepted.
_WIRE_NEUTRAL = frozenset({"flat_logprobs"})
# vLLM's generate route delivers as `stream` says, whatever output_kind asks (serving.py sets it): rlserve accepts the
# kinds that describe what it delivers (one final output, which is also the cumulative one; deltas when streamed) and
# refuses the others by name rather than deliver something else.
_DELIVERED_KINDS = {
    False: (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY),
    True: (RequestOutputKind.DELTA,),
}
# vLLM's MessagePack transport carries 64-bit integers only (SamplingParams._verify_extra_args).
_EXTRA_ARGS_INT_RANGE = (-(2**63), 2**64)


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
    _check_output_kind(fields.pop("output_kind", None), stream)
    if fields.get("extra_args", {}) is None:
        del fields["extra_args"]  # vLLM's default: none
    _check_extra_args(fields.get("extra_args"))
    for name, value in list(fields.items()):
        if name in SAMPLING_KEYS:
            continue
        if name in _WIRE_NEUTRAL:
            if not isinstance(value, bool):
                raise APIError(
                    400, f"sampling_params.{name}: must be a boolean (got {value!r})", f"sampling_params.{name}"
                )
            del fields[name]
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


def _check_output_kind(value: Any, stream: bool) -> None:
    if value is None:
        return
    param = "sampling_params.output_kind"
    try:
        kind = RequestOutputKind(value) if not isinstance(value, bool) else None
    except ValueError:
        kind = None
    if kind is None:
        raise APIError(400, f"{param}: one of 0 (CUMULATIVE), 1 (DELTA), 2 (FINAL_ONLY), got {value!r}", param)
    if kind not in _DELIVERED_KINDS[stream]:
        delivered = "deltas (1) when streamed" if stream else "one final output (0 or 2) without stream"
        raise APIError(400, f"{param}: the server delivers {delivered}, as `stream` says (got {value!r})", param)


def _check_extra_args(value: Any) -> None:
    """vLLM's checks of extra_args, and refusals of the keys vLLM's own engine reads (the KV and encoder-cache
    connectors of disaggregated serving, which rlserve has not). Other keys travel with the request to the engine
    in SamplingParams.extra_args, as in vLLM, for code that reads them."""
    param = "sampling_params.extra_args"
    if value is None:
        return
    if not isinstance(value, dict):
        raise APIError(400, f"{param}: must be an object (got {value!r})", param)
    for key in ("kv_transfer_params", "ec_transfer_params"):
        if key in value:
            raise APIError(400, f"{param}: {key}: rlserve has no disaggregated serving", param)
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            low, high = _EXTRA_ARGS_INT_RANGE
            if not low <= item < high:
                raise APIError(400, f"{param}: integers must be between -2**63 and 2**64 - 1 (got {item})", param)
        elif isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            pending += item


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
    # rlserve's: each choice's token_weight_versions (see openai_requests.py)
    return_token_weight_versions: bool = False
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
