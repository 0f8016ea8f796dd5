"""The front end's one owner of request validation: everything a user can get wrong about a prompt, its sampling
params and its LoRA adapter against this engine, each a ValueError naming the field ("prompt: ...", "logprobs: ...").

- `SamplingParams._validate` keeps what is about the params alone (ranges, types: vLLM's shape), so that a bad
  `SamplingParams(...)` fails where it is written, engine or not.
- Here: what needs this engine or the prompt (`EngineLimits`: lengths against max_model_len, token ids against the
  vocabulary, logprobs, allowed_token_ids, bad words), the LoRA request against enable_lora, and the bounds a served
  request may ask for (`check_sampling_limits`, `check_context`), which the server opts into (`api_limits`): the
  offline `LLM` keeps vLLM's looser behaviour there.
- The server keeps only what is HTTP's (body schema and refused fields, character bounds before tokenizing, keys)
  and maps a ValueError from here to a 400 naming the field; the core checks only invariants a correct front end
  never breaks (a request id in use, bad words not tokenized), refusing the request and staying up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Required, TypedDict

from transformers import PreTrainedTokenizerBase

from rlserve.lora.request import LoRARequest
from rlserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]

# Samples one request may ask for (n, times its prompts on /v1/completions): vLLM's default bound on n
# (VLLM_MAX_N_SEQUENCES). Each sample is set up on the event loop, so n=1,000,000 stalled it for 17 s.
MAX_SAMPLES_PER_REQUEST = 16384
# Stop strings and bad words: each string is matched (stop) or tokenized and matched (bad words) for every request
# step; 10,000 long stop strings took 8.6 s. OpenAI allows 4 stop strings; RL frameworks send a handful.
MAX_STRINGS_PER_FIELD = 128
MAX_STRING_CHARS = 1024
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


def check_sampling_limits(params: SamplingParams, num_prompts: int = 1) -> None:
    """A ValueError naming the field if `params` (for `num_prompts` prompts) asks for more than one request may."""
    if params.n * num_prompts > MAX_SAMPLES_PER_REQUEST:
        per = f" x {num_prompts} prompts" if num_prompts > 1 else ""
        raise ValueError(f"n: at most {MAX_SAMPLES_PER_REQUEST} samples per request, got n={params.n}{per}")
    for name in ("stop", "bad_words"):
        strings = getattr(params, name) or []
        if len(strings) > MAX_STRINGS_PER_FIELD:
            raise ValueError(f"{name}: at most {MAX_STRINGS_PER_FIELD} strings, got {len(strings)}")
        longest = max(map(len, strings), default=0)
        if longest > MAX_STRING_CHARS:
            raise ValueError(f"{name}: each string at most {MAX_STRING_CHARS} characters, got one of {longest}")


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """A ValueError naming max_tokens if the prompt and the tokens asked for exceed max_model_len: the engine would
    silently cut such a request short; OpenAI and vLLM's server refuse it."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: this model's maximum context length is {max_model_len} tokens, but "
            f"{num_prompt_tokens} prompt tokens + {max_tokens} completion tokens were requested"
        )


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """vLLM's `cache_salt` of a dict prompt: a prefix-cache namespace (requests with different salts never share
    cached blocks), e.g. one per policy version."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt: must be a non-empty string, got {salt!r}")
    return salt


class TokensPrompt(TypedDict, total=False):
    """vLLM's prompt of token ids (`vllm.inputs.TokensPrompt`), as far as rlserve takes it: the text (for outputs
    only), a prefix-cache salt, and multimodal inputs only when empty (rlserve's models are text-only)."""

    prompt_token_ids: Required[list[int]]
    prompt: str
    cache_salt: str
    multi_modal_data: dict[str, Any]
    mm_processor_kwargs: dict[str, Any]


_PROMPT_KEYS = frozenset(TokensPrompt.__annotations__)
_TEXT_ONLY_KEYS = ("multi_modal_data", "mm_processor_kwargs")


def _check_prompt_keys(prompt: dict[str, Any]) -> None:
    unknown = sorted(set(prompt) - _PROMPT_KEYS)
    if unknown:
        raise ValueError(f"prompt: unknown key(s) {unknown}; a prompt dict takes {sorted(_PROMPT_KEYS)}")
    for key in _TEXT_ONLY_KEYS:
        if prompt.get(key):
            raise ValueError(f"{key}: not supported (rlserve's models are text-only), got {prompt[key]!r}")


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: PromptType) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        return prompt, tokenizer(prompt).input_ids
    if isinstance(prompt, dict):
        _check_prompt_keys(prompt)
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list):
                raise ValueError("prompt_token_ids: must be a list of token ids")
            return prompt.get("prompt"), list(ids)
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return prompt["prompt"], tokenizer(prompt["prompt"]).input_ids
    raise ValueError("prompt: expected a string, {'prompt': str} or {'prompt_token_ids': [...]}")


def tokenize_bad_words(tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> SamplingParams:
    """`params` with its bad words as token-id sequences, as vLLM's update_from_tokenizer makes them: each word as
    written (leading spaces stripped), and with a leading space where that gives a different first token and as many
    tokens, so that the word is banned at the start of the text and after a space alike."""
    if not params.bad_words:
        return params
    sequences: list[list[int]] = []
    for word in params.bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words: {word!r} tokenizes to no token")
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return replace(params, _bad_words_token_ids=sequences)


@dataclass(frozen=True)
class ValidatedPrompt:
    """A prompt tokenized and checked, with `params`, against the engine's limits (`validate_prompt`): the engine
    queues it without checking it again."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


class RequestValidator:
    """The front end's checks of a request against this engine (see the module doc); LLM and AsyncLLM hold one."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, limits: EngineLimits, enable_lora: bool) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.enable_lora = enable_lora

    def check_lora_request(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if not self.enable_lora:
            raise ValueError("lora_request: not supported without enable_lora (start the engine with enable_lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}")

    def validate_prompt(
        self, prompt: PromptType, params: SamplingParams, lora_request: LoRARequest | None = None
    ) -> ValidatedPrompt:
        """Tokenize `prompt` (and the bad words of `params`) and check them with the adapter it runs with against
        the engine's limits: the one check of a request before it is queued."""
        return self._checked(prompt, tokenize_bad_words(self.tokenizer, params), lora_request)

    def accept(
        self, prompt: PromptType | ValidatedPrompt, params: SamplingParams | None, lora_request: LoRARequest | None
    ) -> ValidatedPrompt:
        """A prompt as AsyncLLM.generate takes it: validated here, or already validated (by `validate_prompt`, the
        server's path), in which case params and adapter, if given, must be the ones it was checked with."""
        if not isinstance(prompt, ValidatedPrompt):
            return self.validate_prompt(prompt, params or SamplingParams(), lora_request)
        if params is not None and params is not prompt.params:
            raise ValueError("sampling_params: a validated prompt carries the params it was checked with")
        if lora_request is not None and lora_request != prompt.lora_request:
            raise ValueError("lora_request: a validated prompt carries the adapter it was checked with")
        return prompt

    def validate_prompts(
        self,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        *,
        api_limits: bool = False,
    ) -> list[ValidatedPrompt]:
        """Every prompt of one request with its shared `params`, whose bad words are tokenized once (for the first
        prompt; the others share the result). `api_limits`: also the served bounds (samples and strings per request,
        prompt + max_tokens within max_model_len)."""
        if api_limits:
            check_sampling_limits(params, len(prompts))
        validated: list[ValidatedPrompt] = []
        for prompt in prompts:
            if validated:
                checked = self._checked(prompt, validated[0].params, lora_request)
            else:
                checked = self.validate_prompt(prompt, params, lora_request)
            if api_limits:
                check_context(len(checked.token_ids), checked.params.max_tokens, self.limits.max_model_len)
            validated.append(checked)
        return validated

    def validate_each(
        self,
        prompts: Sequence[PromptType],
        params_list: Sequence[SamplingParams],
        lora_requests: Sequence[LoRARequest | None],
    ) -> list[ValidatedPrompt]:
        """Each prompt with its own params and adapter (LLM.generate's lists): the bad words of each distinct params
        object are tokenized once, however many prompts share it."""
        tokenized: dict[int, SamplingParams] = {}
        validated: list[ValidatedPrompt] = []
        for prompt, params, lora_request in zip(prompts, params_list, lora_requests, strict=True):
            if id(params) not in tokenized:
                tokenized[id(params)] = tokenize_bad_words(self.tokenizer, params)
            validated.append(self._checked(prompt, tokenized[id(params)], lora_request))
        return validated

    def _checked(self, prompt: PromptType, params: SamplingParams, lora_request: LoRARequest | None) -> ValidatedPrompt:
        text, token_ids = tokenize_prompt(self.tokenizer, prompt)
        self.limits.check(token_ids, params)
        self.check_lora_request(lora_request)
        return ValidatedPrompt(text, token_ids, params, prompt_cache_salt(prompt), lora_request)
