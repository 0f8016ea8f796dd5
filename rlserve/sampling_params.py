"""Per-request sampling parameters, validated on construction (vLLM's names and meanings)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

# vLLM's bound on a logit bias: larger values are clamped to it (+-100 already forces or forbids a token).
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds everything so far
    DELTA = 1  # every output holds only what is new (streaming)
    FINAL_ONLY = 2  # one output when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per output token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict = field(default_factory=dict)
    # Penalties and masks on the logits before temperature (vLLM's and OpenAI's meanings; after the older fields, so
    # that positional arguments keep their meaning): repetition divides positive logits of tokens seen in the prompt or
    # output and multiplies negative ones; frequency and presence subtract per occurrence / once for output tokens.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never complete one of these words (their tokens, as vLLM matches them)
    # bad_words as token-id sequences, set by the front end's tokenizer (EngineFrontEnd.validate_prompt); the core
    # matches these. vLLM keeps the same under the same name.
    _bad_words_token_ids: list[list[int]] | None = None
    # With the engine's enable_return_routed_experts: the prompt tokens whose routing is not returned (vLLM's field;
    # a multi-turn caller skips the prefix it already has).
    routed_experts_prompt_start: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.bad_words is not None:
            self.bad_words = list(dict.fromkeys(self.bad_words))  # vLLM drops repeats
        self._validate()
        if self.logit_bias:
            self.logit_bias = {t: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, b)) for t, b in self.logit_bias.items()}

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        # NaN passes every comparison, so ranges are written to fail for it; temperature has no upper bound.
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise bad("temperature", "must be a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed <= 2**63 - 1 - self.n):
            raise bad("seed", "must be an integer in [0, 2**63 - 1 - n]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be >= 0")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.logit_bias is not None and any(
            not _is_token_id(t) or not isinstance(b, (int, float)) or not math.isfinite(b)
            for t, b in self.logit_bias.items()
        ):
            raise bad("logit_bias", "must map token ids (integers >= 0) to finite numbers")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or not all(_is_token_id(t) for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", "must be non-empty strings")
        if not _is_token_id(self.routed_experts_prompt_start):
            raise bad("routed_experts_prompt_start", "must be an integer >= 0")

    @property
    def adjusts_logits(self) -> bool:
        """Whether this request changes the logits before temperature (penalties, bias, masks): the engine prepares
        the tensors for that only in steps that hold such a request."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def child(self, index: int) -> SamplingParams:
        """Params of the index-th of n samples: seeds differ per sample so that n > 1 gives distinct samples. With
        n == 1 the one sample's params are the request's own (no copy); with n > 1 each sample needs its own (n=1,
        its seed), which the core reads per request."""
        if self.n == 1:
            return self
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
