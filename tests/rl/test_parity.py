"""The parity tool: statistics on hand-made inputs, the trainer forwards against the engine, and the scenarios.

Models are tiny peaked Qwen3 toys in fp32 on CPU, where engine and trainer must agree to float noise (< 1e-4) unless a
scenario introduces a real difference (raw logprobs at temperature 0.7, KV reused across a weight update).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlserve import LLM
from rlserve.rl.parity import (
    SamplingSetup,
    load_trainer,
    make_peaked_model_dir,
    random_prompts,
    run_parity,
    sample_rollouts,
)
from rlserve.rl.train_forward import load_training_model
from rlserve.rl.trainer_logprobs import ParityStats, compare_logprobs, trainer_logprobs

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-4
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 3, 12, 8


@pytest.fixture(scope="module")
def peaked_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peaked_model_dir(tmp_path_factory.mktemp("parity") / "tiny", preset="tiny", seed=7)


@pytest.fixture(scope="module")
def prompts(peaked_dir: Path) -> list[list[int]]:
    return random_prompts(peaked_dir, NUM_PROMPTS, PROMPT_LEN, seed=3)


# ---- compare_logprobs on hand-made inputs ----


def test_identical_logprobs_give_no_mismatch() -> None:
    values = torch.tensor([[-0.1, -2.0, -5.0], [-0.7, -1.3, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    expected = ParityStats(0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 5)
    assert compare_logprobs(values, values.clone(), mask) == expected
    ragged = [[-0.1, -2.0, -5.0], torch.tensor([-0.7, -1.3])]
    assert compare_logprobs(ragged, ragged) == expected


def test_known_shift_gives_known_values() -> None:
    c = 0.2  # trainer = engine + c on every token: all ratios exp(c), equal, so the ESS is 1
    engine = torch.tensor([[-1.0, -2.0, -3.0, 123.0]])
    trainer = engine + c
    trainer[0, 3] = float("-inf")  # padding: the mask must keep it out
    stats = compare_logprobs(engine, trainer, torch.tensor([[True, True, True, False]]))
    assert stats.mean_abs_diff == pytest.approx(c)
    assert stats.max_abs_diff == pytest.approx(c)
    assert stats.k3_kl == pytest.approx(math.exp(c) - 1 - c)
    assert stats.mean_ratio == pytest.approx(math.exp(c))
    assert stats.frac_outside == 1.0  # exp(0.2) = 1.22
    assert stats.ess == pytest.approx(1.0)
    assert stats.num_tokens == 3

    # Ratios 1 and 2 (ragged): ESS = (1 + 2)^2 / (2 * (1 + 4)) = 0.9; k3 = (0 + (2 - 1 - log 2)) / 2.
    stats = compare_logprobs([[-1.0], [-3.0]], [[-1.0], [-3.0 + math.log(2)]])
    assert stats.ess == pytest.approx(0.9)
    assert stats.k3_kl == pytest.approx((1 - math.log(2)) / 2)
    assert stats.mean_ratio == pytest.approx(1.5)
    assert stats.frac_outside == 0.5
    assert stats.max_abs_diff == pytest.approx(math.log(2))


def test_compare_refuses_mismatched_or_empty_inputs() -> None:
    with pytest.raises(ValueError, match="layout"):
        compare_logprobs([[0.0, 0.0], [0.0]], [[0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="mask layout"):
        compare_logprobs(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2))
    with pytest.raises(ValueError, match="no tokens"):
        compare_logprobs(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))


# ---- the trainer forwards against the engine ----


@pytest.mark.parametrize(
    ("mode", "temperature", "top_k", "top_p"),
    [("raw_logprobs", 1.0, -1, 1.0), ("processed_logprobs", 0.7, 20, 0.9)],
)
def test_trainer_forwards_match_engine(peaked_dir, prompts, mode, temperature, top_k, top_p) -> None:
    """HF transformers and rlserve's training-mode forward reproduce the engine's logprobs of its own samples."""
    llm = LLM(str(peaked_dir), logprobs_mode=mode, num_kv_blocks=64)
    rollouts = sample_rollouts(llm, prompts, SamplingSetup(MAX_TOKENS, temperature, top_k, top_p), seed=5)
    processed = mode == "processed_logprobs"
    for trainer in ("hf", "rlserve"):
        model = load_trainer(peaked_dir, trainer, torch.float32, "cpu")
        with torch.no_grad():
            mine = trainer_logprobs(
                model, rollouts.prompt_ids, rollouts.completion_ids, temperature, top_k, top_p, processed
            )
        stats = compare_logprobs(rollouts.logprobs, mine)
        assert stats.num_tokens == NUM_PROMPTS * MAX_TOKENS
        assert stats.max_abs_diff < ATOL, (trainer, stats)


def test_training_forward_has_gradients(peaked_dir, prompts) -> None:
    model = load_training_model(peaked_dir)
    (logprobs,) = trainer_logprobs(model, prompts[:1], [[5, 6, 7]])
    logprobs.sum().backward()
    grad = model.model.layers[0].self_attn.qkv_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0


# ---- the scenarios ----


def test_raw_logprobs_disagree_with_the_sampled_distribution(peaked_dir, prompts) -> None:
    results = run_parity(peaked_dir, prompts, scenarios=["raw_vs_processed"], max_tokens=MAX_TOKENS, temperature=0.7)
    raw, processed = results["raw_vs_processed/raw"], results["raw_vs_processed/processed"]
    assert processed.max_abs_diff < ATOL, processed
    assert raw.mean_abs_diff > 0.05 and raw.k3_kl > 1e-3 and raw.frac_outside > 0.2, raw


def test_prefix_cache_across_a_weight_update(peaked_dir, prompts) -> None:
    """Stale prefix KV after an update shows a mismatch; rlserve's default (reset on update) and no caching do not."""
    results = run_parity(peaked_dir, prompts, scenarios=["prefix_cache"], max_tokens=MAX_TOKENS, trainer="rlserve")
    assert set(results) == {"prefix_cache/reset", "prefix_cache/off", "prefix_cache/stale"}
    for name in ("prefix_cache/reset", "prefix_cache/off"):
        assert results[name].max_abs_diff < ATOL, (name, results[name])
    stale = results["prefix_cache/stale"]
    assert stale.mean_abs_diff > 1e-2 and stale.k3_kl > 1e-4, stale


def test_batch_invariant_engine_equals_its_trainer_forward_exactly(peaked_dir, prompts) -> None:
    results = run_parity(peaked_dir, prompts, scenarios=["batch_invariant"], max_tokens=MAX_TOKENS, temperature=0.7)
    stats = results["batch_invariant"]
    assert stats.num_tokens == NUM_PROMPTS * MAX_TOKENS
    assert stats.max_abs_diff == 0.0 and stats.k3_kl == 0.0, stats


def test_cli_prints_the_table(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["OMP_NUM_THREADS"] = "1"  # a fresh interpreter on a shared 2-core box: oversubscription costs several x
    env["TMPDIR"] = str(tmp_path / "tmp")  # where the model it builds goes, and must be gone from at exit
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "parity.json"
    result = subprocess.run(
        [sys.executable, "-m", "rlserve.cli", "parity", "--num-prompts", "2", "--max-tokens", "8", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any("x16" in line and "peaked" in line for line in lines)
    # A progress line per scenario, with its time.
    assert [line.split()[0] for line in lines if line.startswith("[")] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    header = next(i for i, line in enumerate(lines) if line.startswith("scenario"))
    for column in ("engine", "reference", "mean|Δ|", "max|Δ|", "k3 KL", "mean ratio", "outside [0.9,1.1]", "ESS"):
        assert column in lines[header]
    expected = {
        "raw_vs_processed/raw",
        "raw_vs_processed/processed",
        "lm_head/bf16",
        "lm_head/fp32",
        "prefix_cache/reset",
        "prefix_cache/off",
        "prefix_cache/stale",
        "batch_invariant",
    }
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1 :] if line.split()[0] in expected}
    assert set(rows) == expected
    # The dtypes each side really used: an fp32 engine, but bf16 for the lm_head rows.
    assert rows["raw_vs_processed/processed"][:2] == ["fp32", "hf-fp32"]
    assert rows["lm_head/bf16"][0] == "bf16" and rows["lm_head/fp32"][0] == "bf16+fp32-head"
    assert rows["batch_invariant"][:2] == ["fp32", "rlserve-bi-fp32"]
    assert float(rows["batch_invariant"][3]) == 0.0  # max|Δ|
    assert all(int(r[-3]) == 2 * 8 for r in rows.values())
    # What each row should show, and that it does: fp32 against fp32 is ~0, the demonstrated gaps are not.
    verdicts = {name: tuple(r[-2:]) for name, r in rows.items()}
    assert verdicts["raw_vs_processed/processed"] == verdicts["prefix_cache/reset"] == ("~0", "yes")
    assert verdicts["raw_vs_processed/raw"] == verdicts["prefix_cache/stale"] == (">0", "yes")
    assert verdicts["batch_invariant"] == ("=0", "yes") and verdicts["lm_head/bf16"] == ("?", "-")
    assert set(json.loads(out.read_text())["results"]) == expected
    assert [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")] == []


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peaked_model_dir(tmp_path_factory.mktemp("parity-moe") / "tiny-moe", preset="tiny-moe", seed=7)


def test_moe_replay_removes_the_routing_mismatch(moe_dir, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A bf16 MoE engine against rlserve's fp32 forward: routing flips by the roundings give large per-token gaps,
    which replaying the engine's routed experts removes (what is left is bf16 rounding)."""
    moe_prompts = random_prompts(moe_dir, 4, PROMPT_LEN, seed=3)
    results = run_parity(moe_dir, moe_prompts, scenarios=["moe_replay"], max_tokens=16, temperature=0.7)
    off, on = results["moe_replay/off"], results["moe_replay/on"]
    assert off.num_tokens == on.num_tokens == 4 * 16
    assert on.max_abs_diff < off.max_abs_diff / 2 and on.k3_kl < off.k3_kl / 2, (on, off)
    assert off.max_abs_diff > 0.1 and on.max_abs_diff < 0.1, (on, off)
    with pytest.raises(ValueError, match="moe_replay needs a MoE model"):
        run_parity(make_peaked_model_dir(tmp_path_factory.mktemp("dense") / "tiny", preset="tiny"), moe_prompts,
                   scenarios=["moe_replay"])  # fmt: skip


def test_batch_invariant_moe_engine_equals_its_trainer_forward_exactly(moe_dir) -> None:
    moe_prompts = random_prompts(moe_dir, NUM_PROMPTS, PROMPT_LEN, seed=4)
    stats = run_parity(moe_dir, moe_prompts, scenarios=["batch_invariant"], max_tokens=MAX_TOKENS)["batch_invariant"]
    assert stats.num_tokens == NUM_PROMPTS * MAX_TOKENS
    assert stats.max_abs_diff == 0.0 and stats.k3_kl == 0.0, stats


def test_fp8_rows_show_the_fp8_gap_and_no_drift_across_updates(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The fp8 scenario: a bf16 engine with FP8 projections against the fp32 trainer, as loaded and after ten
    updates it quantized itself (ending at the trainer's weights), which must be the same rollouts and numbers."""
    model = make_peaked_model_dir(tmp_path_factory.mktemp("parity-fp8") / "tiny-fp8", preset="tiny-fp8", seed=7)
    prompts = random_prompts(model, NUM_PROMPTS, PROMPT_LEN, seed=3)
    results = run_parity(model, prompts, scenarios=["fp8"], max_tokens=MAX_TOKENS, temperature=1.0)
    assert set(results) == {"fp8/load", "fp8/10_updates"}
    loaded = results["fp8/load"]
    assert loaded.num_tokens == NUM_PROMPTS * MAX_TOKENS
    # FP8 rounding on the x16 toy: a real gap (bf16 alone is ~0.03 here), yet a fraction of a nat.
    assert 0.02 < loaded.mean_abs_diff < 0.5 and loaded.k3_kl > 0, loaded
    assert results["fp8/10_updates"] == loaded  # requantizing what was sent leaves no drift
