"""A request as the engine core tracks it: tokens, progress through the KV cache, and why it finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from rlserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt and output tokens; the KV cache holds the first num_computed_tokens of them.
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = -1  # prefix-cache hits at the first admission; -1 until admitted
    num_preemptions: int = 0
    num_prompt_logprobs_emitted: int = 0  # recompute after preemption must not emit them twice
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        p = self.sampling_params
        self.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        budget = self.max_model_len - len(self.prompt_token_ids)
        self.max_output_tokens = budget if p.max_tokens is None else min(p.max_tokens, budget)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def below_min_tokens(self) -> bool:
        return self.num_output_tokens < self.sampling_params.min_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """Stop conditions that need no text: stop/EOS token ids and length limits."""
        num_output = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if last in self.stop_ids and num_output >= self.sampling_params.min_tokens:
            self.stop_reason = (
                None if last in self.eos_token_ids and last not in self.sampling_params.stop_token_ids else last
            )
            return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
