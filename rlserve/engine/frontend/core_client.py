"""The front end's clients of the engine core: in a process of its own (the default) or in this process.

`LLM` uses a synchronous client, `AsyncLLM` an asyncio one; each comes in two transports with the same surface:
`add` and `abort` (fire and forget), `call(method, *args)` for control calls (a typed result or the core's error
raised again here), and the step outputs (pulled by `get_outputs` or pushed to `on_outputs`). If the core process
dies, everything pending fails with `EngineDeadError` within a second and every later call does too. With
`data_parallel_size` > 1 the clients of dp_client.py put several cores behind the same surface (`add`'s
`session_id` is their routing affinity; one core has nothing to route).
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from rlserve.config import EngineConfig
from rlserve.engine.frontend.launcher import ProcessLauncher
from rlserve.engine.wire.auth import present_secret
from rlserve.engine.wire.messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    Codec,
    EngineCoreOutput,
    EngineStatus,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    unpack_outputs,
)
from rlserve.engine.wire.process import pid_alive
from rlserve.engine.wire.tensors import pack_tensors

logger = logging.getLogger(__name__)

LIVENESS_INTERVAL_S = 0.2


class EngineDeadError(Exception):
    """The engine core is gone (its process died, or a step failed): nothing more can run on it."""


class RequestRefusedError(RuntimeError):
    """The engine core refused a request it cannot serve now (its weights are incomplete); the message says why and
    what makes it serve again. The engine itself is fine (a server answers 503)."""

    # The request's last output (each sample finished "abort", no token), as the front end that got the refusal
    # made it: a server ends a stream it had already begun with it.
    final_output: Any = None


class RequestIdInUseError(ValueError):
    """A request id that a request of this front end still holds (its stream is open, or the core has not ended it
    yet): the caller's conflict (a server answers 409)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request_id: {request_id!r} is already in use")
        self.request_id = request_id


class RetryableRequestError(RequestRefusedError):
    """vLLM 0.33's: a transient refusal, safe to retry as it is: generation is paused in mode abort or wait, which
    refuses new requests until resume rather than queueing them (a server answers 503 ServiceUnavailableError)."""


def refusal(error: str, retryable: bool) -> RequestRefusedError:
    return RetryableRequestError(error) if retryable else RequestRefusedError(error)


def raise_for(result: UtilityResult) -> Any:
    """The call's value, or its error raised again as the same built-in exception (a weight transfer's
    ConnectionError stays one); only names of builtins are looked up, never a class the message could pick."""
    if result.error_type is None:
        return result.value
    builtin = getattr(builtins, result.error_type, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception):
        try:
            error = builtin(result.error)
        except TypeError:  # one whose constructor takes more than a message (UnicodeDecodeError)
            error = None
        if error is not None:
            raise error
    raise RuntimeError(f"{result.error_type}: {result.error}")


def load_weights_args(client: Any, weights, reset_prefix_cache: bool) -> list[Any]:
    """The arguments of a load_weights call: the tensors themselves for a core in this process, packed as plain
    data (pack_tensors) for one in another."""
    if client.in_process:
        return [list(weights), reset_prefix_cache]
    return [pack_tensors(weights), reset_prefix_cache]


def collective_rpc_args(client: Any, method: Any, args: tuple, kwargs: dict | None) -> list[Any]:
    """The arguments of a collective_rpc call; a function can only go to a core in this process."""
    if callable(method) and not client.in_process:
        raise ValueError(
            "method: the engine core runs in its own process and takes no functions (nothing is pickled); name a "
            "method of a worker_extension_cls instead, or run in-process with RLSERVE_ENABLE_MULTIPROCESSING=0"
        )
    return [method, list(args), dict(kwargs or {})]


# ---- synchronous: LLM ----


class MPClient:
    """The core in a process of its own (started here by `launch`, by default a child process), over a ZMQ DEALER
    socket."""

    in_process = False

    def __init__(
        self, config: EngineConfig, launch: Callable[[EngineConfig], Any] = ProcessLauncher.launch_one
    ) -> None:
        self.process = launch(config)
        self.codec = Codec()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self._outputs: list[EngineCoreOutput] = []
        self._results: dict[int, UtilityResult] = {}
        self._ids = itertools.count(1)
        self.dead: str | None = None
        self.not_serving: str | None = None  # the core's EngineStatus, as last sent
        self.rejecting_new_requests = False

    def connect(self) -> dict[str, Any]:
        """Wait for the core to start (the process was started by the constructor) and ask what it is."""
        self.process.wait_ready()
        present_secret(self.socket, self.process.secret)
        self.socket.connect(self.process.address)  # known once it serves: a Ray actor picks its own
        return self.call("engine_info")

    def _send(self, message) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.socket.send(self.codec.encode(message), copy=False)

    def _receive(self) -> None:
        """Wait for one message (checking that the core lives) and file it."""
        while not self.socket.poll(int(LIVENESS_INTERVAL_S * 1000)):
            self.check_alive()
        self.read()

    def check_alive(self) -> None:
        if not self.process.is_alive():
            self.dead = self.process.death_reason()
            raise EngineDeadError(self.dead)

    def read(self) -> None:
        """File one message that the socket holds."""
        message = self.codec.output_decoder.decode(self.socket.recv(copy=False))
        if isinstance(message, StepOutputs):
            self._outputs += unpack_outputs(message)
        elif isinstance(message, EngineStatus):
            self.not_serving, self.rejecting_new_requests = message.not_serving, message.rejecting_new_requests
        else:
            self._results[message.call_id] = message

    def add(self, requests: list[AddRequest], session_id: str | None = None) -> None:
        self._send(AddRequests(requests))

    def abort(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(list(request_ids)))

    def start_call(self, method: str, *args: Any) -> int:
        """Send a control call; its result is filed under the returned id (see `result`)."""
        call_id = next(self._ids)
        self._send(UtilityCall(call_id, method, list(args)))
        return call_id

    def result(self, call_id: int) -> UtilityResult | None:
        """The result of a call `start_call` sent, once it has been read."""
        return self._results.pop(call_id, None)

    def call(self, method: str, *args: Any) -> Any:
        call_id = self.start_call(method, *args)
        while call_id not in self._results:
            self._receive()
        return raise_for(self._results.pop(call_id))

    def take_outputs(self) -> list[EngineCoreOutput]:
        """The outputs read so far (none waited for)."""
        outputs, self._outputs = self._outputs, []
        return outputs

    def get_outputs(self) -> list[EngineCoreOutput]:
        if not self._outputs:
            self._receive()
        return self.take_outputs()

    def shutdown(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
        self.process.shutdown()


# ---- asyncio: AsyncLLM and the API servers ----


class AsyncClientBase:
    """What both asyncio clients share: call ids, pending calls, the callbacks into the front end, and death."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_outputs: Callable[[list[EngineCoreOutput]], None] = lambda outputs: None
        self.on_dead: Callable[[str], None] = lambda reason: None
        self.dead: str | None = None
        self.not_serving: str | None = None  # the core's EngineStatus, as last sent (read by /health)
        self.rejecting_new_requests = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start delivering on `loop` (the first event loop that uses the engine)."""
        self.loop = loop

    def _set_status(self, status: EngineStatus) -> None:
        self.not_serving, self.rejecting_new_requests = status.not_serving, status.rejecting_new_requests

    def _file_result(self, result: UtilityResult) -> None:
        future = self._pending.pop(result.call_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def _die(self, reason: str, stopped: bool = False) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        # Pending calls fail either way; only a crash is an error in the log.
        logger.log(logging.WARNING if stopped else logging.ERROR, "%s", reason)
        self.fail_calls(EngineDeadError(reason))
        self.on_dead(reason)

    def fail_calls(self, error: BaseException) -> None:
        """Raise `error` to every caller waiting for a call's result; a result the core sends later finds none."""
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    async def call(self, method: str, *args: Any) -> Any:
        return raise_for(await self.call_raw(method, *args))

    async def call_raw(self, method: str, *args: Any) -> UtilityResult:
        """The call's result as the core sent it, its error not raised yet."""
        self._check_alive()
        call_id = next(self._ids)
        future = self._pending[call_id] = self.loop.create_future()
        self._send(UtilityCall(call_id, method, list(args)))
        return await future

    def add(self, requests: list[AddRequest], session_id: str | None = None) -> None:
        self._check_alive()
        self._send(AddRequests(requests))

    def abort(self, request_ids: list[str]) -> None:
        if self.dead is None:
            self._send(AbortRequests(list(request_ids)))

    def _send(self, message) -> None:
        raise NotImplementedError


class AsyncMPClient(AsyncClientBase):
    """The core in another process: started here (`config`, by `launch`), or already running (`address`, `pid` and
    the core's `secret`, as for the API server processes of `--api-server-count N`, which share one core)."""

    in_process = False

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        address: str | None = None,
        pid: int | None = None,
        secret: str | None = None,
        launch: Callable[[EngineConfig], Any] = ProcessLauncher.launch_one,
    ) -> None:
        super().__init__()
        self.process = launch(config) if config is not None else None
        self.address = address  # of a core started here: known once it serves (connect)
        self.pid = pid
        self.secret = secret if self.process is None else self.process.secret
        self.codec = Codec()
        self.context: zmq.asyncio.Context | None = None
        self.socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    def connect(self) -> dict[str, Any]:
        """Wait for the core to serve and ask what it is, on a plain socket: no event loop exists yet (the
        constructors of the front ends are synchronous)."""
        if self.process is not None:
            self.process.wait_ready()
            self.address = self.process.address
        with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
            socket.setsockopt(zmq.LINGER, 0)
            present_secret(socket, self.secret)
            socket.connect(self.address)
            socket.send(self.codec.encode(UtilityCall(0, "engine_info", [])))
            while True:
                while not socket.poll(int(LIVENESS_INTERVAL_S * 1000)):
                    if not self._core_alive():
                        raise EngineDeadError("the engine-core process died before answering")
                message = self.codec.output_decoder.decode(socket.recv())
                if isinstance(message, EngineStatus):  # the core greets each new socket with its status
                    self._set_status(message)
                else:
                    return raise_for(message)

    def _core_alive(self) -> bool:
        return self.process.is_alive() if self.process is not None else pid_alive(self.pid)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        super().bind(loop)
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        present_secret(self.socket, self.secret)
        self.socket.connect(self.address)
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch())]
        # A no-op that introduces this socket to the core, which answers with its status: an API server that has
        # sent nothing yet must still know, for /health, that generation is refused.
        self._send(AbortRequests([]))

    async def _read(self) -> None:
        decode = self.codec.output_decoder.decode
        while True:
            message = decode(await self.socket.recv(copy=False))
            if isinstance(message, StepOutputs):
                self.on_outputs(unpack_outputs(message))
            elif isinstance(message, EngineStatus):
                self._set_status(message)
            else:
                self._file_result(message)

    async def _watch(self) -> None:
        while self._core_alive():
            await asyncio.sleep(LIVENESS_INTERVAL_S)
        if self.process is not None:
            self._die(self.process.death_reason(), stopped=self.process.stopped)
        else:  # a core another process started: its exit status is not ours to read
            self._die(f"the engine core (pid {self.pid}) is gone")

    def _send(self, message) -> None:
        self.socket.send(self.codec.encode(message), copy=False)

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.socket is not None:
            self.socket.close(linger=0)
            self.context.term()
        if self.process is not None:
            self.process.shutdown()
