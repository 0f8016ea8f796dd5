"""`rlserve demo` and `examples/async_grpo.py` end to end: real processes, a real server, real weight transfers."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

from rlserve.rl.demo import EXIT_NO_IMPROVEMENT, StepRecord, improvement_margin, summarize, verdict
from rlserve.rl.tasks import AdditionTask, Problem

REPO = Path(__file__).resolve().parents[2]
# Small enough for a few seconds of RL; the warm-up is cut too, since these tests check plumbing, not learning.
SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--warmup-steps", "5"]
TIMEOUT_S = 180


def test_reward_is_exact_with_partial_credit() -> None:
    problem = Problem("7+8=", "15")
    assert AdditionTask.reward(problem, "15", "stop") == 1.0
    assert AdditionTask.reward(problem, "15+", "length") == 0.5  # the right number that did not stop
    assert AdditionTask.reward(problem, "15", "length") == 0.5
    assert AdditionTask.reward(problem, "150", "length") == 0.0  # a different number
    assert AdditionTask.reward(problem, "14", "stop") == 0.0
    assert AdditionTask.reward(problem, "", "stop") == 0.0
    assert AdditionTask().max_completion_tokens == 3  # "18" and end of text


def _record(step: int, reward: float, groups: int = 32) -> StepRecord:
    return StepRecord(
        step=step, reward=reward, weight_version=step, lag_mean=1.0, lag_max=1, sync_ms=1.0, pause_ms=2.0,
        sync_phases_ms={}, mismatch_kl=0.0, ratio_mean=1.0, ratio_min=1.0, ratio_max=1.0, clip_fraction=0.0, loss=0.0,
        grad_norm=0.0,
        num_groups=groups, num_samples=groups * 8, num_dropped=0, wait_ms=0.0, train_ms=0.0,
    )  # fmt: skip


def test_verdict_compares_first_and_last_steps_against_the_margin() -> None:
    assert improvement_margin(96, 96) == pytest.approx(0.1443, abs=1e-4)
    rising = summarize([_record(i, 0.2 + 0.05 * i) for i in range(1, 11)])
    assert rising["window"] == 3
    assert rising["start_reward"] == pytest.approx(0.3) and rising["end_reward"] == pytest.approx(0.65)
    assert rising["reward_rose"]
    flat = summarize([_record(i, 0.4 + 0.01 * (i % 2)) for i in range(1, 11)])
    assert not flat["reward_rose"]
    # Two steps of few groups: one-step windows, and a margin too wide for noise to pass.
    short = summarize([_record(1, 0.2, groups=4), _record(2, 0.5, groups=4)])
    assert short["window"] == 1 and short["margin"] > 0.5 and not short["reward_rose"]
    # The verdict says what was required and what was measured, whichever way it went.
    assert "a change of +0.350; a rise counts when it exceeds 0.144" in verdict(rising)
    assert verdict(rising).endswith("PASS: the reward rose")
    assert f"NOT SHOWN: no rise beyond noise; exit status {EXIT_NO_IMPROVEMENT}" in verdict(flat)
    assert "a change of +0.300" in verdict(short) and "too few steps to tell" in verdict(short)


def _assert_port_closed(url: str) -> None:
    parsed = urlparse(url)
    with pytest.raises(OSError), socket.create_connection((parsed.hostname, parsed.port), timeout=2):
        pass


# The whole run of `rlserve demo` (every step's record, the plot, the table, the engine's log, the port closed) is
# checked on the README's run of it, as written: tests/test_readme.py::test_readme_demo.


def test_ctrl_c_stops_the_engine(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlserve.cli", "demo", "--steps", "10000", *SMALL, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    seen = []
    try:
        for line in proc.stdout:  # wait for the second row: the engine is up and updates are flowing
            seen.append(line)
            if line.split()[:1] == ["2"]:
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(seen) + rest
    assert proc.returncode == 130, output
    assert "interrupted" in rest
    log = json.loads((out / "log.json").read_text())  # written on the way out, with the steps done so far
    assert len(log["steps"]) >= 2
    _assert_port_closed(log["summary"]["engine_url"])


def test_async_grpo_example(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "async_grpo.py"), "--steps", "2", *SMALL],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 2: reward" in proc.stdout
    assert "engine weight version: 2" in proc.stdout
