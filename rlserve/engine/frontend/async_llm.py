"""AsyncLLM: the asyncio front end. The engine core runs in its own process (or, in-process mode, on a thread of
this one); the event loop never waits on a step.

Requests and control calls go to the core as typed messages; the core handles them in order between steps, so a
weight update never overlaps a forward pass. Outputs come back in order on the event loop, and a control call's
result comes after the outputs it caused, which is what makes "abort ends the streams before pause returns" hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlserve.config import EngineConfig
from rlserve.engine.frontend.args import EngineArgs, UsageContext, VllmConfig, check_usage_context, make_engine_config
from rlserve.engine.frontend.clients import make_async_client
from rlserve.engine.frontend.core_client import (
    AsyncMPClient,
    EngineDeadError,
    RequestIdInUseError,
    RequestRefusedError,
    collective_rpc_args,
    load_weights_args,
)
from rlserve.engine.frontend.core_client import (
    RetryableRequestError as RetryableRequestError,  # the server's, from here
)
from rlserve.engine.frontend.dp_client import DPAsyncMPClient
from rlserve.engine.frontend.launcher import CoreProcess
from rlserve.engine.frontend.llm import EngineFrontEnd, PromptType, ValidatedPrompt, _field
from rlserve.engine.wire.backends import registered_backends
from rlserve.engine.wire.messages import AddRequest, EngineCoreOutput, resolve_pause_mode
from rlserve.engine.wire.profiling import require_profiling
from rlserve.lora.request import LoRARequest
from rlserve.outputs import RequestOutput
from rlserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# How long pause waits for the streams it ended to be read by their consumers (a consumer that went away must not
# hold pause forever).
STREAM_DRAIN_TIMEOUT_S = 5.0
DRAIN_POLL_S = 0.1  # how often wait_for_requests_to_drain asks the core
SUPPORTED_TASKS = ("generate",)  # vLLM's tasks an engine serves: rlserve's serve generation only


@dataclass
class _Stream:
    """One request's outputs on their way to its consumer. What arrives while the consumer is busy is folded into
    one output (vLLM's RequestOutputCollector): a stream read slower than the engine steps gets fewer, larger
    deltas instead of falling further behind, one SSE chunk per read rather than per step. An error replaces
    whatever is pending: it ends the stream."""

    aggregate: bool  # delta outputs: append what is new; cumulative ones: keep the latest
    pending: RequestOutput | BaseException | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput) and isinstance(self.pending, RequestOutput):
            self.pending.add(item, self.aggregate)
        else:
            self.pending = item
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while self.pending is None:
            self.ready.clear()
            await self.ready.wait()
        return self.take()

    def take(self) -> RequestOutput | BaseException | None:
        """What is pending, without waiting (None if nothing is)."""
        item, self.pending = self.pending, None
        return item


class RequestOutputCollector:
    """vLLM's handle on one request that `AsyncLLM.add_request` queued: `get()` waits for its next output (raising
    the request's error, if it has one); `get_nowait()` returns one if there is one, else None."""

    def __init__(self, request_id: str, stream: _Stream, release: Callable[[str, _Stream], None]) -> None:
        self.request_id = request_id
        self._stream = stream
        self._release = release

    def _take(self, out: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(out, BaseException):
            self._release(self.request_id, self._stream)
            raise out
        if out.finished:
            self._release(self.request_id, self._stream)
        return out

    async def get(self) -> RequestOutput:
        return self._take(await self._stream.get())

    def get_nowait(self) -> RequestOutput | None:
        out = self._stream.take()
        return None if out is None else self._take(out)


def start_shared_cores(model: str, **kwargs: Any) -> list[CoreProcess]:
    """The engine-core processes (one per data-parallel rank) for several front ends (`AsyncLLM(model,
    shared_cores=[(address, pid, secret), ...])` each), as the API servers of `rlserve serve --api-server-count N` share
    them. Returns once every core serves."""
    config = make_engine_config(model, **kwargs)
    if config.data_parallel_lockstep:
        # Lockstep's pause agreement counts the pause/resume calls each rank received, which holds only while one
        # front end sends every rank the same calls in the same order (dp_wave.py).
        raise ValueError(
            "data_parallel_lockstep: needs a single front end (--api-server-count 1): with several, the ranks "
            "could receive pause and resume calls in different orders"
        )
    if config.data_parallel_backend == "ray":
        raise ValueError(
            "data_parallel_backend: ray is offered with one API server (its front end owns the core actors); leave "
            "--api-server-count at 1, or use the mp backend"
        )
    cores: list[CoreProcess] = []
    try:
        for rank in range(config.data_parallel_size):  # started together, waited for together
            rank_config = config.for_data_parallel_rank(rank)
            cores.append(CoreProcess(rank_config, registered_backends(rank_config)))
        for core in cores:
            core.wait_ready()
    except BaseException:
        for core in cores:
            core.shutdown()
        raise
    return cores


def _shared_client(shared_cores: Sequence[tuple[str, int, str]]) -> Callable[[EngineConfig], Any]:
    """A client of cores another process started: (address, pid, secret) per data-parallel rank."""

    def rank_client(config: EngineConfig) -> AsyncMPClient:
        address, pid, secret = shared_cores[config.data_parallel_rank]
        return AsyncMPClient(address=address, pid=pid, secret=secret)

    def make(config: EngineConfig) -> Any:
        if len(shared_cores) != config.data_parallel_size:
            raise ValueError(
                f"shared_cores: {len(shared_cores)} cores given for data_parallel_size {config.data_parallel_size}"
            )
        return DPAsyncMPClient(config, rank_client) if config.data_parallel_size > 1 else rank_client(config)

    return make


def _check_priority(priority: int) -> None:
    if priority != 0:
        raise ValueError(f"priority: not supported (the scheduler is first come, first served), got {priority!r}")


class AsyncLLM(EngineFrontEnd):
    def __init__(self, model: str, *, shared_cores: Sequence[tuple[str, int, str]] | None = None, **kwargs: Any):
        """`shared_cores`: (address, pid, secret) of each engine core (one per data-parallel rank) that another process
        started, to connect to instead of starting them (the API servers of `rlserve serve --api-server-count N`
        share them)."""
        make_client = make_async_client if shared_cores is None else _shared_client(shared_cores)
        super().__init__(model, make_client, **kwargs)
        self.client.on_outputs = self._on_core_outputs
        self.client.on_dead = self._on_core_dead
        self.model_name = model
        self._ids = itertools.count()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None  # set when the core died; every call then fails with it

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        """vLLM's construction from (Async)EngineArgs: the model and engine keywords they hold."""
        return cls(engine_args.model, **engine_args.kwargs)

    @classmethod
    def from_vllm_config(
        cls, vllm_config: VllmConfig, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT
    ) -> AsyncLLM:
        """vLLM's construction from `EngineArgs.create_engine_config()`'s result (with what the caller set on its
        `parallel_config`)."""
        check_usage_context(usage_context)
        if not isinstance(vllm_config, VllmConfig):
            raise ValueError(f"vllm_config: expected EngineArgs.create_engine_config()'s, got {vllm_config!r}")
        config = vllm_config.engine_config()
        kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "model"}
        return cls(config.model, **kwargs)

    @property
    def model_config(self) -> EngineConfig:
        """vLLM's name for the engine's configuration (model, dtype, max_model_len...)."""
        return self.config

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return SUPPORTED_TASKS

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self.client.bind(loop)
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM is bound to another event loop")
        return loop

    async def _call(self, method: str, *args: Any) -> Any:
        self._bind_loop()
        return await self.client.call(method, *args)

    # ---- outputs ----

    def _on_core_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        results, to_abort = self.output_processor.process(outputs)
        for out in results:
            error: RequestRefusedError | None = self.output_processor.take_error(out.request_id)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                if error is not None:
                    error.final_output = out
                stream.put(out if error is None else error)
        if to_abort:
            self.client.abort(to_abort)

    def _on_core_dead(self, reason: str) -> None:
        self.error = EngineDeadError(reason)
        self.fail_streams(self.error)

    def fail_streams(self, error: BaseException) -> None:
        """End every open stream with `error` (raised to its consumer, whose exit aborts its engine requests): the
        core died, or the server is shutting down and must not leave clients waiting for a stream's end."""
        for stream in self._streams.values():
            stream.put(error)

    def fail_calls(self, error: BaseException) -> None:
        """Raise `error` to every caller of a core call still waiting (an init_weight_transfer_engine waiting for
        its trainer): the server is shutting down, and each must answer before it does rather than be cancelled."""
        self.client.fail_calls(error)

    @property
    def not_serving(self) -> str | None:
        """Why the core refuses generation (its weights are incomplete), as it last told this front end; None
        while it serves. Read without a call: the core may be inside a long weight transfer."""
        return self.client.not_serving

    @property
    def rejecting_new_requests(self) -> bool:
        """A pause in mode abort or wait refuses new requests (RetryableRequestError) until resume, as the core last
        told this front end."""
        return self.client.rejecting_new_requests

    async def generate(
        self,
        prompt: PromptType | ValidatedPrompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        lora_request: LoRARequest | None = None,
        session_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (cumulative by default; set sampling_params.output_kind for deltas).
        A prompt from `validate_prompt` is queued as it is, with the params (and adapter) it was checked with.
        `lora_request`: the adapter it runs with (loaded first if it is not). `session_id` (the server's
        `X-Session-ID`): requests of one session go to the same data-parallel rank, whose prefix cache holds the
        earlier turns. `priority`: vLLM's, 0 only (the scheduler is first come, first served)."""
        _check_priority(priority)
        prompt = await self._validate_with_lora(prompt, sampling_params, lora_request)
        request_id, stream = self._add(prompt, request_id, session_id)
        try:
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    break
        finally:
            self._release(request_id, stream)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType | ValidatedPrompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
    ) -> RequestOutputCollector:
        """vLLM 0.33's: queue a request and return its collector, whose `get()` gives its outputs in order (the last
        one finished) or raises its error. Unlike `generate`, nothing aborts it when its caller stops reading: call
        `abort(request_id)`. What rlserve does not offer is refused by name."""
        unsupported = {
            "arrival_time": (arrival_time, None, "the engine stamps arrival itself"),
            "tokenization_kwargs": (tokenization_kwargs, None, "prompts are tokenized as the tokenizer's defaults"),
            "trace_headers": (trace_headers, None, "tracing is not supported"),
            "data_parallel_rank": (data_parallel_rank, None, "the front end routes requests (session_id for affinity)"),
        }
        for name, (value, default, why) in unsupported.items():
            if value != default:
                raise ValueError(f"{name}: not supported ({why}), got {value!r}")
        _check_priority(priority)
        prompt = await self._validate_with_lora(prompt, params, lora_request)
        request_id, stream = self._add(prompt, request_id, session_id)
        return RequestOutputCollector(request_id, stream, self._release)

    async def _validate_with_lora(
        self,
        prompt: PromptType | ValidatedPrompt,
        params: SamplingParams | None,
        lora_request: LoRARequest | None,
    ) -> ValidatedPrompt:
        """The prompt validated with its adapter, which is loaded first where `loras_to_add` says so."""
        self._bind_loop()
        if self.error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.error}")
        prompt = self.validator.accept(prompt, params, lora_request)
        for lora in self.loras_to_add([prompt.lora_request]):
            await self.add_lora(lora)
        return prompt

    def _add(self, prompt: ValidatedPrompt, request_id: str | None, session_id: str | None) -> tuple[str, _Stream]:
        """Queue one request; its outputs go to the returned stream until `_release`."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams or self.output_processor.in_use(request_id, prompt.params.n):
            raise RequestIdInUseError(request_id)
        stream = self._streams[request_id] = _Stream(prompt.params.output_kind is RequestOutputKind.DELTA)
        children = self.output_processor.add_request(request_id, prompt.text, prompt.token_ids, prompt.params)
        child_ids = [c for c, _ in children]
        try:
            params = [p for _, p in children]
            request = AddRequest.of(child_ids, prompt.token_ids, params, prompt.cache_salt, prompt.lora_request)
            self.client.add([request], session_id)
        except BaseException:
            self.output_processor.abort(request_id, in_core=False)
            self._release(request_id, stream)
            raise
        return request_id, stream

    def request_in_use(self, request_id: str) -> bool:
        """Whether a request `request_id` would be refused as in use: its stream is open, or the core may still
        run one of its samples (an abort on its way)."""
        return request_id in self._streams or self.output_processor.in_use(request_id)

    def _release(self, request_id: str, stream: _Stream) -> None:
        """The request's consumer is done with its stream; if the request has not finished, it is aborted."""
        self._streams.pop(request_id, None)
        stream.done.set()
        if request_id in self.output_processor.states:  # the consumer left early: stop the work
            child_ids = self.output_processor.child_ids(request_id)
            self.output_processor.abort(request_id)
            self.client.abort(child_ids)

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """vLLM's. `internal` (vLLM 0.33) says the ids are the engine's own rather than the caller's; rlserve gives
        the engine the caller's ids, so both name the same requests."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        child_ids = [c for rid in request_ids for c in self.output_processor.child_ids(rid)]
        # The core's outputs first (they arrive before the call returns): they carry tokens it held back for
        # final-only requests.
        await self._call("abort_requests", child_ids)
        for rid in request_ids:
            out = self.output_processor.abort(rid)
            stream = self._streams.get(rid)
            if out is not None and stream is not None:
                stream.put(out)

    # ---- pause / resume ----

    async def pause_generation(
        self, *, mode: str = "abort", clear_cache: bool = True, wait_for_inflight_requests: bool | None = None
    ) -> None:
        """abort: end the requests in flight, return once their streams have their last output. wait: admit nothing
        new, return when the requests in flight have finished (then clear the cache if asked) or when a resume ends
        the pause first (the cache is then left as it is). keep: freeze everything where it is."""
        mode = resolve_pause_mode(mode, wait_for_inflight_requests)
        affected = list(self._streams.values())
        await self._call("pause", mode, clear_cache)
        if mode == "keep":
            # The core sent the last tokens before its answer: their consumers take them before pause returns, so
            # that none is read between the pause and the resume.
            deadline = time.monotonic() + STREAM_DRAIN_TIMEOUT_S
            while any(s.pending is not None for s in affected) and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
        else:
            # Streams that this pause ended are read to their end before pause returns.
            pending = [s.done.wait() for s in affected if not s.done.is_set() and s.pending is not None]
            if pending:
                await asyncio.wait([asyncio.ensure_future(p) for p in pending], timeout=STREAM_DRAIN_TIMEOUT_S)

    async def resume_generation(self) -> None:
        await self._call("resume")

    async def is_paused(self) -> bool:
        return await self._call("is_paused")

    # ---- LoRA adapters (see LLM.add_lora) ----

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        self.check_lora_request(lora_request)
        added = await self._call("add_lora", lora_request)
        self._loaded_loras[lora_request.lora_int_id] = lora_request.lora_name
        return added

    async def remove_lora(self, lora_id: int) -> bool:
        removed = await self._call("remove_lora", lora_id)
        self._loaded_loras.pop(lora_id, None)
        return removed

    async def list_loras(self) -> set[int]:
        return set(await self._call("list_loras"))

    # ---- sleep / wake ----

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free device memory for a colocated trainer (see EngineCore.sleep); new requests wait until wake_up.
        mode (vLLM's, and its default): "abort" ends the requests in flight first, "keep" freezes them."""
        await self._call("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """See LLM.wake_up; whether the engine is awake."""
        return await self._call("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self._call("is_sleeping")

    # ---- weights ----

    async def init_weight_transfer_engine(self, request, backend: str | None = None) -> None:
        """`backend` (rlserve's): the backend a framework's route speaks, see EngineCore.init_weight_transfer_engine."""
        # The rendezvous blocks until the trainer joins: the core runs it on a thread and keeps stepping.
        await self._call("init_weight_transfer_engine", _field(request, "init_info"), backend)

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.check_weight_update_format(is_checkpoint_format)
        await self._call("start_weight_update")

    async def start_draft_weight_update(self) -> None:
        raise self.no_draft_model()

    async def update_weights(self, request) -> None:
        await self._call("update_weights", _field(request, "update_info"))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._call("finish_weight_update", weight_version)

    async def abandon_weight_update(self) -> str:
        """See LLM.abandon_weight_update."""
        return await self._call("abandon_weight_update")

    async def update_weight_version(self, new_version: str) -> None:
        await self._call("update_weight_version", str(new_version))

    async def get_weight_version(self) -> str:
        return await self._call("get_weight_version")

    async def weight_checksums(self) -> dict[str, str]:
        return await self._call("checksums")

    async def load_weights_from_dir(self, weight_dir: str) -> int:
        """Load the safetensors checkpoint in `weight_dir` in place (see EngineCore.load_weights_from_dir)."""
        return await self._call("load_weights_from_dir", weight_dir)

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._call("shutdown_weight_transfer_engine")

    async def load_weights(self, weights, reset_prefix_cache: bool = True) -> int:
        return await self._call("load_weights", *load_weights_args(self.client, weights, reset_prefix_cache))

    async def collective_rpc(
        self, method: str | Callable, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        """vLLM's collective_rpc (see LLM.collective_rpc), run by the core between steps."""
        call = self._call("collective_rpc", *collective_rpc_args(self.client, method, args, kwargs))
        return await (call if timeout is None else asyncio.wait_for(call, timeout))

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> None:
        """vLLM's. `reset_connector`: also drop an external KV store's entries; rlserve attaches none, so there
        is nothing more to drop (vLLM without a connector does the same)."""
        await self._call("reset_prefix_cache", reset_running_requests)

    async def reset_mm_cache(self) -> None:
        """vLLM's: drop the multimodal processor cache. rlserve serves text-only models: there is none."""

    async def reset_encoder_cache(self) -> None:
        """vLLM's: drop the multimodal encoder's output cache. rlserve serves text-only models: there is none."""

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300) -> None:
        """vLLM's: return once no request runs or waits in the engine (every data-parallel rank; requests of every
        front end of a shared core, and those a keep-pause froze, count), else raise TimeoutError after
        `drain_timeout` seconds. It drains nothing itself: new requests are still admitted (pause_generation with
        mode "wait" stops admitting and waits). Polls the core every DRAIN_POLL_S (vLLM: every second); the poll
        waits only as long as the timeout leaves, so a core busy with a long control call cannot hold it longer."""
        deadline = time.monotonic() + drain_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                stats = await asyncio.wait_for(self._call("stats"), max(remaining, DRAIN_POLL_S))
            except TimeoutError:
                stats = None
            if stats is not None and stats["num_running"] + stats["num_waiting"] == 0:
                logger.info("the engine is idle: its requests have drained")
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"Timeout reached after {drain_timeout} seconds waiting for requests to drain.")
            await asyncio.sleep(min(DRAIN_POLL_S, remaining))

    # ---- profiling (see LLM.start_profile) ----

    async def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
        profiler_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """vLLM's; see LLM.start_profile. The session lives in the engine core, so it is one for every front end
        of the core (an API server may stop what another started)."""
        args = self.profile_args(profile_prefix, delay_iterations, max_iterations, profiler_kwargs)
        await self._call("start_profile", *args)

    async def stop_profile(self) -> None:
        require_profiling(self.config)
        await self._call("stop_profile")

    async def check_health(self) -> None:
        """vLLM's: raise EngineDeadError if the engine core is gone (its process died, or a step failed)."""
        self._bind_loop()
        if self.error is not None:
            raise self.error

    async def stats(self) -> dict[str, Any]:
        """A snapshot of the core's counters for metrics."""
        return await self._call("stats")

    def shutdown(self) -> None:
        self._finalizer()
