"""Sampling with per-request settings, and logprobs in the four modes of vLLM.

Order (vLLM's): raw values are captured from the model's logits; then stop tokens are masked for requests below
min_tokens, the requests' token masks, logit bias and penalties are applied (rlserve.model.logits_adjustments), logits
are divided by the temperature, and min-p, top-k and top-p mask tokens to -inf. What remains is the distribution
actually sampled from: the "processed" values (greedy rows: after the masks, bias and penalties, which change their
argmax too). Greedy rows take the argmax and skip temperature and truncation. Random rows use the exponential race
(argmax of p / E, E ~ Exp(1)), which samples exactly from p and needs no host synchronisation; a request with a seed
draws its E from its own generator, so its tokens do not depend on what else is in the batch.

On CUDA, a batch that uses temperature only (no min-p, top-k, top-p, min_tokens masking or logits adjustment, no
seeded request) and wants at most the chosen token's logprob goes to one fused Triton kernel
(rlserve.model.kernels.fused_sampling) instead of the PyTorch passes below: the same distributions and the same
logprob values and ranks, from one read of the logits in their own dtype (two with logprobs). Its random stream is
keyed by a seed drawn from torch's CPU generator. In batch-invariant mode the kernel only chooses the token; the
logprob values still come from the PyTorch passes, which the trainer-side forward reproduces bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlserve.config import LogprobsMode
from rlserve.model.logits_adjustments import LogitsAdjustments, apply_logits_adjustments


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float32; 1.0 on greedy rows
    greedy: torch.Tensor  # [N] bool
    top_k: torch.Tensor | None  # [N] int64, vocab size where disabled; None when no row uses it
    top_p: torch.Tensor | None  # [N] float32; None when no row uses it
    min_p: torch.Tensor | None  # [N] float32; None when no row uses it
    generators: list[torch.Generator | None]
    min_tokens_mask: list[tuple[int, list[int]]]  # (row, token ids to forbid) for rows below min_tokens
    max_num_logprobs: int  # -1: no row wants logprobs
    all_greedy: bool
    all_random: bool
    adjustments: LogitsAdjustments | None = None  # penalties, bias and masks of the rows that use them


@dataclass
class LogprobsTensors:
    """Top-k values per row plus the value and rank of a chosen token (the sampled one, or the actual next token)."""

    topk_ids: torch.Tensor  # [N, k]
    topk_values: torch.Tensor  # [N, k]
    token_values: torch.Tensor  # [N]
    token_ranks: torch.Tensor  # [N]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N]
    logprobs: LogprobsTensors | None


def gather_logprobs(values: torch.Tensor, k: int, token_ids: torch.Tensor) -> LogprobsTensors:
    token_values = values.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    # vLLM's rank: how many vocabulary entries score at least as high as the token (1 = the best).
    token_ranks = (values >= token_values.unsqueeze(-1)).sum(-1)
    topk_values, topk_ids = values.topk(k, dim=-1) if k > 0 else (values[:, :0], token_ids[:, None][:, :0])
    return LogprobsTensors(topk_ids, topk_values, token_values, token_ranks)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [N, V] / temperature [N]. A tensor divisor keeps this a true division: CUDA turns division by a Python
    scalar into multiplication by its reciprocal, which differs in the last bit, and a trainer reproducing the engine's
    processed logprobs bit for bit (batch-invariant mode) must compute exactly this."""
    return logits / temperature.unsqueeze(-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(-1)
    threshold = probs.amax(-1, keepdim=True) * min_p.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        # Keep the k largest: everything strictly below the k-th largest value goes.
        kth = sorted_logits.gather(-1, (logits.shape[-1] - top_k).clamp(min=0).unsqueeze(-1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        # Drop the smallest tokens whose total mass stays within 1 - top_p; the largest token always survives.
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= (1.0 - top_p).unsqueeze(-1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


@functools.cache
def _fused_sample() -> Callable | None:
    """kernels.fused_sampling.fused_sample, or None where Triton cannot be imported."""
    try:
        from rlserve.model.kernels.fused_sampling import fused_sample
    except ImportError:
        return None
    return fused_sample


def fused_path_applies(meta: SamplingMetadata) -> bool:
    """Whether the fused kernel covers the batch's settings: temperature only, no seeded request, and at most the
    chosen token's logprob."""
    return (
        meta.top_k is None
        and meta.top_p is None
        and meta.min_p is None
        and not meta.min_tokens_mask
        and meta.adjustments is None
        and meta.max_num_logprobs <= 0
        and all(g is None for g in meta.generators)
    )


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The values random rows sample from: the logits divided by the temperature, then min-p, top-k and top-p;
    greedy rows keep theirs (they report their unprocessed values)."""
    if meta.all_greedy:
        return logits
    processed = apply_temperature(logits, meta.temperature)
    if meta.min_p is not None:
        processed = apply_min_p(processed, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        processed = apply_top_k_top_p(processed, meta.top_k, meta.top_p)
    if not meta.all_random:
        processed = torch.where(meta.greedy.unsqueeze(-1), logits, processed)
    return processed


class Sampler:
    def __init__(self, logprobs_mode: LogprobsMode, batch_invariant: bool = False) -> None:
        self.logprobs_mode = logprobs_mode
        # Batch-invariant mode takes logprob values from the PyTorch passes, which the trainer-side forward computes
        # too; the fused kernel's online log-sum-exp rounds differently.
        self.batch_invariant = batch_invariant

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.is_cuda and fused_path_applies(meta) and _fused_sample() is not None:
            return self._sample_fused_tokens(logits, meta) if self.batch_invariant else self._sample_fused(logits, meta)
        return self._sample_torch(logits, meta)

    def _sample_torch(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw = logits
        if meta.min_tokens_mask or meta.adjustments is not None:
            logits = logits.clone()  # `raw` stays what the model computed
        for row, token_ids in meta.min_tokens_mask:
            logits[row, token_ids] = float("-inf")
        if meta.adjustments is not None:
            logits = apply_logits_adjustments(logits, meta.adjustments)
        greedy_tokens = None if meta.all_random else logits.argmax(-1)
        processed = process_logits(logits, meta)
        if not meta.all_greedy:
            random_tokens = self._sample_random(processed, meta.generators)
            token_ids = random_tokens if meta.all_random else torch.where(meta.greedy, greedy_tokens, random_tokens)
        else:
            token_ids = greedy_tokens
        logprobs = None
        if meta.max_num_logprobs >= 0:
            values = self._mode_values(raw, lambda: processed)
            logprobs = gather_logprobs(values, meta.max_num_logprobs, token_ids)
        return SamplerOutput(token_ids, logprobs)

    def _mode_values(self, raw: torch.Tensor, processed: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The values logprobs are taken of, in this sampler's mode (`processed` is asked for only by its modes)."""
        if self.logprobs_mode.startswith("raw"):
            values = raw
        else:
            values = processed()
        return values.log_softmax(-1) if self.logprobs_mode.endswith("logprobs") else values

    def _sample_fused_tokens(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Batch-invariant mode's fused path: the token from the fused kernel's one read of the logits (each row's
        draw is its own, as in the exponential race), its logprob from the PyTorch passes below, bit for bit what
        the trainer-side forward computes. The race's four passes over [N, V] floats were most of the sampler's
        time in this mode."""
        seed = int(torch.randint(2**31 - 1, ()))
        token_ids, _, _ = _fused_sample()(logits, meta.temperature, meta.greedy, seed, meta.all_greedy, None)
        if meta.max_num_logprobs < 0:
            return SamplerOutput(token_ids, None)
        raw = logits.float()
        values = self._mode_values(raw, lambda: process_logits(raw, meta))
        return SamplerOutput(token_ids, gather_logprobs(values, meta.max_num_logprobs, token_ids))

    def _sample_fused(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # From the CPU generator: a draw on the device would need a sync to reach the kernel's arguments.
        seed = int(torch.randint(2**31 - 1, ()))
        mode = self.logprobs_mode if meta.max_num_logprobs == 0 else None
        token_ids, values, ranks = _fused_sample()(logits, meta.temperature, meta.greedy, seed, meta.all_greedy, mode)
        if values is None:
            return SamplerOutput(token_ids, None)
        num_rows = token_ids.shape[0]
        no_topk = LogprobsTensors(token_ids.new_empty(num_rows, 0), values.new_empty(num_rows, 0), values, ranks)
        return SamplerOutput(token_ids, no_topk)

    @staticmethod
    def _sample_random(logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs)
        seeded = [i for i, g in enumerate(generators) if g is not None]
        if len(seeded) < len(generators):
            noise.exponential_()
        for i in seeded:
            noise[i].exponential_(generator=generators[i])
        return probs.div_(noise).argmax(-1)
