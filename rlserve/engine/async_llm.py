"""AsyncLLM: the asyncio front end. The engine core runs in one background thread; the event loop never waits on it.

Everything that touches the core (adding and aborting requests, stepping, pausing, weight updates) runs on the core
thread in order, so a weight update can never overlap a forward pass. Outputs come back to the event loop through
`call_soon_threadsafe`, in order, which is what makes "abort ends the streams before pause returns" hold.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from rlserve.engine.core import EngineCore, EngineCoreOutput, resolve_pause_mode
from rlserve.engine.llm import EngineFrontEnd, PromptType, ValidatedPrompt, _field
from rlserve.outputs import RequestOutput
from rlserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long pause waits for the streams it ended to be read by their consumers (a consumer that went away must not
# hold pause forever).
STREAM_DRAIN_TIMEOUT_S = 5.0


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class AsyncLLM(EngineFrontEnd):
    def __init__(self, model: str, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.model_name = model
        self._ids = itertools.count()
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wait_pauses: list[tuple[Callable[[], None], bool]] = []  # (resolve, clear_cache) for pause(mode="wait")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self.error: BaseException | None = None  # set when a step failed; the engine then refuses new work
        self._thread = threading.Thread(target=self._core_loop, name="rlserve-engine-core", daemon=True)
        self._thread.start()

    # ---- the core thread ----

    def _core_loop(self) -> None:
        core = self.engine_core
        while not self._stopped.is_set():
            try:
                block = not core.has_work() and not self._wait_pauses
                command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
            except queue.Empty:
                command = None
            if command is not None:
                command()
                continue  # take every queued command before the next step
            if core.has_work():
                try:
                    outputs = core.step()
                except BaseException as e:  # a failing forward must reach the callers, not kill the thread silently
                    logger.exception("engine step failed")
                    self.error = e
                    outputs = core.abort_requests(list(core.requests))
                self._deliver(outputs)
            if self._wait_pauses and core.num_in_flight == 0:
                self._end_wait_pauses(clear_cache=True)

    def _end_wait_pauses(self, clear_cache: bool) -> None:
        """Return every pending pause(mode="wait"); clear the cache first if one asked and `clear_cache` allows."""
        pauses, self._wait_pauses = self._wait_pauses, []
        if clear_cache and any(clear for _, clear in pauses):
            self.engine_core.clear_cache()
        for resolve, _ in pauses:
            resolve()

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_core_outputs, outputs)

    async def _call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run fn(core) on the core thread between steps and return its result (or raise its exception)."""
        loop = self._bind_loop()
        future = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine_core)
            except BaseException as e:
                loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(command)
        return await future

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM is bound to another event loop")
        return loop

    # ---- the event loop ----

    def _on_core_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        results, to_abort = self.output_processor.process(outputs)
        for out in results:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)
        if to_abort:
            self._commands.put(lambda: self.engine_core.abort_requests(to_abort))

    async def generate(
        self,
        prompt: PromptType | ValidatedPrompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (cumulative by default; set sampling_params.output_kind for deltas).
        A prompt from `validate_prompt` is queued as it is, with the params it was checked with."""
        self._bind_loop()
        if self.error is not None:
            raise RuntimeError(f"the engine failed earlier: {self.error!r}")
        if not isinstance(prompt, ValidatedPrompt):
            prompt = self.validate_prompt(prompt, sampling_params or SamplingParams())
        elif sampling_params is not None and sampling_params is not prompt.params:
            raise ValueError("sampling_params: a validated prompt carries the params it was checked with")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        stream = self._streams[request_id] = _Stream()
        ids = prompt.token_ids
        children = self.output_processor.add_request(request_id, prompt.text, ids, prompt.params)

        def add(core: EngineCore) -> None:
            for child_id, child_params in children:
                core.add_request(child_id, ids, child_params)

        try:
            await self._call(add)
            while True:
                out: RequestOutput = await stream.queue.get()
                yield out
                if out.finished:
                    break
        finally:
            self._streams.pop(request_id, None)
            stream.done.set()
            if request_id in self.output_processor.states:  # the consumer left early: stop the work
                self.output_processor.abort(request_id)
                child_ids = [c for c, _ in children]
                self._commands.put(lambda: self.engine_core.abort_requests(child_ids))

    async def abort(self, request_id: str | list[str]) -> None:
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        child_ids = [c for rid in request_ids for c in self.output_processor.child_ids(rid)]
        # The core's outputs first: they carry tokens it held back for final-only requests.
        self._on_core_outputs(await self._call(lambda core: core.abort_requests(child_ids)))
        for rid in request_ids:
            out = self.output_processor.abort(rid)
            stream = self._streams.get(rid)
            if out is not None and stream is not None:
                stream.queue.put_nowait(out)

    # ---- pause / resume ----

    async def pause_generation(
        self, *, mode: str = "abort", clear_cache: bool = True, wait_for_inflight_requests: bool | None = None
    ) -> None:
        """abort: end the requests in flight, return once their streams have their last output. wait: admit nothing
        new, return when the requests in flight have finished (then clear the cache if asked) or when a resume ends
        the pause first (the cache is then left as it is). keep: freeze everything where it is."""
        mode = resolve_pause_mode(mode, wait_for_inflight_requests)
        affected = [s for s in self._streams.values()]
        if mode == "wait":
            loop = self._bind_loop()
            done = loop.create_future()

            def start_wait(core: EngineCore) -> None:
                core.pause("wait", clear_cache=False)
                self._wait_pauses.append((lambda: loop.call_soon_threadsafe(_set_result, done, None), clear_cache))

            await self._call(start_wait)
            await done
        else:
            outputs = await self._call(lambda core: core.pause(mode, clear_cache))
            self._on_core_outputs(outputs)
        if mode != "keep":
            # Streams that this pause ended are read to their end before pause returns.
            pending = [s.done.wait() for s in affected if not s.done.is_set() and s.queue.qsize()]
            if pending:
                await asyncio.wait([asyncio.ensure_future(p) for p in pending], timeout=STREAM_DRAIN_TIMEOUT_S)

    async def resume_generation(self) -> None:
        def resume(core: EngineCore) -> None:
            core.resume()
            # A pause(mode="wait") still waiting for its requests is over: it returns now rather than when the
            # traffic admitted after this resume happens to drain, which under steady load is never.
            self._end_wait_pauses(clear_cache=False)

        await self._call(resume)

    async def is_paused(self) -> bool:
        return self.engine_core.is_paused()

    # ---- sleep / wake ----

    async def sleep(self, level: int = 1) -> None:
        """Free device memory for a colocated trainer (see EngineCore.sleep); requests wait until wake_up."""
        await self._call(lambda core: core.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(lambda core: core.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    # ---- weights ----

    async def init_weight_transfer_engine(self, request) -> None:
        # The rendezvous blocks until the trainer joins, so it runs on its own thread, not on the core thread.
        init_info = _field(request, "init_info")
        await asyncio.to_thread(self.engine_core.init_weight_transfer_engine, init_info)

    async def start_weight_update(self, *args: Any, **kwargs: Any) -> None:
        await self._call(lambda core: core.start_weight_update())

    async def update_weights(self, request) -> None:
        update_info = _field(request, "update_info")
        await self._call(lambda core: core.update_weights(update_info))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._call(lambda core: core.finish_weight_update(weight_version))

    async def update_weight_version(self, new_version: str) -> None:
        await self._call(lambda core: setattr(core, "weight_version", str(new_version)))

    async def get_weight_version(self) -> str:
        return self.engine_core.weight_version

    async def weight_checksums(self) -> dict[str, str]:
        return await self._call(lambda core: core.checksums())

    async def collective_rpc(
        self, method: str | Callable, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        """vLLM's collective_rpc (see LLM.collective_rpc), run on the core thread between steps."""
        call = self._call(lambda core: core.collective_rpc(method, args, kwargs))
        return await (call if timeout is None else asyncio.wait_for(call, timeout))

    async def reset_prefix_cache(self) -> None:
        await self._call(lambda core: core.reset_prefix_cache())

    def stats(self) -> dict[str, Any]:
        """A snapshot for metrics; plain reads of counters the core thread owns."""
        core = self.engine_core
        return dict(
            num_running=len(core.scheduler.running),
            num_waiting=len(core.scheduler.waiting),
            num_generated_tokens=core.num_generated_tokens,
            kv_cache_usage=core.kv_cache.usage,
            prefix_cache_queries=core.kv_cache.prefix_queries,
            prefix_cache_hits=core.kv_cache.prefix_hits,
            is_paused=core.is_paused(),
            weight_version=core.weight_version,
        )

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)
        self.engine_core.shutdown()


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
