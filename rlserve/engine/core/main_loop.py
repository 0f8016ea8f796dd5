"""The engine core's process (vLLM's EngineCoreProc): its main loop, which front ends talk to over ZMQ.

The core process binds one ROUTER socket; each front end (an `LLM`, an `AsyncLLM`, each API server process) connects
a DEALER and is told apart by its identity. The busy loop takes every queued message, steps, and sends each front end
the outputs of its own requests. The API event loop and output processing of the front ends never hold this
process's GIL, which is what lets the server run at the engine's speed. rlserve.engine.frontend.launcher starts it.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import msgspec
import zmq

from rlserve import vllm_surface
from rlserve.engine.core.dp_lockstep import LockstepLink, PeerLost, rendezvous_store
from rlserve.engine.wire.auth import require_secret
from rlserve.engine.wire.messages import Codec, EngineCoreOutput, EngineStatus, UtilityResult, pack_outputs
from rlserve.engine.wire.process import pid_alive, process_age_s
from rlserve.engine.wire.startup import EXIT_PEER_LOST, EXIT_STEP_FAILED, CoreStartup
from rlserve.log import configure_logging

if TYPE_CHECKING:
    from rlserve.engine.core.service import EngineCoreService

logger = logging.getLogger(__name__)

T = TypeVar("T")
RENDEZVOUS_FAILED = "data-parallel lockstep rendezvous failed: "

PARENT_CHECK_INTERVAL_S = 0.5


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
    # Here, not at the top: the front end imports this module (its process target) and needs none of the engine.
    from rlserve.engine.core.engine_core import EngineCore
    from rlserve.engine.core.service import EngineCoreService

    if stop is None:
        stop = _stop_on_sigterm()
    configure_logging(startup.log_level)
    if startup.vllm_surface:  # read where the worker extension is imported, here and in processes started from here
        os.environ[vllm_surface.ENV_VAR] = "1"
    started = time.monotonic()
    _log_fork_server_preload()
    config = startup.config
    _or_report(ready, "", lambda: _register_backends(startup.extra_backends))
    store = None
    if config.data_parallel_lockstep:  # waits for every rank: they start together
        store = _or_report(ready, RENDEZVOUS_FAILED, lambda: rendezvous_store(config))
    core = _or_report(ready, "", lambda: EngineCore(config, store))
    context = zmq.Context()
    link = None
    if store is not None:
        link = _or_report(ready, RENDEZVOUS_FAILED, lambda: LockstepLink(config, store, _lockstep_secret(startup)))
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
    try:
        _serve(service, socket, codec, link, stop, startup.parent_pid)
    finally:
        core.shutdown()
        if link is not None:
            link.close()
        socket.close(linger=0)
        authenticator.stop()
        context.term()


def _log_fork_server_preload() -> None:
    """The start-up timeline's line of a core forked from the fork server (not one a Ray actor or a thread runs)."""
    preload = sys.modules.get("rlserve.engine.core.fork_server_preload")
    if preload is not None:
        logger.info(
            "start-up: forked from the fork server, whose imports took %.1f s and ended %.1f s before this fork",
            preload.IMPORTS_S,
            time.time() - process_age_s() - preload.IMPORTS_ENDED,
        )


def _lockstep_secret(startup: CoreStartup) -> str:
    if startup.lockstep_secret is None:  # a launcher's bug: the ranks would accept anyone's wave notices
        raise ValueError("data-parallel lockstep: the launcher gave this rank no secret for its group's wave notices")
    return startup.lockstep_secret


def _stop_on_sigterm() -> threading.Event:
    """The event SIGTERM sets, in a process of the core's own."""
    # The front end handles Ctrl-C and shuts the core down; the core must not die half-way through a step first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    return stop


def _register_backends(extra_backends: dict[str, str]) -> None:
    from rlserve.weight_transfer import WeightTransferEngineFactory

    for name, path in extra_backends.items():
        if name not in WeightTransferEngineFactory.available_engines():
            WeightTransferEngineFactory.register_engine(name, path)


def _or_report(ready: multiprocessing.connection.Connection, prefix: str, build: Callable[[], T]) -> T:
    """What `build` returns; if it raises, the error goes to the front end as why the core did not start, and the
    process exits."""
    try:
        return build()
    except BaseException as e:
        ready.send(("error", f"{prefix}{type(e).__name__}: {e}"))
        raise SystemExit(1) from None


def _serve(
    service: EngineCoreService,
    socket: zmq.Socket,
    codec: Codec,
    link: LockstepLink | None,
    stop: threading.Event,
    parent_pid: int | None,
) -> None:
    """The busy loop: every queued message first (a front end's, a peer's wave notice), then one run of the service;
    until `stop`, a failed step (SystemExit), a lost lockstep peer (SystemExit) or the front end's death."""
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    if link is not None:  # a peer's wave notice wakes the loop as a front end's message does
        poller.register(link.socket, zmq.POLLIN)
    last_parent_check = time.monotonic()
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
            if parent_pid is not None and not pid_alive(parent_pid):
                logger.warning("the front-end process is gone; the engine core exits")
                return
