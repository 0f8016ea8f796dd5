"""One GRPO optimizer step on a batch of streamed groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlserve.rl.grpo import Policy, TokenBatch, TrainStats, group_advantages
from rlserve.rl.rollout_stream import RolloutBatch


@dataclass(frozen=True)
class StepStats:
    reward: float
    lag_mean: float
    lag_max: int
    num_samples: int
    train: TrainStats


def train_on_batch(policy: Policy, batch: RolloutBatch, pad_id: int) -> StepStats:
    """One GRPO step on a batch of groups: per-group advantages, then the policy's clipped update."""
    rollouts = [r for g in batch.groups for r in g.rollouts]
    # Groups may have lost samples to the lag filter, so each is normalised on its own.
    advantages = torch.cat(
        [
            group_advantages(torch.tensor([[r.reward for r in g.rollouts]]), policy.config.std_eps)[0]
            for g in batch.groups
        ]
    )
    lags = [policy.version - r.oldest_version for r in rollouts]
    device = next(policy.model.parameters()).device
    train = policy.train_step(TokenBatch.from_rollouts(rollouts, pad_id, device), advantages)
    return StepStats(
        reward=sum(r.reward for r in rollouts) / len(rollouts),
        lag_mean=sum(lags) / len(lags),
        lag_max=max(lags),
        num_samples=len(rollouts),
        train=train,
    )
