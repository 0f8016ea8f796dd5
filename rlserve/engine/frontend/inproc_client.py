"""The engine core in the caller's process (RLSERVE_ENABLE_MULTIPROCESSING=0, for debugging and for tests of the
core's internals), behind the surface of the clients in core_client.py: driven by the caller's thread (`LLM`) or
on a thread of its own (`AsyncLLM`). The front end's one import of the core object itself."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Any

from rlserve.config import EngineConfig
from rlserve.engine.core.engine_core import EngineCore
from rlserve.engine.core.service import EngineCoreService
from rlserve.engine.frontend.core_client import AsyncClientBase, EngineDeadError, raise_for
from rlserve.engine.wire.messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    EngineCoreOutput,
    EngineStatus,
    UtilityCall,
    UtilityResult,
)

IN_PROCESS = b"in-process"  # the one front end of a core in this process


class InprocClient:
    """The core in this process, driven by the caller's thread."""

    in_process = True

    def __init__(self, config: EngineConfig) -> None:
        self.service = EngineCoreService(EngineCore(config), self)
        self._outputs: list[EngineCoreOutput] = []
        self._results: dict[int, UtilityResult] = {}
        self._ids = itertools.count(1)
        self.not_serving: str | None = None  # the core's EngineStatus, as last sent
        self.rejecting_new_requests = False

    def connect(self) -> dict[str, Any]:
        return self.call("engine_info")

    def send_outputs(self, client, outputs: list[EngineCoreOutput]) -> None:
        self._outputs += outputs

    def send_result(self, client, result: UtilityResult) -> None:
        self._results[result.call_id] = result

    def send_status(self, client, status: EngineStatus) -> None:
        self.not_serving, self.rejecting_new_requests = status.not_serving, status.rejecting_new_requests

    def add(self, requests: list[AddRequest], session_id: str | None = None) -> None:
        self.service.handle(IN_PROCESS, AddRequests(requests))

    def abort(self, request_ids: list[str]) -> None:
        self.service.handle(IN_PROCESS, AbortRequests(list(request_ids)))

    def call(self, method: str, *args: Any) -> Any:
        call_id = next(self._ids)
        self.service.handle(IN_PROCESS, UtilityCall(call_id, method, list(args)))
        while call_id not in self._results:
            self.service.run_once()
            if not self.service.core.has_work():  # waiting on a thread (a rendezvous): do not spin
                time.sleep(0.001)
        return raise_for(self._results.pop(call_id))

    def get_outputs(self) -> list[EngineCoreOutput]:
        if not self._outputs:
            self.service.run_once()
            if self.service.failure is not None:
                raise EngineDeadError(f"an engine step failed: {self.service.failure!r}")
        outputs, self._outputs = self._outputs, []
        return outputs

    def shutdown(self) -> None:
        self.service.core.shutdown()


class AsyncInprocClient(AsyncClientBase):
    """The core in this process, on a thread of its own: the event loop never waits on a step."""

    in_process = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.service = EngineCoreService(EngineCore(config), self)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rlserve-engine-core", daemon=True)
        self._thread.start()

    def connect(self) -> dict[str, Any]:
        return self.service.engine_info(IN_PROCESS, None)

    def _serve(self) -> None:
        service = self.service
        while not self._stopped.is_set():
            timeout = service.input_timeout_s()
            try:
                message = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
            except queue.Empty:
                message = None
            if message is not None:
                service.handle(IN_PROCESS, message)
                continue  # take every queued message before the next step
            service.run_once()
            if service.failure is not None and self.loop is not None:
                reason = f"an engine step failed: {service.failure!r}"
                self.loop.call_soon_threadsafe(self._die, reason)
                return

    def send_outputs(self, client, outputs: list[EngineCoreOutput]) -> None:
        self.loop.call_soon_threadsafe(self.on_outputs, outputs)

    def send_result(self, client, result: UtilityResult) -> None:
        self.loop.call_soon_threadsafe(self._file_result, result)

    def send_status(self, client, status: EngineStatus) -> None:
        # The first message may come before any event loop used the engine (a status has no caller to wait).
        if self.loop is None:
            self._set_status(status)
        else:
            self.loop.call_soon_threadsafe(self._set_status, status)

    def _send(self, message) -> None:
        self._inbox.put(message)

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)
        self.service.core.shutdown()
