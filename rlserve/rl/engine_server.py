"""The engine side of an RL run driven over HTTP: `rlserve serve` with the RL API on, started and stopped by the
trainer in a subprocess of its own, and the trainer's clients for it."""

from __future__ import annotations

import asyncio
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

from rlserve.engine.frontend.args import engine_flags
from rlserve.engine.wire.process import free_port
from rlserve.rl.client import AsyncRLServeClient

ENGINE_START_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 300.0


def _stop_with_parent() -> None:
    """In the server's process before it runs: SIGTERM it when the process that started it dies, even by SIGKILL
    (where no `finally` runs), so that a killed trainer leaves no engine serving on."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class EngineServer:
    """`rlserve serve` in a subprocess on a free port of 127.0.0.1, with a random API key and the RL API on.

    A context manager: leaving it (normally, on an error, or on Ctrl-C) stops the process. The server runs in a
    session of its own, so a terminal's Ctrl-C reaches only the trainer, which then stops the server in order.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        log_path: str | Path,
        device: str = "cpu",
        backend: str = "nccl",
        threads: int | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.model_dir = str(model_dir)
        self.log_path = Path(log_path)
        self.device = device
        self.backend = backend
        self.threads = threads
        self.batch_invariant = batch_invariant
        self.port = free_port()
        self.api_key = secrets.token_hex(16)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> EngineServer:
        command = [
            sys.executable, "-m", "rlserve.cli", "serve", self.model_dir,
            "--host", "127.0.0.1", "--port", str(self.port), "--api-key", self.api_key, "--enable-rl-api",
            *engine_flags(
                weight_transfer_config={"backend": self.backend}, device=self.device, dtype="float32",
                # The logprobs of the distribution actually sampled: the behaviour policy of the importance ratio.
                logprobs_mode="processed_logprobs", batch_invariant=self.batch_invariant,
            ),
            # The engine's start-up facts and phases go to the log; uvicorn's line per request would bury them.
            "--log-level", "info", "--uvicorn-log-level", "warning",
        ]  # fmt: skip
        env = dict(os.environ)
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_stop_with_parent if sys.platform == "linux" else None,
            )
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    async def wait_ready(self, timeout: float = ENGINE_START_TIMEOUT_S) -> None:
        """Wait for /health; fail at once, with the server's log, if the process exits first."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.base_url, timeout=5.0) as http:
            while True:
                if self._proc is None or self._proc.poll() is not None:
                    code = None if self._proc is None else self._proc.returncode
                    raise RuntimeError(f"the engine exited (status {code}) before serving:\n{self.log_tail()}")
                try:
                    if (await http.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the engine did not serve within {timeout:g} s:\n{self.log_tail()}")
                await asyncio.sleep(0.2)

    def control(self) -> AsyncRLServeClient:
        return AsyncRLServeClient(self.base_url, api_key=self.api_key, timeout=HTTP_TIMEOUT_S)

    def http(self) -> httpx.AsyncClient:
        # Connection limits sized for many concurrent completions (httpx's default pool holds 100).
        return httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=HTTP_TIMEOUT_S,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
