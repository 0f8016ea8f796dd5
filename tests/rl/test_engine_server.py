"""The demo's engine server (`rlserve serve` in a subprocess) does not outlive the trainer that started it, even when
the trainer is SIGKILLed and no cleanup of its own runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from process_tree import descendants, survivors

TRAINER = """
import asyncio, sys, time
from rlserve.rl.engine_server import EngineServer

server = EngineServer(sys.argv[1], log_path=sys.argv[2])
server.__enter__()
asyncio.run(server.wait_ready())
print(server._proc.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_trainer_takes_its_engine_server_along(qwen3_dir: Path, tmp_path: Path) -> None:
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(qwen3_dir), str(tmp_path / "engine.log")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    engine: list[int] = []
    try:
        server_pid = int(trainer.stdout.readline())
        engine += [server_pid, *descendants(server_pid)]
        assert len(engine) >= 2  # the server and its engine core
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        assert survivors(engine, timeout=20) == [], (tmp_path / "engine.log").read_text()[-2000:]
    finally:
        trainer.kill()
        trainer.wait()
        for pid in survivors(engine, timeout=0):  # a failed run leaves no engine behind either
            os.kill(pid, signal.SIGKILL)
