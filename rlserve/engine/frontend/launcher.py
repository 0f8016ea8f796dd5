"""What starts an engine core in a process of its own (vLLM's EngineCoreProc), and the front end's handle on it.

Core processes are forked from a fork server that imported the engine once. `RLSERVE_ENABLE_MULTIPROCESSING=0` (or
vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING=0`) keeps the core in the caller's process instead, for debugging.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time
import types
from collections.abc import Iterator

from rlserve import vllm_surface
from rlserve.config import EngineConfig
from rlserve.engine.wire.auth import new_secret, private_ipc_address, remove_ipc_address
from rlserve.engine.wire.backends import registered_backends
from rlserve.engine.wire.process import process_age_s
from rlserve.engine.wire.startup import EXIT_PEER_LOST, EXIT_STEP_FAILED, CoreStartup

logger = logging.getLogger(__name__)

MULTIPROCESSING_ENVS = ("RLSERVE_ENABLE_MULTIPROCESSING", "VLLM_ENABLE_V1_MULTIPROCESSING")
STARTUP_TIMEOUT_S = 600.0  # loading a large model and sizing its KV cache on a busy machine
# Core processes are forked from a server process that imported the engine once: each starts in a fraction of the
# time a fresh interpreter takes, and none inherits the threads of the front end (which fork would copy badly).
_PRELOAD = ["rlserve.engine.core.fork_server_preload"]


def multiprocessing_enabled() -> bool:
    for name in MULTIPROCESSING_ENVS:
        value = os.environ.get(name)
        if value is not None:
            return value.strip().lower() not in ("0", "false", "no", "off")
    return True


def _fork_server_context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def start_fork_server() -> bool:
    """Start the fork server now, so that its imports (torch, the model code) run while the caller does its own
    start-up; the first engine core then forks from it without waiting for them. False if one was running."""
    _fork_server_context()
    running = _fork_server_pid() is not None
    with _main_module_hidden():
        multiprocessing.forkserver.ensure_running()
    return not running


def stop_fork_server() -> None:
    """Stop the fork server now, once every core forked from it has stopped. Left alone it exits only once its
    imports are done: a command that ended early (a usage error, a model that is not there) kept a process busy for
    seconds after it exited, and kept the pipes of its output open for as long."""
    pid = _fork_server_pid()
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # it ignores SIGTERM once it serves (fork_server_preload)
    with contextlib.suppress(ChildProcessError):
        multiprocessing.forkserver._forkserver._stop()  # reaps it, closes its pipe, removes its socket


def _fork_server_pid() -> int | None:
    return multiprocessing.forkserver._forkserver._forkserver_pid


class CoreProcess:
    """The front end's handle on an engine-core process: start it (returning at once: `wait_ready`), check it
    lives, stop it."""

    def __init__(
        self,
        config: EngineConfig,
        extra_backends: dict[str, str],
        *,
        address: str | None = None,
        lockstep_secret: str | None = None,
    ) -> None:
        """`address`: where the core listens (default: a private ipc socket; tcp:// is what a Ray core on another
        node does). `lockstep_secret`: the one secret of a lockstep group's ranks (dp_lockstep.py)."""
        # Imported here: it brings torch and the engine (seconds), and `rlserve serve` imports this module to start
        # the fork server before anything else, so that the fork server's imports run alongside its own.
        from rlserve.engine.core.main_loop import run_engine_core

        self.address = address if address is not None else private_ipc_address()
        self.secret = new_secret()
        context = _fork_server_context()
        reader, writer = context.Pipe(duplex=False)
        log_level = logging.getLogger("rlserve").getEffectiveLevel()
        startup = CoreStartup(
            config,
            self.address,
            os.getpid(),
            extra_backends,
            log_level,
            self.secret,
            lockstep_secret,
            vllm_surface.active(),
        )
        self.process = context.Process(
            target=run_engine_core, args=(startup, writer), name="rlserve-engine-core", daemon=True
        )
        self._started = time.monotonic()
        with _main_module_hidden():
            self.process.start()
        writer.close()
        self._ready_pipe = reader

    def wait_ready(self) -> None:
        """Block until the core serves (the caller does its own start-up meanwhile), or raise what stopped it."""
        reader, self._ready_pipe = self._ready_pipe, None
        if reader is None:
            return
        waited_from = time.monotonic()
        try:
            if not reader.poll(STARTUP_TIMEOUT_S):
                raise RuntimeError(f"the engine core did not start within {STARTUP_TIMEOUT_S:.0f} s")
            status, detail = reader.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(
                f"the engine-core process died while starting (exit code {self.process.exitcode})"
            ) from None
        except BaseException:
            self.shutdown()
            raise
        finally:
            reader.close()
        if status != "ready":
            self.process.join(10)
            raise startup_error(detail)
        logger.info(
            "engine core (pid %d) serving %.1f s after it was started (%.1f s of it building the engine; waited "
            "%.1f s for it); start-up: %.1f s after this process started",
            self.process.pid,
            time.monotonic() - self._started,
            detail,
            time.monotonic() - waited_from,
            process_age_s(),
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def death_reason(self) -> str:
        code = self.process.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        elif code == EXIT_STEP_FAILED:
            how = "an engine step failed; the traceback is in its log"
        elif code == EXIT_PEER_LOST:
            how = "a data-parallel peer it steps in lockstep with was gone"
        elif code == 0:
            return f"the engine-core process (pid {self.process.pid}) was stopped (SIGTERM)"
        else:
            how = f"exit code {code}"
        return f"the engine-core process (pid {self.process.pid}) died ({how})"

    @property
    def stopped(self) -> bool:
        """It exited as told (SIGTERM: a supervisor stopping the service), rather than crashing or being killed."""
        return self.process.exitcode == 0

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        remove_ipc_address(self.address)


def startup_error(detail: str) -> Exception:
    """The core's own message of why it did not start ("ValueError: model: ..."), as what it was where that is
    recognisable."""
    kind, _, message = detail.partition(": ")
    return ValueError(message) if kind == "ValueError" else RuntimeError(detail)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """multiprocessing re-imports the caller's main script in the child (to find pickled functions defined there).
    The core needs nothing from it, and re-running a user's script (one without an `if __name__ == "__main__"`
    guard builds another engine) or a `python -` stdin script (which cannot be re-read) breaks the start."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class ProcessLauncher:
    """`data_parallel_backend="mp"`: each core a child process of this one (forked from the fork server). The cores
    one launcher starts are one group: in lockstep their wave notices carry the group's secret."""

    def __init__(self) -> None:
        self.lockstep_secret = new_secret()

    def launch(self, config: EngineConfig) -> CoreProcess:
        return CoreProcess(config, registered_backends(config), lockstep_secret=self.lockstep_secret)

    @staticmethod
    def launch_one(config: EngineConfig) -> CoreProcess:
        """One core, in a group of its own (no lockstep peers)."""
        return CoreProcess(config, registered_backends(config))

    def shutdown(self) -> None:
        """Nothing of its own to stop: each core's client stops its process."""
