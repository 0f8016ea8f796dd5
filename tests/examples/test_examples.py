"""The examples run as written (as scripts, in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(name: str, *args: str) -> str:
    """Run an example with a TMPDIR of its own, and check that it leaves nothing there but torch's compile cache
    (torchinductor_<user>, shared by every run by design)."""
    with tempfile.TemporaryDirectory() as tmpdir:
        result = subprocess.run(
            [sys.executable, str(EXAMPLES / name), *args],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env={**os.environ, "TMPDIR": tmpdir},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert [p for p in os.listdir(tmpdir) if not p.startswith("torchinductor_")] == [], f"{name} left these"
    return result.stdout


def test_custom_weight_transfer_backend_receives_an_update():
    out = _run("custom_weight_transfer.py")
    before, after = (line.split(":", 1)[1] for line in out.splitlines()[:2])
    assert "{'file-1'}" in after
    assert before.strip() != after.split("(")[0].strip()


def test_http_control_drives_a_server_through_an_update():
    out = _run("http_control.py")
    assert "versions: {'step-1'}" in out
    assert "server weight version: step-1" in out


def test_exact_logprobs_equal_bit_for_bit_across_an_update():
    out = _run("exact_logprobs.py")
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["step 0", "step 1"]
    assert all("max |engine - trainer| = 0.0," in line and "mean ratio = 1.0" in line for line in lines[:2])
    assert lines[2].endswith(": True")
