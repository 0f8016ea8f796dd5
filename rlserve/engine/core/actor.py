"""One engine core in a Ray actor (`data_parallel_backend="ray"`): the core's main loop on a thread of the actor,
started and stopped by rlserve.engine.frontend.ray_launcher."""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import replace
from typing import Any

from rlserve.engine.core.main_loop import run_engine_core
from rlserve.engine.wire.process import free_port
from rlserve.engine.wire.startup import CoreStartup


class _ReadyQueue:
    """The core's ready report (run_engine_core sends it down a pipe in a process of its own) kept for `wait_ready`."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, message: tuple[str, Any]) -> None:
        self.queue.put(message)

    def close(self) -> None:
        """Nothing to close: the queue lives as long as the actor."""


class EngineCoreActor:
    """One engine core in a Ray actor (threaded: `run` serves while `wait_ready` and `stop` answer)."""

    def __init__(self, startup: CoreStartup, front_end_node_id: str) -> None:
        import ray

        # The front end proposed an ipc address on its own node; on another node the core listens on TCP, on the
        # address the cluster knows this node by.
        node_id = ray.get_runtime_context().get_node_id()
        if node_id != front_end_node_id:
            host = next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id)
            startup = replace(startup, address=f"tcp://{_join_host(host)}:{free_port(host)}")
        self.startup = startup
        self._ready = _ReadyQueue()
        self._stop = threading.Event()

    def address(self) -> tuple[str, int]:
        """Where the core listens, and the actor's process id (for logs)."""
        return self.startup.address, os.getpid()

    def run(self) -> int:
        """Build the core and serve until `stop`; the exit code a core process would have had."""
        try:
            run_engine_core(self.startup, self._ready, self._stop)
        except SystemExit as e:  # how the core loop reports a failed start or step
            return e.code if isinstance(e.code, int) else 1
        return 0

    def wait_ready(self, timeout: float) -> tuple[str, Any]:
        """("ready", seconds to build) or ("error", why), as the core reported it."""
        try:
            return self._ready.queue.get(timeout=timeout)
        except queue.Empty:
            return "error", f"RuntimeError: the engine core did not start within {timeout:.0f} s"

    def stop(self) -> None:
        self._stop.set()


def _join_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
