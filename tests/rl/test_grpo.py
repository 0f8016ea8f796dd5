"""The trainer-side GRPO math (advantages, clipped loss, k3 KL) and the policy's version bookkeeping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve import SamplingParams
from rlserve.rl.grpo import (
    GRPOConfig,
    Policy,
    Rollout,
    TokenBatch,
    clipped_policy_loss,
    group_advantages,
    k3_kl,
    supervised_warmup,
)
from rlserve.rl.train_forward import load_training_model
from rlserve.toy import make_model_dir


def test_advantages_are_normalised_per_group() -> None:
    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 10.0, 20.0, 30.0]])
    adv = group_advantages(rewards)
    assert torch.allclose(adv.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(adv.std(dim=1, unbiased=False), torch.ones(2), atol=1e-5)
    # Each group on its own: scaling one group's rewards leaves the other's advantages alone and its own unchanged.
    scaled = group_advantages(rewards * torch.tensor([[1.0], [0.5]]))
    assert torch.allclose(scaled, adv, atol=1e-6)
    assert torch.equal(adv[0], torch.tensor([-1.0, 1.0, 1.0, -1.0]))


def test_zero_variance_groups_have_zero_advantage() -> None:
    rewards = torch.tensor([[0.3, 0.3, 0.3], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    adv = group_advantages(rewards)
    assert torch.equal(adv[:2], torch.zeros(2, 3))
    assert adv[2].abs().sum() > 0
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(torch.ones(4))


def _logprob_setup() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, requires_grad=True)  # stands in for the model's output
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    advantages = torch.tensor([1.5, -0.5, 0.7])
    return logits, mask, advantages


def test_on_policy_ratio_is_one_and_gradient_is_the_policy_gradient() -> None:
    logits, mask, advantages = _logprob_setup()
    logprobs = torch.nn.functional.logsigmoid(logits)  # any differentiable logprobs
    loss, stats = clipped_policy_loss(logprobs, logprobs.detach(), advantages, mask)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    # REINFORCE with token-level normalisation: -sum(A * logp * mask) / num_tokens.
    reinforce = -(advantages[:, None] * logprobs * mask).sum() / mask.sum()
    (expected,) = torch.autograd.grad(reinforce, logits)
    assert torch.allclose(grad, expected, atol=1e-7)
    assert stats.ratio_mean == stats.ratio_min == stats.ratio_max == 1.0
    assert stats.clip_fraction == 0.0
    assert stats.num_tokens == 9


def test_clipping_engages_outside_the_trust_region() -> None:
    eps = 0.2
    behaviour = torch.zeros(1, 4)
    # Ratios: 1.5 (above 1 + eps), 0.5 (below 1 - eps), 1.1 (inside), 1.5 again.
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]])).requires_grad_(True)
    advantages = torch.tensor([[1.0, -1.0, 2.0, -1.0]])
    loss, stats = clipped_policy_loss(logprobs, behaviour, advantages, torch.ones(1, 4), clip_eps=eps)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # A > 0 and ratio > 1 + eps, or A < 0 and ratio < 1 - eps: the update would push further out, so no gradient.
    assert grad[0, 0] == 0.0 and grad[0, 1] == 0.0
    # Inside the region, or moving back towards it (A < 0 with ratio > 1 + eps): the gradient flows.
    assert grad[0, 2] != 0.0 and grad[0, 3] != 0.0
    assert stats.clip_fraction == pytest.approx(0.5)
    assert stats.ratio_max == pytest.approx(1.5) and stats.ratio_min == pytest.approx(0.5)
    # The clipped objective's value: min(r * A, clip(r) * A), averaged.
    expected = -(1.2 * 1.0 + 0.8 * -1.0 + 1.1 * 2.0 + 1.5 * -1.0) / 4
    assert loss.item() == pytest.approx(expected)


def test_k3_kl_is_zero_only_for_identical_logprobs() -> None:
    logprobs = torch.tensor([[-0.1, -2.0, -0.7], [-3.0, -0.01, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert k3_kl(logprobs, logprobs, mask) == 0.0
    shifted = logprobs + torch.tensor([[0.05, -0.05, 0.0], [0.0, 0.0, 0.0]])
    assert k3_kl(shifted, logprobs, mask) > 0.0
    assert k3_kl(logprobs - 0.3, logprobs, mask) > 0.0
    # Masked-out positions do not count.
    off_mask = logprobs.clone()
    off_mask[1, 2] += 5.0
    assert k3_kl(off_mask, logprobs, mask) == 0.0


def test_token_batch_aligns_completion_tokens_with_their_predictions() -> None:
    rollouts = [
        Rollout([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], [0, 0, 1], 1.0),
        Rollout([5, 6, 4], [3], [-0.4], [1], 0.0),
    ]
    batch = TokenBatch.from_rollouts(rollouts, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 4, 3, 0]]
    # Position t predicts token t + 1: the first completion token is predicted at the last prompt position.
    assert batch.mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    assert batch.targets[batch.mask.bool()].tolist() == [7, 8, 9, 3]
    assert batch.behaviour_logprobs[batch.mask.bool()].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert batch.versions.tolist() == [[-1, 0, 0, 1], [-1, -1, 1, -1]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("grpo") / "model", preset="tiny", seed=0)


@pytest.fixture
def tiny_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def test_policy_scores_each_token_under_the_version_that_sampled_it(tiny_model: torch.nn.Module) -> None:
    policy = Policy(tiny_model, GRPOConfig(lr=1e-2, keep_versions=2))
    prompt, completion = [10, 20, 30], [40, 50, 60]
    probe = TokenBatch.from_rollouts([Rollout(prompt, completion, [0.0] * 3, [0] * 3, 0.0)], pad_id=0)
    with torch.no_grad():
        v0 = policy.logprobs(probe)[probe.mask.bool()].tolist()

    # A step with a non-zero advantage changes the weights: version 1.
    policy.train_step(probe, torch.tensor([1.0]))
    assert policy.version == 1
    with torch.no_grad():
        v1 = policy.logprobs(probe)[probe.mask.bool()].tolist()
    assert v1 != pytest.approx(v0, abs=1e-4)

    # An engine that sampled the first two tokens under v0 and the last under v1 (an update mid-request) reported
    # exactly those logprobs: the mismatch is 0, though the current weights disagree with the first two.
    sampled = Rollout(prompt, completion, [v0[0], v0[1], v1[2]], [0, 0, 1], 1.0)
    batch = TokenBatch.from_rollouts([sampled], pad_id=0)
    current = policy.logprobs(batch)
    assert policy.mismatch_kl(batch, current) == pytest.approx(0.0, abs=1e-10)
    assert k3_kl(current.detach(), batch.behaviour_logprobs, batch.mask) > 1e-6

    # Snapshots older than keep_versions are dropped.
    for _ in range(3):
        fresh = Rollout(prompt, completion, [0.0] * 3, [policy.version] * 3, 0.0)
        policy.train_step(TokenBatch.from_rollouts([fresh], pad_id=0), torch.tensor([1.0]))
    with pytest.raises(KeyError, match="no longer kept"):
        policy.logprobs(batch, version=0)


def test_supervised_warmup_lowers_the_loss(tiny_model: torch.nn.Module) -> None:
    def example(rng) -> tuple[list[int], list[int]]:
        a = rng.randint(0, 9)
        return [a, 100], [a + 1, 200]

    losses = supervised_warmup(tiny_model, example, steps=30, pad_id=0, batch_size=16, seed=0)
    assert len(losses) == 30
    assert sum(losses[-5:]) < sum(losses[:5])


def test_a_batch_invariant_policy_trains_on_the_engines_bits(model_dir: Path, make_llm, generate) -> None:
    """rlserve's decoder in batch-invariant mode as the policy, against an engine in that mode: the one forward of a
    step scores every token exactly as the engine did (ratios of exactly 1, mismatch exactly 0), also for samples
    of an earlier version scored on its snapshot, and the weights it sends are the engine's checkpoint names."""
    llm = make_llm(model_dir, batch_invariant=True, logprobs_mode="processed_logprobs")
    policy = Policy(load_training_model(model_dir, batch_invariant=True), GRPOConfig(lr=1e-2, keep_versions=2))
    prompts = [[10, 20, 30], [5, 6, 7, 8, 9, 11, 12]]

    def sample(seed: int) -> list[Rollout]:
        params = [
            SamplingParams(temperature=1.0, seed=seed + i, max_tokens=6, logprobs=0, ignore_eos=True)
            for i in range(len(prompts))
        ]
        outputs = generate(llm, [{"prompt_token_ids": p} for p in prompts], params)
        rollouts = []
        for prompt, out in zip(prompts, outputs, strict=True):
            tokens = list(out.outputs[0].token_ids)
            logprobs = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
            rollouts.append(Rollout(prompt, tokens, logprobs, [policy.version] * len(tokens), 0.0))
        return rollouts

    first = sample(0)
    stats = policy.train_step(TokenBatch.from_rollouts(first, pad_id=0), torch.tensor([1.0, -1.0]))
    assert stats.mismatch_kl == 0.0 and stats.loss_stats.ratio_min == stats.loss_stats.ratio_max == 1.0
    assert stats.grad_norm > 0
    llm.load_weights(policy.named_weights())  # names like q_proj, not the decoder's fused qkv_proj
    mixed = TokenBatch.from_rollouts([*first, *sample(10)], pad_id=0)  # versions 0 and 1
    stats = policy.train_step(mixed, torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert stats.mismatch_kl == 0.0 and stats.loss_stats.ratio_min != stats.loss_stats.ratio_max
