"""Tensor parallel: ranks 1..N-1 of an engine core, each a process with a ModelRunner of its own (nano-vllm's design).

Rank 0 is the engine core's own runner: it schedules, samples and talks to the front ends. The other ranks follow.
For each step rank 0 sends a `StepHeader` of sizes over the rank's pipe and broadcasts the step's inputs (token ids,
positions, slots, block tables, lengths) as one tensor over the tensor-parallel group, so a follower never sees a
request. Calls that change a rank's state (sleep, weight updates, snapshots, checksums, collective_rpc) travel as
(name, args) over the pipe and answer with a result or an error, which rank 0 raises.

Followers are started with subprocess, a fresh interpreter each: the engine-core process is daemonic, and
multiprocessing does not let a daemonic process have children. Each exits when its pipe closes or rank 0's process
is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch.distributed import TCPStore

from rlserve.config import EngineConfig, WeightTransferConfig
from rlserve.engine.wire.backends import registered_backends
from rlserve.engine.wire.process import COLLECTIVE_TIMEOUT, pid_alive
from rlserve.engine.wire.profiling import profiling_enabled
from rlserve.engine.worker.extension import call as call_worker
from rlserve.engine.worker.extension import make_worker
from rlserve.engine.worker.model_runner import ModelRunner
from rlserve.engine.worker.tracing import TraceProfiler, trace_name
from rlserve.log import configure_logging
from rlserve.model.parallel import TensorParallelGroup, serve_store, store_client

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 600.0  # a collective (a step, the start-up) may wait this long for a slow rank
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0
PARENT_CHECK_INTERVAL_S = 0.5
STORE_ADDRESS = "127.0.0.1"  # the ranks of one engine core share a host
# Errors a follower's call may raise that rank 0 re-raises as the same type (the engine tells them apart: a
# TRAINER_LOST one abandons a weight update, a ValueError is the caller's mistake); any other is a RuntimeError.
_ERROR_TYPES = {cls.__name__: cls for cls in (ValueError, RuntimeError, ConnectionError, TimeoutError)}


@dataclass(frozen=True)
class FollowerStartup:
    config: EngineConfig  # the rank's own: its device
    rank: int
    store_port: int
    parent_pid: int
    log_level: int
    extra_backends: dict[str, str]  # weight-transfer backends registered by class (wire.backends.registered_backends)


def rank_device(config: EngineConfig, rank: int) -> str:
    """Rank `rank`'s device: the GPU `rank` places after rank 0's on CUDA, the same host on CPU."""
    if not config.device.startswith("cuda"):
        return config.device
    first = torch.device(config.device).index or 0
    return f"cuda:{first + rank}"


def create_runner(config: EngineConfig, dp_store: TCPStore | None = None) -> ModelRunner:
    """Rank 0's runner; under tensor parallelism it starts the followers first (they build their parts of the model
    in step with it) and waits until each is ready. Under expert parallelism (no tensor parallelism) it joins the
    expert-parallel group of the data-parallel ranks over their store, `dp_store`."""
    size = config.tensor_parallel_size
    if config.enable_expert_parallel:
        if dp_store is None:
            raise ValueError("enable_expert_parallel: needs the data-parallel ranks' store (lockstep engine cores)")
        ep = TensorParallelGroup.join(
            dp_store,
            config.data_parallel_rank,
            config.data_parallel_size,
            COLLECTIVE_TIMEOUT.total_seconds(),  # a step's exchange waits for a peer busy with a control call
            deterministic=config.batch_invariant,
            prefix="rlserve/ep",
        )
        try:
            return ModelRunner(config, ep=ep)
        except BaseException:
            ep.shutdown()
            raise
    if size == 1:
        return ModelRunner(config)
    store = serve_store(STORE_ADDRESS, GROUP_TIMEOUT_S)
    tp = TensorParallelGroup.join(store, 0, size, GROUP_TIMEOUT_S, deterministic=config.batch_invariant)
    followers = TPWorkers(config, store)
    try:
        runner = ModelRunner(config, tp, followers)
        followers.wait_ready()
    except BaseException:
        followers.shutdown(graceful=False)  # they may still be starting: nothing of theirs is worth waiting for
        tp.shutdown()
        raise
    return runner


class _Follower:
    """A process of rank 1..N-1 of an engine core: a `ModelRunner` run by rank 0's messages."""

    def __init__(self, startup: FollowerStartup, runner: ModelRunner) -> None:
        self.rank = startup.rank
        self.config = startup.config
        self.runner = runner
        # start_profile/stop_profile reach this rank too: a trace of its own process (worker/tracing.py)
        self.profiler = None
        if profiling_enabled(self.config):
            self.profiler = TraceProfiler(self.config.profiler_config, runner.device)
        self.transfer = None  # this rank's weight-transfer backend, which its worker's extension may drive
        self.worker = make_worker(runner, startup.config.worker_extension_cls, self)
        self.worker.rank = self.worker.local_rank = startup.rank
        self.snapshot: dict[str, torch.Tensor] | None = None
        self._transfer_init: threading.Thread | None = None
        self._transfer_error: BaseException | None = None

    def serve(self, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # rank 0 is gone
                return
            name, args = message
            if name == "follow_step":
                # No answer: a failing step ends the process, and rank 0's next collective reports the lost peer.
                self.runner.follow_step(*args)
                continue
            if name == "shutdown":
                return
            try:
                reply = ("ok", self.calls[name](self, *args))
            except BaseException as e:  # noqa: BLE001 (every failure goes back to rank 0)
                reply = ("error", type(e).__name__, str(e))
            conn.send(reply)

    # ---- the calls rank 0 mirrors (ModelRunner.mirrored) ----

    def snapshot_weights(self) -> None:
        self.snapshot = self.runner.snapshot_weights(self.snapshot)

    def restore_weights(self) -> None:
        self.runner.restore_weights(self.snapshot)

    def full_checkpoint_weights(self) -> None:
        for _ in self.runner.full_checkpoint_weights():  # the collectives are the point; rank 0 checksums
            pass

    def collective_rpc(self, method: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        with self.runner.on_device():
            return call_worker(self.worker, method, tuple(args), dict(kwargs))

    def init_weight_transfer(
        self, config: WeightTransferConfig, init_info: dict, first_index: int, timeout_s: float
    ) -> None:
        """Join the trainer's group as this rank's worker (index `first_index` + rank: rank 0's is `first_index`),
        on a thread: the rendezvous waits for rank 0 and the trainer, and rank 0's steps must go on meanwhile. Its
        outcome is checked by the next transfer call."""
        from rlserve.weight_transfer import WeightTransferEngineFactory

        self.close_weight_transfer()
        index = first_index + self.rank
        transfer = WeightTransferEngineFactory.create_engine(
            config, self.runner.device, index, timeout_s, model=self.runner.model, model_config=self.runner.config
        )
        parsed = transfer.parse_init_info(init_info)

        def init() -> None:
            try:
                transfer.init_transfer_engine(parsed)
            except BaseException as e:  # noqa: BLE001 (reported by the next transfer call)
                self._transfer_error = e

        self.transfer, self._transfer_error = transfer, None
        self._transfer_init = threading.Thread(target=init, name="rlserve-tp-transfer-init", daemon=True)
        self._transfer_init.start()

    def _joined_transfer(self):
        if self._transfer_init is not None:
            self._transfer_init.join()
            self._transfer_init = None
        if self._transfer_error is not None:
            error, self._transfer_error, self.transfer = self._transfer_error, None, None
            raise RuntimeError(f"tensor-parallel rank {self.rank} could not join the trainer's group: {error}")
        if self.transfer is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} has no weight transfer engine")
        return self.transfer

    def receive_weights(self, update_info: dict, accepted: bool) -> None:
        """This rank's end of an update rank 0 accepted (keep its part of every tensor) or refused (take delivery and
        drop it, so the trainer's broadcast completes)."""
        transfer = self._joined_transfer()
        info = transfer.parse_update_info(update_info)
        with self.runner.on_device():
            if accepted:
                transfer.receive(info, self.runner.load_weights)
            else:
                transfer.discard_weights(info)
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)

    def close_weight_transfer(self) -> None:
        if self._transfer_init is not None:
            self._transfer_init.join()
            self._transfer_init = None
        if self.transfer is not None:
            self.transfer.shutdown()
        self.transfer, self._transfer_error = None, None

    def start_profile(self, prefix: str | None, overrides: dict[str, Any] | None) -> None:
        self.profiler.start(trace_name(self.config, self.rank, prefix), overrides)

    def stop_profile(self) -> str:
        return self.profiler.stop()

    def stop_tracing(self) -> None:
        """At the end of the process: the trace so far is written, as rank 0 writes its own."""
        if self.profiler is not None and self.profiler.running:
            logger.info("profile trace written: %s", self.profiler.stop())

    calls = {
        "start_profile": start_profile,
        "stop_profile": stop_profile,
        "release_kv_cache": lambda self: self.runner.release_kv_cache(),
        "execute_dummy_batch": lambda self: self.runner.execute_dummy_batch(),
        "release_weights": lambda self, keep: self.runner.release_weights(keep),
        "restore": lambda self, weights, kv_cache: self.runner.restore(weights, kv_cache),
        "receive_broadcast_weights": lambda self, metas: self.runner.receive_broadcast_weights(metas),
        "snapshot_weights": snapshot_weights,
        "restore_weights": restore_weights,
        "full_checkpoint_weights": full_checkpoint_weights,
        "collective_rpc": collective_rpc,
        "init_weight_transfer": init_weight_transfer,
        "receive_weights": receive_weights,
        "close_weight_transfer": close_weight_transfer,
    }


class TPWorkers:
    """Rank 0's handle on its followers: their processes and pipes. `send` for steps (no answer), `mirrored` for
    calls. A lock keeps each exchange whole: the weight-transfer rendezvous calls from a thread of the core."""

    def __init__(self, config: EngineConfig, store: TCPStore) -> None:
        self.store = store  # served by this process: it must outlive the group
        self._lock = threading.Lock()
        self.conns: list[Connection] = []
        self.processes: list[subprocess.Popen] = []
        log_level = logging.getLogger("rlserve").getEffectiveLevel()
        extra_backends = registered_backends(config)
        # This process's import path, so that what it imports (a worker extension beside a script) imports there.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            for rank in range(1, config.tensor_parallel_size):
                ours, theirs = socket.socketpair()
                rank_config = replace(config, device=rank_device(config, rank))
                startup = FollowerStartup(rank_config, rank, store.port, os.getpid(), log_level, extra_backends)
                process = subprocess.Popen(
                    [sys.executable, "-m", "rlserve.engine.worker.tp_workers", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    env=env,
                )
                theirs.close()
                self.processes.append(process)
                conn = Connection(ours.detach())
                self.conns.append(conn)
                conn.send(startup)
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, (conn, process) in enumerate(zip(self.conns, self.processes, strict=True), start=1):
            while not conn.poll(PARENT_CHECK_INTERVAL_S):
                if process.poll() is not None:
                    code = process.returncode
                    raise RuntimeError(f"tensor-parallel rank {rank} died while starting (exit code {code})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start within {STARTUP_TIMEOUT_S:.0f} s")
            status, detail = conn.recv()
            if status != "ready":
                kind, _, message = detail.partition(": ")
                raise (ValueError if kind == "ValueError" else RuntimeError)(
                    message if kind == "ValueError" else f"tensor-parallel rank {rank}: {detail}"
                )

    def send(self, name: str, *args: Any) -> None:
        with self._lock:
            self._send_all(name, args)

    def _send_all(self, name: str, args: tuple) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((name, args))
            except OSError as e:  # its process died (its exit ends the pipe)
                raise RuntimeError(f"tensor-parallel rank {rank} is gone: {e}") from e

    @contextlib.contextmanager
    def mirrored(self, name: str, *args: Any) -> Iterator[list[Any]]:
        results: list[Any] = []
        with self._lock:
            self._send_all(name, args)
            try:
                yield results
            except BaseException:
                self._collect()  # the followers' answers must be read before the next exchange
                raise
            results.extend(self._collect(raise_errors=True))

    def _collect(self, raise_errors: bool = False) -> list[Any]:
        values, error = [], None
        for rank, conn in enumerate(self.conns, start=1):
            try:
                reply = conn.recv()
            except (EOFError, OSError) as e:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone ({type(e).__name__})") from e
            if reply[0] == "ok":
                values.append(reply[1])
            elif error is None:
                kind, message = reply[1], reply[2]
                cls = _ERROR_TYPES.get(kind, RuntimeError)
                error = cls(message if cls is not RuntimeError or kind == "RuntimeError" else f"{kind}: {message}")
                logger.error("tensor-parallel rank %d: %s: %s", rank, kind, message)
        if error is not None and raise_errors:
            raise error
        return values

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the followers: told to (they leave their groups) or, not `graceful`, terminated."""
        for conn in self.conns if graceful else ():
            with contextlib.suppress(OSError):
                conn.send(("shutdown", ()))
        for process in self.processes if not graceful else ():
            process.terminate()
        for process in self.processes:
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)
        for conn in self.conns:
            conn.close()
        self.conns, self.processes = [], []


def _exit_with(parent_pid: int) -> None:
    while pid_alive(parent_pid):
        time.sleep(PARENT_CHECK_INTERVAL_S)
    os._exit(0)  # rank 0 is gone: nothing will ever drive this rank again


def main(fd: int) -> int:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end handles Ctrl-C and stops rank 0, which stops us
    conn = Connection(fd)
    startup: FollowerStartup = conn.recv()
    configure_logging(startup.log_level)
    threading.Thread(target=_exit_with, args=(startup.parent_pid,), daemon=True).start()
    config = startup.config
    if config.device.startswith("cuda"):  # NCCL and the Triton kernels use the current device
        torch.cuda.set_device(torch.device(config.device))
    try:
        from rlserve.weight_transfer import WeightTransferEngineFactory

        for name, path in startup.extra_backends.items():
            WeightTransferEngineFactory.register_engine(name, path)
        store = store_client(STORE_ADDRESS, startup.store_port, GROUP_TIMEOUT_S)
        size = config.tensor_parallel_size
        tp = TensorParallelGroup.join(store, startup.rank, size, GROUP_TIMEOUT_S, deterministic=config.batch_invariant)
        follower = _Follower(startup, ModelRunner(config, tp))
    except BaseException as e:  # noqa: BLE001 (reported to rank 0, which raises it)
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return 1
    conn.send(("ready", None))
    try:
        follower.serve(conn)
    finally:
        follower.stop_tracing()
        follower.close_weight_transfer()
        tp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
