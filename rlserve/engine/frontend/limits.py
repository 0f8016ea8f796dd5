"""The engine's limits on a request, checked once in the front end before anything is sent to the core."""

from __future__ import annotations

from dataclasses import dataclass

from rlserve.sampling_params import SamplingParams

# The tokens of a request's bad words, all told: each is matched on the device at every step of the request.
# 128 words of 300 characters (today's bounds on strings) are tens of thousands.
MAX_BAD_WORD_TOKENS = 4096


@dataclass(frozen=True)
class EngineLimits:
    """Fixed when the core starts; the core reports them to every front end that connects."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """A ValueError naming the field if the request cannot run on this engine."""
        if not prompt_token_ids:
            raise ValueError("prompt: the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_token_ids)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        limit = self.vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > limit:
                raise ValueError(f"{name}: {k} is above the engine's limit min(max_logprobs, vocab size) = {limit}")
        allowed = params.allowed_token_ids
        if allowed is not None and len(allowed) > self.vocab_size:
            # Each id is one of the vocabulary's: a longer list only repeats some (a million of them held the engine
            # for seconds).
            raise ValueError(
                f"allowed_token_ids: at most {self.vocab_size} ids (the vocabulary's size), got {len(allowed)}"
            )
        bad_word_tokens = sum(map(len, params.bad_words_token_ids or ()))
        if bad_word_tokens > MAX_BAD_WORD_TOKENS:
            raise ValueError(
                f"bad_words: {bad_word_tokens} tokens in all (each word as written and after a space), more than "
                f"{MAX_BAD_WORD_TOKENS}"
            )
        token_id_fields = {
            "stop_token_ids": params.stop_token_ids,
            "logit_bias": params.logit_bias or (),
            "allowed_token_ids": params.allowed_token_ids or (),
            "bad_words": [t for word in params.bad_words_token_ids or () for t in word],
        }
        for name, ids in token_id_fields.items():
            if any(t >= self.vocab_size for t in ids):
                raise ValueError(f"{name}: ids must be below the vocabulary size {self.vocab_size}")
        if params.routed_experts_prompt_start > len(prompt_token_ids):
            raise ValueError(
                f"routed_experts_prompt_start: {params.routed_experts_prompt_start} is past the prompt's "
                f"{len(prompt_token_ids)} tokens"
            )
