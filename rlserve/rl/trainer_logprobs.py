"""The trainer-side API of train/inference parity: the engine's logprobs of sampled tokens against a trainer's.

`compare_logprobs` is what a trainer calls on its own batches (engine logprobs from the rollouts, its own logprobs of
the same tokens). `trainer_logprobs` computes the trainer side for a Hugging Face model or rlserve's own decoder run in
training mode (`rlserve.rl.train_forward`); on that decoder loaded with `batch_invariant=True` it gives the logprobs of
an engine in batch-invariant mode bit for bit, with their gradients, in one forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rlserve.model.models.llama import DecoderForCausalLM
from rlserve.model.sampler import apply_temperature, apply_top_k_top_p
from rlserve.rl.train_forward import forward_hidden

RATIO_BAND = (0.9, 1.1)
GREEDY_TEMPERATURE = 1e-5  # SamplingParams.greedy: below it the engine takes the argmax and reports raw values

LogprobsLike = torch.Tensor | Sequence[torch.Tensor | Sequence[float]]
TokenIds = Sequence[Sequence[int]]


@dataclass(frozen=True)
class ParityStats:
    """Engine vs trainer logprobs of the same tokens; r = trainer - engine per token, ratio w = exp(r)."""

    mean_abs_diff: float
    max_abs_diff: float
    k3_kl: float  # mean(w - 1 - r): an unbiased, non-negative estimate of KL(behaviour || trainer)
    mean_ratio: float
    frac_outside: float  # share of tokens with w outside RATIO_BAND
    ess: float  # (sum w)^2 / (n sum w^2), in (0, 1]: 1 when all ratios are equal
    num_tokens: int


def _flatten(values: LogprobsLike) -> tuple[torch.Tensor, list[int] | torch.Size]:
    """Values as one float64 vector, and the layout (tensor shape, or per-sequence lengths) to check pairs against."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float64).reshape(-1), values.shape
    parts = [torch.as_tensor(v).detach().to("cpu", torch.float64).reshape(-1) for v in values]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64)
    return flat, [len(p) for p in parts]


def compare_logprobs(
    engine_logprobs: LogprobsLike, trainer_logprobs: LogprobsLike, mask: LogprobsLike | None = None
) -> ParityStats:
    """Statistics over the tokens of a batch: padded tensors [B, T] with a mask, or ragged per-sequence lists.

    The mask (same layout; nonzero = a completion token) drops padding; without it every value counts. Computed in
    float64. A token the trainer's processed distribution excludes (-inf) gives infinite max |Δ| and k3 KL on purpose.
    """
    engine, layout = _flatten(engine_logprobs)
    trainer, trainer_layout = _flatten(trainer_logprobs)
    if list(layout) != list(trainer_layout):
        raise ValueError(f"engine and trainer logprobs differ in layout: {list(layout)} vs {list(trainer_layout)}")
    if mask is not None:
        keep, mask_layout = _flatten(mask)
        if list(mask_layout) != list(layout):
            raise ValueError(f"mask layout {list(mask_layout)} differs from the logprobs' {list(layout)}")
        engine, trainer = engine[keep != 0], trainer[keep != 0]
    n = engine.numel()
    if n == 0:
        raise ValueError("no tokens to compare")
    r = trainer - engine
    w = r.exp()
    low, high = RATIO_BAND
    return ParityStats(
        mean_abs_diff=float(r.abs().mean()),
        max_abs_diff=float(r.abs().max()),
        k3_kl=float((w - 1 - r).mean()),
        mean_ratio=float(w.mean()),
        frac_outside=float(((w < low) | (w > high)).double().mean()),
        ess=float(w.sum() ** 2 / (n * (w * w).sum())),
        num_tokens=n,
    )


def _hf_completion_logits(model: nn.Module, prompt: Sequence[int], completion: Sequence[int]) -> torch.Tensor:
    ids = torch.tensor([[*prompt, *completion]], device=model.device)
    # Row P - 1 + j predicts completion token j; the last row predicts past the sequence and is dropped.
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(completion) + 1).logits
    return logits[0, :-1]


def _token_logprobs(
    logits: torch.Tensor, targets: Sequence[int], temperature: float, top_k: int, top_p: float, processed: bool
) -> torch.Tensor:
    logits = logits.float()  # the engine's sampler also works in fp32 on whatever the LM head produced
    if processed and temperature >= GREEDY_TEMPERATURE:
        # The engine's order: temperature, then top-k, then top-p (rlserve.model.sampler).
        n = logits.shape[0]
        logits = apply_temperature(logits, torch.full((n,), temperature, device=logits.device))
        k = torch.full((n,), top_k, device=logits.device) if top_k > 0 else None
        p = torch.full((n,), top_p, device=logits.device) if top_p < 1.0 else None
        if k is not None or p is not None:
            logits = apply_top_k_top_p(logits, k, p)
    index = torch.tensor(list(targets), dtype=torch.long, device=logits.device).unsqueeze(-1)
    return logits.log_softmax(-1).gather(-1, index).squeeze(-1)


def trainer_logprobs(
    model: nn.Module,
    prompt_ids: TokenIds,
    completion_ids: TokenIds,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    processed: bool = False,
    routed_experts: Sequence[np.ndarray | torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Logprobs of each completion's tokens from one full-sequence forward, as a trainer computes them.

    `model`: a Hugging Face causal LM (one forward per sequence, so no padding enters the numerics) or rlserve's
    `DecoderForCausalLM` (all sequences packed into one forward through `train_forward.ContiguousAttention`).
    processed=False: log_softmax of the logits (the engine's raw_logprobs). processed=True: of the distribution the
    engine sampled from, after temperature, top-k and top-p (its processed_logprobs). Returns one float32 tensor per
    completion; gradients flow unless the caller disables them. `routed_experts` (rlserve's MoE decoder only): replay
    the engine's routing, per sequence its CompletionOutput.routed_experts (see train_forward.forward_hidden).
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"got {len(prompt_ids)} prompts and {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompt_ids: every prompt needs at least one token")
    if isinstance(model, DecoderForCausalLM):
        sequences = [[*p, *c] for p, c in zip(prompt_ids, completion_ids, strict=True)]
        hidden = forward_hidden(model, sequences, routed_experts)
        logits = [
            model.compute_logits(h[len(p) - 1 : len(p) - 1 + len(c)])
            for h, p, c in zip(hidden, prompt_ids, completion_ids, strict=True)
        ]
    else:
        if routed_experts is not None:
            raise ValueError("routed_experts: replaying routing needs rlserve's model (trainer 'rlserve')")
        logits = [_hf_completion_logits(model, p, c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    return [
        _token_logprobs(x, c, temperature, top_k, top_p, processed) for x, c in zip(logits, completion_ids, strict=True)
    ]
