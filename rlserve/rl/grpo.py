"""Trainer-side GRPO in plain PyTorch: advantages, the clipped token-level loss, mismatch metrics, and the policy.

The behaviour policy is the engine: its per-token logprobs (the distribution it actually sampled from) are the
denominator of the importance ratio, as in PipelineRL, so one ratio covers both policy lag and any engine/trainer
numerical mismatch. The mismatch on its own is measured separately: `k3_kl` between the engine's logprobs and the
trainer's logprobs of the same tokens under the weights that generated them (the policy keeps a snapshot of each
recent weight version for that).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from rlserve.rl.train_forward import causal_logits, checkpoint_weights


@dataclass(frozen=True)
class GRPOConfig:
    lr: float = 1e-3
    clip_eps: float = 0.2  # PPO clip range: ratios outside [1 - eps, 1 + eps] stop pushing further
    std_eps: float = 1e-6  # groups whose reward std is below this carry no signal (advantage 0)
    keep_versions: int = 8  # weight snapshots kept for the mismatch metric: the oldest version a sample may lag to
    max_grad_norm: float = 1.0  # a few lagged tokens with huge ratios must not throw the small model off course


@dataclass(frozen=True)
class LossStats:
    """Per-token statistics of one loss evaluation (over the masked tokens)."""

    ratio_mean: float
    ratio_min: float
    ratio_max: float
    clip_fraction: float
    num_tokens: int


def group_advantages(rewards: torch.Tensor, std_eps: float = GRPOConfig.std_eps) -> torch.Tensor:
    """GRPO advantages of rewards shaped [num_groups, group_size]: (r - group mean) / group std.

    A group whose samples all scored the same says nothing about which completion is better; its advantage is
    exactly 0 rather than 0/eps noise.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    flat = std < std_eps
    return torch.where(flat, torch.zeros_like(rewards), (rewards - mean) / std.clamp_min(std_eps))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at every position: logits [B, T, V], targets [B, T] -> [B, T] (in fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = GRPOConfig.clip_eps,
) -> tuple[torch.Tensor, LossStats]:
    """PPO-style clipped surrogate with a token-level ratio against the behaviour (engine) logprobs.

    logprobs [B, T] (requires grad), behaviour_logprobs [B, T], advantages [B] (one per sample, broadcast over its
    tokens) or [B, T], mask [B, T] (1 on completion tokens). The loss is the mean over all completion tokens of the
    batch, so long and short completions weigh each token equally (DAPO's token-level normalisation).
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logprobs - behaviour_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = -_masked_mean(torch.minimum(unclipped, clipped), mask)
    with torch.no_grad():
        # The clip "engages" where it picked the clipped term, i.e. where that token's gradient was cut.
        engaged = (clipped < unclipped).to(mask.dtype)
        live = ratio[mask.bool()]
        empty = live.numel() == 0
        stats = LossStats(
            ratio_mean=1.0 if empty else float(live.mean()),
            ratio_min=1.0 if empty else float(live.min()),
            ratio_max=1.0 if empty else float(live.max()),
            clip_fraction=float(_masked_mean(engaged, mask)),
            num_tokens=int(mask.sum()),
        )
    return loss, stats


def k3_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean k3 estimate of KL(reference || policy) over masked tokens sampled from the reference:
    exp(d) - d - 1 with d = logprobs - reference_logprobs. Non-negative, 0 only where the two agree."""
    d = (logprobs - reference_logprobs).double()
    return float(_masked_mean(torch.expm1(d) - d, mask.double()))


# ---- batches of rollouts ----


@dataclass(frozen=True)
class Rollout:
    """One sampled completion as the trainer sees it. `logprobs` and `versions` have one entry per completion token:
    the engine's logprob of that token and the weight version that sampled it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float

    @property
    def oldest_version(self) -> int:
        return min(self.versions)


@dataclass(frozen=True)
class TokenBatch:
    """Prompt + completion sequences, right-padded, with per-target-position tensors [B, L-1] (position t predicts
    token t+1). Right padding needs no attention mask: causal attention never looks forward into it."""

    input_ids: torch.Tensor  # [B, L]
    mask: torch.Tensor  # [B, L-1] 1.0 where the target is a completion token
    behaviour_logprobs: torch.Tensor  # [B, L-1] the engine's logprobs (0 off the mask)
    versions: torch.Tensor  # [B, L-1] weight version that sampled the target (-1 off the mask)

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, 1:]

    @classmethod
    def from_rollouts(cls, rollouts: Sequence[Rollout], pad_id: int, device: torch.device | str = "cpu") -> TokenBatch:
        length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
        input_ids = torch.full((len(rollouts), length), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rollouts), length - 1)
        behaviour = torch.zeros(len(rollouts), length - 1)
        versions = torch.full((len(rollouts), length - 1), -1, dtype=torch.long)
        for i, r in enumerate(rollouts):
            p, c = len(r.prompt_ids), len(r.completion_ids)
            input_ids[i, : p + c] = torch.tensor(r.prompt_ids + r.completion_ids)
            # Completion token j is predicted at position p - 1 + j.
            mask[i, p - 1 : p - 1 + c] = 1.0
            behaviour[i, p - 1 : p - 1 + c] = torch.tensor(r.logprobs)
            versions[i, p - 1 : p - 1 + c] = torch.tensor(r.versions)
        return cls(input_ids.to(device), mask.to(device), behaviour.to(device), versions.to(device))


# ---- the policy ----


@dataclass(frozen=True)
class TrainStats:
    loss: float
    grad_norm: float  # before clipping
    mismatch_kl: float
    loss_stats: LossStats


class _Logits(nn.Module):
    """A model's `causal_logits` as a module call, so that functional_call can run it on earlier weights."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return causal_logits(self.model, input_ids)


class Policy:
    """The trainer's model, its optimizer, and the weight version it is at (one per optimizer step).

    `model`: a Hugging Face causal LM whose parameter names are checkpoint names, or rlserve's decoder
    (rlserve.rl.train_forward.load_training_model). Loaded with batch_invariant=True, against an engine in
    batch-invariant mode, the one forward of a step gives the engine's logprobs bit for bit (on-policy ratios of
    exactly 1, a mismatch of exactly 0) and the loss's gradients.
    """

    def __init__(self, model: nn.Module, config: GRPOConfig | None = None, version: int = 0) -> None:
        self.model = model
        self._logits = _Logits(model)
        self.config = config = config or GRPOConfig()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
        self.version = version
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._snapshot()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) pairs to send to the engine, in a stable order."""
        return checkpoint_weights(self.model)

    def _snapshot(self) -> None:
        # Under _Logits' names, as functional_call takes them.
        self._snapshots[self.version] = {
            f"model.{name}": p.detach().clone() for name, p in self.model.named_parameters()
        }
        for old in [v for v in self._snapshots if v < self.version - self.config.keep_versions]:
            del self._snapshots[old]

    def logprobs(self, batch: TokenBatch, version: int | None = None) -> torch.Tensor:
        """Logprobs [B, L-1] of the batch's targets under the current weights, or under an earlier `version`."""
        if version is None or version == self.version:
            logits = self._logits(batch.input_ids)
        else:
            if version not in self._snapshots:
                raise KeyError(
                    f"weight version {version} is no longer kept (keep_versions={self.config.keep_versions})"
                )
            logits = functional_call(self._logits, self._snapshots[version], (batch.input_ids,))
        return token_logprobs(logits[:, :-1], batch.targets)

    def mismatch_kl(self, batch: TokenBatch, current: torch.Tensor) -> float:
        """k3 KL between the engine's logprobs and the trainer's, each token scored under the weights that sampled
        it. `current` is the batch's logprobs under the current weights (already computed for the loss)."""
        trainer = current.detach().clone()
        with torch.no_grad():
            for version in batch.versions[batch.mask.bool()].unique().tolist():
                if version != self.version:
                    at = batch.versions == version
                    trainer[at] = self.logprobs(batch, version)[at]
        return k3_kl(trainer, batch.behaviour_logprobs, batch.mask)

    def train_step(self, batch: TokenBatch, advantages: torch.Tensor) -> TrainStats:
        """One optimizer step on the clipped GRPO loss; the policy moves to the next weight version."""
        self.model.train()
        logprobs = self.logprobs(batch)
        mismatch = self.mismatch_kl(batch, logprobs)
        loss, stats = clipped_policy_loss(
            logprobs, batch.behaviour_logprobs, advantages.to(logprobs.device), batch.mask, self.config.clip_eps
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.version += 1
        self._snapshot()
        return TrainStats(loss.detach().item(), grad_norm.item(), mismatch, stats)


def supervised_warmup(
    model: nn.Module,
    examples: Callable[[random.Random], tuple[list[int], list[int]]],
    steps: int,
    *,
    pad_id: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """A short supervised fine-tune on (prompt ids, completion ids) pairs drawn by `examples`, standing in for the
    pretraining a real RL run starts from. Returns the loss of every step."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        pairs = [examples(rng) for _ in range(batch_size)]
        # Only the token layout and the completion mask are used: logprobs, versions and reward are placeholders.
        rollouts = [Rollout(p, c, [0.0] * len(c), [0] * len(c), 0.0) for p, c in pairs]
        batch = TokenBatch.from_rollouts(rollouts, pad_id, device)
        logits = causal_logits(model, batch.input_ids)
        loss = -_masked_mean(token_logprobs(logits[:, :-1], batch.targets), batch.mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().item())
    return losses
