"""A trainer-side HTTP client needs only httpx: importing it must not load torch or the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_client_import_loads_neither_torch_nor_the_engine() -> None:
    code = "import json, sys, rlserve.rl.client; print(json.dumps(sorted(sys.modules)))"
    # A fresh interpreter, since this one has imported torch long ago; the worktree's rlserve first, as in this run.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    loaded = set(json.loads(result.stdout))
    # A submodule never loads without its package, so the packages stand for everything below them.
    assert "torch" not in loaded
    assert "rlserve.engine" not in loaded
    assert "rlserve.rl.client" in loaded  # the import did happen in that interpreter
