"""The engine core process of an `LLM` ends with it: on shutdown, on garbage collection, and when the process that
owns the LLM is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from process_tree import engine_core_pids, survivors

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
