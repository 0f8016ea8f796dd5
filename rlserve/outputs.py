"""vLLM-shaped results: RequestOutput holds one CompletionOutput per sample."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

DEFAULT_WEIGHT_VERSION = "default"


@dataclass(slots=True)  # one per returned token: a final-only RL batch builds hundreds of thousands
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PositionLogprobsData(NamedTuple):
    """The engine's compact form of one position's logprobs, before the front end names the tokens."""

    topk_ids: list[int]
    topk_values: list[float]
    token_value: float  # the sampled (or, for prompt logprobs, the actual) token's value
    token_rank: int


# One dict per position: token id -> Logprob (top-k plus the sampled or actual token).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    # The weight version that sampled each output token; a sample that spans an update shows both.
    weight_versions: list[str] = field(default_factory=list)
    # With enable_return_routed_experts, on the finished output: the experts the router chose for each token and
    # layer, [prompt + output tokens - 1 - routed_experts_prompt_start, layers, top_k] (the last sampled token was
    # never forwarded), uint8 up to 256 experts (vLLM's CompletionOutput.routed_experts).
    routed_experts: np.ndarray | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


def npy_bytes(array: np.ndarray) -> bytes:
    """`array` in NumPy's .npy format (dtype and shape included, never pickled): how routed experts travel."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return buffer.getvalue()


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Fold a later output of the same request into this one (vLLM's name): with `aggregate` (delta outputs)
        each sample's new text, tokens, logprobs and weight versions are appended; without, the later samples
        replace these (cumulative outputs hold everything already)."""
        self.finished = self.finished or next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        by_index = {c.index: k for k, c in enumerate(self.outputs)}
        for later in next_output.outputs:
            k = by_index.get(later.index)
            if k is None:
                self.outputs.append(later)
            elif not aggregate:
                self.outputs[k] = later
            else:
                sample = self.outputs[k]
                sample.text += later.text
                sample.token_ids = sample.token_ids + later.token_ids
                sample.weight_versions = sample.weight_versions + later.weight_versions
                if sample.logprobs is not None and later.logprobs is not None:
                    sample.logprobs = sample.logprobs + later.logprobs
                sample.cumulative_logprob = later.cumulative_logprob
                sample.finish_reason, sample.stop_reason = later.finish_reason, later.stop_reason
                if later.routed_experts is not None:  # only the finished output carries them, whole
                    sample.routed_experts = later.routed_experts
