"""The body of /v1/completions and the fields it shares with /v1/chat/completions (chat_requests.py): OpenAI's,
plus vLLM's sampling extras.

No request field is dropped unread: each of vLLM's is implemented or, in `REFUSED_FIELDS` (refused_fields.py),
refused with a 400 naming it and the reason unless it has its "off" value; a field neither vLLM nor rlserve knows is
refused as unknown. Wrong types are 400s too (the server's validation handler). Sampling values are checked by
`SamplingParams` and the engine; `APIError` carries their complaint to the client as OpenAI's error JSON, naming the
field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlserve.sampling_params import RequestOutputKind, SamplingParams
from rlserve.server.errors import APIError
from rlserve.server.refused_fields import _ONLY_OFF, refuse_fields
from rlserve.server.request_base import OpenAIBaseModel


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


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
        return refuse_fields(cls, data)

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

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets (each route's own rules); `sampling_params` builds them, or
        ServingDefaults.sampling_params with the server's defaults, so that a request's params are built once."""
        raise NotImplementedError

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling_kwargs())

    def _sampling_kwargs(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        return dict(
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

    def sampling_kwargs(self) -> dict[str, Any]:
        self.check_supported()
        if not self.echo:
            return self._sampling_kwargs(self.max_tokens, self.logprobs)
        # vLLM's: the engine samples one token that the choice leaves out, and the prompt is scored at the logprobs
        # depth unless prompt_logprobs is given.
        kwargs = self._sampling_kwargs(1 if self.max_tokens == 0 else self.max_tokens, self.logprobs)
        if self.prompt_logprobs is None and self.logprobs is not None:
            kwargs["prompt_logprobs"] = self.logprobs
        return kwargs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or token list, or a batch of them."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        if not p:
            raise APIError(400, "prompt: must not be empty", "prompt")
        return list(p)
