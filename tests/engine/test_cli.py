"""End to end: `rlserve generate` in a fresh interpreter prints one JSON record per sample, matching HF greedy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlserve.toy import make_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "rlserve.cli", *args], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )


def test_generate_prints_greedy_json(qwen3_dir, hf) -> None:
    # One subprocess only: a fresh interpreter spends seconds importing torch and transformers.
    result = run_cli(
        "generate", "--model", str(qwen3_dir), "--prompt", "hi", "--max-tokens", "4",
        "--temperature", "0", "--ignore-eos", "--logprobs", "1", "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.strip().splitlines()
    record = json.loads(line)
    prompt_ids = make_tokenizer()("hi").input_ids
    assert record["prompt"] == "hi"
    assert record["finish_reason"] == "length"
    assert record["token_ids"] == hf.greedy(qwen3_dir, prompt_ids, 4)
    rows = hf.logits(qwen3_dir, prompt_ids + record["token_ids"])[1:-1].log_softmax(-1)
    expected = [float(rows[j, t]) for j, t in enumerate(record["token_ids"])]
    assert record["logprobs"] == pytest.approx(expected, abs=1e-4)
