"""A request as the engine core tracks it: tokens, progress through the KV cache, and why it finished."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from rlserve.sampling_params import RequestOutputKind, SamplingParams

# A token id that is never a real one (prompts are checked against [0, vocab)): marks a sampled token still on the GPU.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True)
class BadWordsOnDevice:
    """A request's bad words (logits_inputs.py): each word's last token, and its other tokens right-aligned in
    `width` columns (-1 pads: any token)."""

    last_token_ids: torch.Tensor  # [words]
    prefixes: torch.Tensor  # [words, width]
    width: int


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    generator: torch.Generator | None = None
    stream_interval: int = 1
    cache_salt: str | None = None  # prefix-cache namespace: salted into the hash of the first block
    # Its adapter: (lora_int_id, the version of the adapter's weights: each load is one), salted into the first
    # block's hash too; and the slot the adapter sits in (-1: the base model).
    lora: tuple[int, int] | None = None
    lora_slot: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt and output tokens; the KV cache holds the first num_computed_tokens of them.
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_placeholders: int = 0  # trailing output tokens sampled by a step whose results are not read yet
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = -1  # prefix-cache hits at the first admission; -1 until admitted
    num_preemptions: int = 0
    # The core's time.monotonic() when the request was queued, first scheduled and got its first token (0.0: not
    # yet); sent to the front end once, with the first output that carries a token (metrics: queue, prefill time).
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    first_token_sent: bool = False
    num_prompt_logprobs_emitted: int = 0  # recompute after preemption must not emit them twice
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Tokens (and their logprobs) sampled but not yet sent, for requests whose caller wants only the final output.
    held_token_ids: list[int] = field(default_factory=list)
    held_logprobs: list = field(default_factory=list)
    held_weight_version: str | None = None
    # The experts routed for its tokens not sent before, taken when it finishes (enable_return_routed_experts), and
    # the positions whose routing was sent already (step by step, to a request with stop strings).
    routed_experts: np.ndarray | None = None
    num_routed_experts_sent: int = 0
    # Its allowed_token_ids on the device, deduplicated: built at its first step, reused by every later one.
    allowed_token_ids_on_device: torch.Tensor | None = None
    bad_words_on_device: BadWordsOnDevice | None = None  # the same for its bad words

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        p = self.sampling_params
        self.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        budget = self.max_model_len - len(self.prompt_token_ids)
        self.max_output_tokens = budget if p.max_tokens is None else min(p.max_tokens, budget)
        # How many sampled tokens may wait to be sent: all of them for a caller that wants only the final output,
        # stream_interval - 1 for a stream. Stop strings are found in the text, which is built as tokens arrive:
        # those requests send every token.
        if p.stop:
            self.max_held_tokens = 0
        elif p.output_kind is RequestOutputKind.FINAL_ONLY:
            self.max_held_tokens = sys.maxsize
        else:
            self.max_held_tokens = self.stream_interval - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Including placeholders: what the next sample's position and the length limits count."""
        return len(self.output_token_ids)

    @property
    def below_min_tokens(self) -> bool:
        return self.num_output_tokens < self.sampling_params.min_tokens

    def append_placeholder(self) -> None:
        """Stand in for a token sampled on the device but not yet read back (the next step reads it there)."""
        self.output_token_ids.append(PLACEHOLDER)
        self.all_token_ids.append(PLACEHOLDER)
        self.num_placeholders += 1

    def resolve_placeholder(self, token_id: int) -> RequestStatus | None:
        """Put the oldest placeholder's real token in place; return the status it finishes the request with, if any.

        A finished request drops its later placeholders: tokens sampled after the stop are not part of its output.
        """
        index = len(self.output_token_ids) - self.num_placeholders
        self.output_token_ids[index] = token_id
        self.all_token_ids[self.num_prompt_tokens + index] = token_id
        self.num_placeholders -= 1
        status = self._check_stop(token_id, index + 1)
        if status is not None and self.num_placeholders:
            del self.output_token_ids[-self.num_placeholders :]
            del self.all_token_ids[-self.num_placeholders :]
            self.num_placeholders = 0
        return status

    def hold(self, token_ids: list[int], logprobs: list, weight_version: str) -> None:
        """Keep tokens back for a caller that wants only the final output."""
        self.held_token_ids += token_ids
        self.held_logprobs += logprobs
        self.held_weight_version = weight_version

    def take_held(self) -> tuple[list[int], list]:
        held = self.held_token_ids, self.held_logprobs
        self.held_token_ids, self.held_logprobs = [], []
        return held

    def _check_stop(self, token_id: int, num_output: int) -> RequestStatus | None:
        """Stop conditions that need no text: stop/EOS token ids and length limits."""
        if token_id in self.stop_ids and num_output >= self.sampling_params.min_tokens:
            self.stop_reason = (
                None
                if token_id in self.eos_token_ids and token_id not in self.sampling_params.stop_token_ids
                else token_id
            )
            return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
