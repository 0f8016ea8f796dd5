"""`rlserve serve MODEL`: the engine core in its own process (one per rank with `--data-parallel-size`), and one or
more API server processes in front of it.

With `--api-server-count 1` (the default) this process is the API server and starts the cores itself. With N > 1 it
starts the cores, binds the port once and hands the listening socket to N API server processes, each a client of
every core (vLLM's layout; each routes by the requests it has in flight); it then only supervises: if a core or an
API server dies, the others are stopped and the command exits non-zero. If a core dies, every pending request fails
with 503 within a second, `/health` answers 503, and the server exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rlserve.dtypes import dtype_name
from rlserve.engine.frontend.args import EngineArgs
from rlserve.engine.frontend.async_llm import AsyncLLM, EngineDeadError, start_shared_cores
from rlserve.engine.wire.process import process_age_s
from rlserve.log import configure_logging
from rlserve.model.loader import load_hf_config, resolve_dtype
from rlserve.server.app import build_app
from rlserve.server.errors import APIError
from rlserve.server.http_protocol import header_timeout_protocol
from rlserve.server.metrics import MULTIPROC_DIR_ENV
from rlserve.server.pipelinerl_group import start_pipelinerl_join
from rlserve.server.serve_flags import DEV_MODE_ENV, RL_API_KEY_ENV, add_serve_parser, api_keys, rl_api_keys

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

# How long a server whose engine died keeps answering (503) before it exits: long enough for a client or an
# orchestrator polling /health to see why.
DEAD_ENGINE_GRACE_S = 1.0
EXIT_ENGINE_DEAD = 1


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound once (and shared by the API server processes). Made with the protocol number
    that getaddrinfo gives: asyncio sets TCP_NODELAY only on connections of a socket whose proto is IPPROTO_TCP,
    and without it Nagle's algorithm and delayed ACKs held every small response ~40 ms."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = info[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(config: uvicorn.Config) -> uvicorn.Server:
    """uvicorn's Server, except that SIGTERM and SIGINT are a requested stop that returns: uvicorn raises the signal
    again once it has shut down, which killed the process (exit -15) before the engine was shut down."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)


async def compose_app(engine: AsyncLLM, args: argparse.Namespace) -> FastAPI:
    """The app `rlserve serve` serves over `engine` for its parsed flags: the routes and keys, PipelineRL's group
    join started, the --lora-modules loaded (an APIError naming the module that fails)."""
    rl_api_keyed = args.rl_api_auth == "key"
    if args.enable_rl_api and rl_api_keyed and not rl_api_keys(args):
        logger.warning(
            "the RL routes accept the --api-key keys: any /v1 client may pause the engine and overwrite its weights; "
            "give the control plane a key of its own with --rl-api-key (or $%s)",
            RL_API_KEY_ENV,
        )
    app = build_app(
        engine,
        api_keys(args),
        args.enable_rl_api,
        args.served_model_name,
        rl_api_keyed=rl_api_keyed,
        rl_api_key=rl_api_keys(args),
        defaults=args.serving_defaults,
        allowed_weight_dirs=args.allowed_weight_dirs,
        bound_host=args.host,
        runtime_lora_updating=args.runtime_lora_updating,
        allowed_rendezvous_hosts=args.allowed_rendezvous_hosts,
    )
    if args.enable_rl_api:
        start_pipelinerl_join(engine, args, app.state.frameworks)
    for module in args.lora_modules:
        name, path, base = module["name"], module["path"], module["base_model_name"]
        try:
            await app.state.lora_adapters.load(name, path, base_model_name=base)
        except APIError as e:
            raise APIError(e.code, f"--lora-modules {name}: {e.message}", e.param) from e
    return app


async def _serve_until_engine_dies(engine: AsyncLLM, args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    try:
        app = await compose_app(engine, args)
    except APIError as e:
        logger.error("%s", e.message)
        return 1
    log_level = args.uvicorn_log_level or args.log_level
    config = uvicorn.Config(
        app,
        http=header_timeout_protocol(args.header_timeout_s),
        log_level=log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=args.keep_alive_timeout_s,
    )
    await _log_start_up(engine, args)
    server = _uvicorn_server(config)
    # The start-up heap (torch, transformers, the tokenizer) is live for the whole process, yet every full
    # collection walked it: 0.3-0.4 s stalls of the event loop on an H200, inside pauses and weight syncs. Frozen,
    # collections see only what serving allocates.
    gc.collect()
    gc.freeze()
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    streams_ended = False
    while not serving.done():
        if server.should_exit and not streams_ended:
            # uvicorn waits (timeout_graceful_shutdown) for responses to end, then cancels them (a traceback each):
            # end the streams now, each with an error event and [DONE], queued and kept-paused requests included,
            # and answer the calls still waiting for the core with 503; the engine stops after.
            streams_ended = True
            shutting_down = EngineDeadError("the server is shutting down")
            engine.fail_streams(shutting_down)
            engine.fail_calls(shutting_down)
        try:
            await engine.check_health()
        except EngineDeadError:
            stopping = server.should_exit  # told to stop too (SIGTERM to the process group): an orderly stop
            await asyncio.sleep(DEAD_ENGINE_GRACE_S)
            server.should_exit = True
            await serving
            return 0 if stopping else EXIT_ENGINE_DEAD
        await asyncio.wait({serving}, timeout=0.2)
    await serving
    return 0


async def _log_start_up(engine: AsyncLLM, args: argparse.Namespace) -> None:
    """One line with what an operator checks first: which model, where, in what dtype, how much KV cache, and where
    to send requests."""
    config = engine.config
    dtype = dtype_name(resolve_dtype(config.dtype, load_hf_config(config.model)))
    stats = await engine.stats()
    blocks = stats["kv_cache_blocks"]
    host = f"[{args.host}]" if ":" in args.host else args.host
    name = args.served_model_name[0]
    logger.info(
        "serving %s on %s in %s: KV cache %d blocks x %d tokens (%d tokens), max model len %d; "
        "http://%s:%d/v1 (API: /docs); start-up: %.1f s after the process started",
        name if name == config.model else f"{name} ({config.model})",
        config.device,
        dtype,
        blocks,
        config.block_size,
        blocks * config.block_size,
        engine.max_model_len,
        host,
        args.port,
        process_age_s(),
    )


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (as uvicorn and vLLM choose): streaming a token per chunk to a
    thousand clients is mostly event-loop and socket work, which uvloop does in C."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _core_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's keywords, with the weight directories the routes allow: the core checks them again itself."""
    return EngineArgs.from_cli_args(args).kwargs


def _run_api_server(
    args: argparse.Namespace, sock: socket.socket, shared_cores: list[tuple[str, int, str]] | None
) -> int:
    engine = AsyncLLM(args.model, shared_cores=shared_cores, **_core_kwargs(args))
    try:
        with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
            return runner.run(_serve_until_engine_dies(engine, args, sock))
    finally:
        engine.shutdown()


def _api_server_process(
    args: argparse.Namespace, sock: socket.socket, shared_cores: list[tuple[str, int, str]]
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops us with SIGTERM
    configure_logging(args.log_level)
    sys.exit(_run_api_server(args, sock, shared_cores))


def _supervise(args: argparse.Namespace, sock: socket.socket) -> int:
    """Start the cores (one per data-parallel rank) and args.api_server_count API servers, each a client of every
    core; return when one of them ends (or on SIGTERM)."""
    cores = start_shared_cores(args.model, **_core_kwargs(args))
    shared = [(core.address, core.pid, core.secret) for core in cores]
    context = multiprocessing.get_context("spawn")
    servers = [
        context.Process(target=_api_server_process, args=(args, sock, shared), name=f"rlserve-api-{i}", daemon=True)
        for i in range(args.api_server_count)
    ]
    stop = False

    def on_signal(signum, frame) -> None:
        nonlocal stop
        stop = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    # Every API server writes its request metrics here and sums all of them on /metrics (prometheus_client's
    # multiprocess mode): a scrape that lands on any one of them counts every request once. A fresh directory per
    # run, whatever the environment says: series left by an earlier run would be summed in.
    metrics_dir = tempfile.TemporaryDirectory(prefix="rlserve-metrics-")
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir.name  # spawned children copy the environment as they start
    try:
        for server in servers:
            server.start()
        del os.environ[MULTIPROC_DIR_ENV]
        sentinels = [core.process.sentinel for core in cores] + [s.sentinel for s in servers]
        while not stop and not multiprocessing.connection.wait(sentinels, timeout=0.2):
            pass
        if stop:
            return 0
        dead_cores = [core for core in cores if not core.is_alive()]
        if dead_cores:
            logger.error("%s", dead_cores[0].death_reason())
            # The API servers see it too, answer 503 for a moment and exit; then we do.
            for server in servers:
                server.join(DEAD_ENGINE_GRACE_S + 5)
            return EXIT_ENGINE_DEAD
        dead = [s for s in servers if not s.is_alive()]
        logger.error("API server %s exited (code %s); stopping", dead[0].name, dead[0].exitcode)
        return 1
    finally:
        for server in servers:
            if server.is_alive():
                server.terminate()
        for server in servers:
            server.join(10)
        for core in cores:
            core.shutdown()
        os.environ.pop(MULTIPROC_DIR_ENV, None)
        metrics_dir.cleanup()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _warn_at_start(args: argparse.Namespace) -> None:
    """What the flags turned on that an operator must not miss (the checks in serve_flags have run)."""
    if args.enable_rl_api and args.rl_api_auth == "none":
        why = f"{DEV_MODE_ENV}=1" if os.environ.get(DEV_MODE_ENV) == "1" else "--rl-api-auth none"
        logger.warning(
            "RL routes (pause, weight updates, sleep) are served WITHOUT an API key on %s (%s): anyone who can reach "
            "it can stop generation and overwrite the model",
            args.host,
            why,
        )
    for flag, reason in getattr(args, "vllm_no_op_flags", {}).items():  # absent when none was given
        logger.warning("%s: accepted, no effect: %s", flag, reason)
    defaults = args.serving_defaults
    if defaults.sampling:
        logger.warning("request defaults from --generation-config %s: %s", args.generation_config, defaults.sampling)


def cmd_serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    logger.info("start-up: the front end's imports ended %.1f s after the process started", process_age_s())
    _warn_at_start(args)
    if args.api_server_count < 1:
        print("rlserve serve: --api-server-count must be >= 1", file=sys.stderr)
        return 2
    sock = _listening_socket(args.host, args.port)
    # SIGTERM stops as Ctrl-C does: uvicorn shuts down in order and passes the signal on, which then raises
    # KeyboardInterrupt through the `finally`s (the core stopped, its socket and multiprocessing's temp directory
    # removed) instead of ending the process where it stands.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.api_server_count == 1:
            return _run_api_server(args, sock, None)
        return _supervise(args, sock)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while the engine starts, before uvicorn serves: a stop
        return 0
    finally:
        sock.close()


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    add_serve_parser(subparsers).set_defaults(func=cmd_serve)
