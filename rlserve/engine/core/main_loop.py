"""The engine core in a process of its own (vLLM's EngineCoreProc): front ends talk to it over ZMQ.

The core process binds one ROUTER socket; each front end (an `LLM`, an `AsyncLLM`, each API server process) connects
a DEALER and is told apart by its identity. The busy loop takes every queued message, steps, and sends each front end
the outputs of its own requests. The API event loop and output processing of the front ends never hold this
process's GIL, which is what lets the server run at the engine's speed.

`RLSERVE_ENABLE_MULTIPROCESSING=0` (or vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING=0`) keeps the core in the caller's
process instead, for debugging.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import zmq

from rlserve.config import EngineConfig
from rlserve.engine.core.dp_lockstep import LockstepLink, PeerLost, rendezvous_store
from rlserve.engine.wire.auth import new_secret, private_ipc_address, remove_ipc_address, require_secret
from rlserve.engine.wire.messages import Codec, EngineCoreOutput, EngineStatus, UtilityResult, pack_outputs
from rlserve.log import configure_logging

logger = logging.getLogger(__name__)

MULTIPROCESSING_ENVS = ("RLSERVE_ENABLE_MULTIPROCESSING", "VLLM_ENABLE_V1_MULTIPROCESSING")
STARTUP_TIMEOUT_S = 600.0  # loading a large model and sizing its KV cache on a busy machine
PARENT_CHECK_INTERVAL_S = 0.5
EXIT_STEP_FAILED = 3  # an engine step raised: its requests were ended, the traceback is in the core's log
EXIT_PEER_LOST = 4  # data-parallel lockstep: a peer rank left (stopped or died) while this one needed it
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


def start_fork_server() -> None:
    """Start the fork server now, so that its imports (torch, the model code) run while the caller does its own
    start-up; the first engine core then forks from it without waiting for them."""
    _fork_server_context()
    with _main_module_hidden():
        multiprocessing.forkserver.ensure_running()


@dataclass(frozen=True)
class CoreStartup:
    """What the core process needs to start, passed to it by value."""

    config: EngineConfig
    address: str
    parent_pid: int | None  # the front end's, watched by the core; None for a Ray actor (Ray stops it with its owner)
    # Weight-transfer backends the front end registered by class ({name: "module:Class"}); the core registers them
    # too, so a backend registered before the engine was created works as in one process.
    extra_backends: dict[str, str]
    log_level: int  # the front end's, for rlserve's loggers: what it logs, the core logs too
    secret: str  # what every front end presents in its socket's handshake (core_auth.py)


class _SocketTransport:
    in_process = False

    def __init__(self, socket: zmq.Socket, codec: Codec) -> None:
        self.socket = socket
        self.codec = codec

    def send_outputs(self, client: bytes, outputs: list[EngineCoreOutput]) -> None:
        self.socket.send_multipart((client, self.codec.encode(pack_outputs(outputs))), copy=False)

    def send_result(self, client: bytes, result: UtilityResult) -> None:
        try:
            message = self.codec.encode(result)
        except (TypeError, ValueError, OverflowError) as e:  # a call's result must not take the core down
            logger.exception("the result of a control call cannot be sent")
            failed = UtilityResult(result.call_id, None, "ValueError", f"result: the engine core cannot send it: {e}")
            message = self.codec.encode(failed)
        self.socket.send_multipart((client, message), copy=False)

    def send_status(self, client: bytes, status: EngineStatus) -> None:
        self.socket.send_multipart((client, self.codec.encode(status)), copy=False)


def run_engine_core(
    startup: CoreStartup, ready: multiprocessing.connection.Connection, stop: threading.Event | None = None
) -> None:
    """The core process's main: build the engine, report ready (or the error) to `ready` (a pipe's end, or anything
    with its send and close), serve until told to stop: by SIGTERM, or by `stop` where the caller owns the process (a
    Ray actor runs this on a thread of its own)."""
    from rlserve.engine.core.engine_core import EngineCore
    from rlserve.engine.core.service import EngineCoreService
    from rlserve.weight_transfer import WeightTransferEngineFactory

    if stop is None:
        # The front end handles Ctrl-C and shuts the core down; the core must not die half-way through a step first.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    configure_logging(startup.log_level)
    started = time.monotonic()
    try:
        for name, path in startup.extra_backends.items():
            if name not in WeightTransferEngineFactory.available_engines():
                WeightTransferEngineFactory.register_engine(name, path)
    except BaseException as e:
        ready.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    store = None
    if startup.config.data_parallel_lockstep:
        try:  # waits for every rank: they start together
            store = rendezvous_store(startup.config)
        except BaseException as e:
            ready.send(("error", f"data-parallel lockstep rendezvous failed: {type(e).__name__}: {e}"))
            raise SystemExit(1) from None
    try:
        core = EngineCore(startup.config, store)
    except BaseException as e:
        ready.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    context = zmq.Context()
    link = None
    if store is not None:
        try:
            link = LockstepLink(startup.config, context, store)
        except BaseException as e:
            ready.send(("error", f"data-parallel lockstep rendezvous failed: {type(e).__name__}: {e}"))
            raise SystemExit(1) from None
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a front end that left must not block the core
    authenticator = require_secret(context, socket, startup.secret)
    socket.bind(startup.address)
    codec = Codec()
    service = EngineCoreService(core, _SocketTransport(socket, codec), link)
    # The start-up heap (torch, the model) lives as long as the process, yet every full collection walked it:
    # 0.3-0.4 s stalls of the step loop on an H200, inside pauses and weight syncs. Frozen, collections skip it.
    gc.collect()
    gc.freeze()
    ready.send(("ready", time.monotonic() - started))
    ready.close()
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    if link is not None:  # a peer's wave notice wakes the loop as a front end's message does
        poller.register(link.socket, zmq.POLLIN)
    last_parent_check = time.monotonic()
    try:
        while not stop.is_set():
            timeout = int(service.input_timeout_s() * 1000)
            while ready_sockets := dict(poller.poll(timeout)):
                if link is not None and link.socket in ready_sockets:
                    service.wave.wave_started(link.receive())
                if socket in ready_sockets:
                    client, payload = socket.recv_multipart(copy=True)
                    try:
                        message = codec.input_decoder.decode(payload)
                    except (msgspec.DecodeError, ValueError):  # a front end's bug must not take the core down
                        logger.exception("dropped a message the engine core cannot read")
                    else:
                        service.handle(client, message)
                timeout = 0
            try:
                service.run_once()
            except PeerLost as e:  # in the wave's all-gather: on a shutdown the ranks stop one after another
                logger.warning("a data-parallel peer left (%s); this engine core exits", e)
                raise SystemExit(EXIT_PEER_LOST) from None
            if service.failure is not None:
                raise SystemExit(EXIT_STEP_FAILED)
            now = time.monotonic()
            if now - last_parent_check > PARENT_CHECK_INTERVAL_S:
                last_parent_check = now
                # The front end died without shutting us down (a Ray actor's owner is watched by Ray instead).
                if startup.parent_pid is not None and not pid_alive(startup.parent_pid):
                    logger.warning("the front-end process is gone; the engine core exits")
                    break
    finally:
        core.shutdown()
        if link is not None:
            link.close()
        socket.close(linger=0)
        authenticator.stop()
        context.term()


class CoreProcess:
    """The front end's handle on an engine-core process: start it (returning at once: `wait_ready`), check it
    lives, stop it."""

    def __init__(self, config: EngineConfig, extra_backends: dict[str, str]) -> None:
        self.address = private_ipc_address()
        self.secret = new_secret()
        context = _fork_server_context()
        reader, writer = context.Pipe(duplex=False)
        log_level = logging.getLogger("rlserve").getEffectiveLevel()
        startup = CoreStartup(config, self.address, os.getpid(), extra_backends, log_level, self.secret)
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
            "%.1f s for it)",
            self.process.pid,
            time.monotonic() - self._started,
            detail,
            time.monotonic() - waited_from,
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


def pid_alive(pid: int) -> bool:
    """For front ends that did not start the core (API server processes): the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
