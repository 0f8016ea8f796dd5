"""The engine core process of an `LLM` ends with it: on shutdown, on garbage collection, and when the process that
owns the LLM is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from process_tree import engine_core_pids, survivors

from rlserve import SamplingParams
from rlserve.engine.frontend.core_client import EngineDeadError

SCRIPT = """
import gc, os, sys, time
from rlserve import LLM
llm = LLM(sys.argv[1], num_kv_blocks=64)
print(llm.client.process.pid, flush=True)
if sys.argv[2] == "gc":
    del llm
    gc.collect()
    print("collected", flush=True)
time.sleep(60)
"""


def _start(model_dir, how: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(model_dir), how], stdout=subprocess.PIPE, text=True)
    core = int(proc.stdout.readline())
    return proc, core


def test_shutdown_stops_the_core_process(qwen3_dir, make_llm):
    llm = make_llm(qwen3_dir)
    (core,) = [p for p in engine_core_pids(os.getpid()) if p == llm.client.process.pid]
    llm.shutdown()
    assert not survivors([core])


def test_garbage_collection_stops_the_core_process(qwen3_dir):
    proc, core = _start(qwen3_dir, "gc")
    try:
        assert proc.stdout.readline().strip() == "collected"
        assert not survivors([core])
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_front_end_leaves_no_core_behind(qwen3_dir):
    proc, core = _start(qwen3_dir, "keep")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not survivors([core])


def test_a_failing_step_ends_every_request_with_the_reason(qwen3_dir, make_llm, monkeypatch):
    """A step that raises in the core process: the request in flight ends with EngineDeadError naming the failure,
    later calls too, and the core process is gone."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # the core imports tests/worker_extension
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    llm = make_llm(qwen3_dir, worker_extension_cls="worker_extension:CheckpointLoader")
    core = llm.client.process.pid
    llm.collective_rpc("break_forward")
    with pytest.raises(EngineDeadError, match="an engine step failed"):
        llm.generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(EngineDeadError):
        llm.is_sleeping()
    assert not survivors([core])
    llm.shutdown()
