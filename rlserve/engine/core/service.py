"""The engine core's side of the message protocol: add/abort/control messages in, step outputs and results out.

One service runs the core's busy loop whatever carries the messages: a ZMQ socket in the engine-core process (the
default, see main_loop.py) or a queue in a thread of the caller's process (the in-process mode). Everything that
touches the core runs on the loop's thread, between steps, so a weight update never overlaps a forward pass.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from rlserve.engine.core.dp_wave import Gate, LockstepRank, SyncFlags, run_iteration
from rlserve.engine.core.engine_core import EngineCore
from rlserve.engine.wire.messages import (
    PAUSED_REFUSAL,
    SLEEP_MODES,
    AbortRequests,
    AddRequest,
    AddRequests,
    CoreInput,
    EngineCoreOutput,
    EngineStatus,
    UtilityCall,
    UtilityResult,
    decode_token_ids,
    plain_data,
    resolve_pause_mode,
)
from rlserve.engine.wire.tensors import unpack_tensors
from rlserve.engine.worker.extension import extension_methods

logger = logging.getLogger(__name__)

ClientId = Hashable
IDLE_POLL_S = 0.05
BACKGROUND_POLL_S = 0.005


class Transport(Protocol):
    in_process: bool  # carries Python objects as they are (a queue), else plain data only (msgpack over ZMQ)

    def send_outputs(self, client: ClientId, outputs: list[EngineCoreOutput]) -> None: ...

    def send_result(self, client: ClientId, result: UtilityResult) -> None: ...

    def send_status(self, client: ClientId, status: EngineStatus) -> None: ...


@dataclass
class _WaitPause:
    client: ClientId
    call_id: int
    clear_cache: bool


def error_result(call_id: int, error: BaseException) -> UtilityResult:
    try:
        message = str(error)
    except Exception:  # a plugin's exception whose __str__ raises must not take the core down with it
        message = f"<{type(error).__name__} whose message cannot be printed>"
    return UtilityResult(call_id, None, type(error).__name__, message)


class Lockstep(Protocol):
    """The wires between data-parallel ranks in lockstep (dp_lockstep.LockstepLink)."""

    def all_gather(self, flags: SyncFlags) -> list[SyncFlags]: ...

    def announce(self, wave: int) -> None: ...


class _LockstepEngine:
    """The service as the wave protocol sees a rank's engine."""

    def __init__(self, service: EngineCoreService) -> None:
        self.service = service

    def has_work(self) -> bool:
        return self.service.core.has_work()

    def is_paused(self) -> bool:
        return self.service.core.pausing.is_paused()

    def step(self) -> None:
        self.service.step()

    def dummy_step(self) -> None:
        self.service.core.dummy_step()


class EngineCoreService:
    def __init__(self, core: EngineCore, transport: Transport, lockstep: Lockstep | None = None) -> None:
        """`lockstep`: this core is one rank of a data-parallel group in lockstep (dp_wave.py)."""
        self.core = core
        self.transport = transport
        self.wave: LockstepRank | None = None
        if lockstep is not None:
            config = core.config
            self.wave = LockstepRank(
                config.data_parallel_rank,
                config.data_parallel_size,
                config.data_parallel_sync_interval,
                _LockstepEngine(self),
                lockstep.announce,
            )
            self._all_gather = lockstep.all_gather
        self.owners: dict[str, ClientId] = {}  # request id -> the front end its outputs go to
        self.wait_pauses: list[_WaitPause] = []
        # Control calls that block on a peer (the weight-transfer rendezvous) run on threads; their results come
        # back here and are sent from the loop's thread (sockets are not thread-safe).
        self.background: queue.SimpleQueue[tuple[ClientId, UtilityResult]] = queue.SimpleQueue()
        self.num_background = 0
        self.failure: BaseException | None = None  # a step raised: requests were aborted, the core is unusable
        self.clients: set[ClientId] = set()  # every front end seen, for status changes
        self.status = EngineStatus(None, False)  # as last sent
        self.utility_calls = self._utility_calls()

    def _utility_calls(self) -> dict[str, Callable[..., Any]]:
        """Each control call a front end may send, by the method name it sends (the wire protocol), -> what runs it
        with (caller, call, *the call's arguments): the service itself where the call needs the caller (a pause
        answered later, outputs routed), else the core's collaborator that owns what the call changes."""
        core = self.core
        collaborators: dict[str, Callable[..., Any]] = {
            "is_paused": core.pausing.is_paused,
            "reset_prefix_cache": core.pausing.reset_prefix_cache,
            "wake_up": core.sleeping.wake_up,
            "is_sleeping": core.sleeping.is_sleeping,
            "init_weight_transfer_engine": core.weights.init_weight_transfer_engine,
            "start_weight_update": core.weights.start_weight_update,
            "update_weights": core.weights.update_weights,
            "finish_weight_update": core.weights.finish_weight_update,
            "abandon_weight_update": core.weights.abandon_weight_update,
            "shutdown_weight_transfer_engine": core.weights.shutdown_weight_transfer_engine,
            "get_weight_version": core.weights.get_weight_version,
            "update_weight_version": core.weights.update_weight_version,
            "checksums": core.weights.checksums,
            "load_weights_from_dir": core.weights.load_weights_from_dir,
            "add_lora": core.loras.add_lora,
            "remove_lora": core.loras.remove_lora,
            "list_loras": core.loras.list_loras,
            "start_profile": core.profiling.start_profile,
            "stop_profile": core.profiling.stop_profile,
        }
        return {
            **{name: _with_the_arguments(method) for name, method in collaborators.items()},
            "pause": self.pause,
            "resume": self.resume,
            "collective_rpc": self.collective_rpc,
            "load_weights": self.load_weights,
            "abort_requests": self.abort_requests,
            "sleep": self.sleep,
            "engine_info": self.engine_info,
            "stats": self.stats,
        }

    # ---- the loop ----

    def input_timeout_s(self) -> float:
        """How long the loop may wait for a message before its next run_once: not at all while the core has work,
        briefly while a wait-pause or a call on a thread is pending, else until the idle timeout (the loop also
        watches for shutdown)."""
        if self.core.has_work() or (self.wave is not None and not self.wave.idle()):
            return 0.0
        if self.wait_pauses or self.num_background:
            return BACKGROUND_POLL_S
        return IDLE_POLL_S

    def handle(self, client: ClientId, message: CoreInput) -> None:
        if client not in self.clients:  # a front end's first message: it learns the status it missed
            self.clients.add(client)
            self.transport.send_status(client, self.status)
        self._handle(client, message)

    def _publish_status(self) -> None:
        """Tell every front end when the core starts or stops refusing generation or new requests: only control
        calls (a weight update, sleep, a pause, an abandoned update) change that. Sent before the call's result, so
        that the caller's front end knows the new status by the time the call returns."""
        core = self.core
        status = EngineStatus(core.weights.not_serving(), core.pausing.rejecting_new_requests)
        if status != self.status:
            self.status = status
            for client in self.clients:
                self.transport.send_status(client, self.status)

    def _handle(self, client: ClientId, message: CoreInput) -> None:
        if isinstance(message, AddRequests):
            for request in message.requests:
                self._add(client, request)
        elif isinstance(message, AbortRequests):
            self._route(self.core.abort_requests(message.request_ids))
        elif isinstance(message, UtilityCall):
            self._call(client, message)
        else:
            raise TypeError(f"unknown message {type(message).__name__}")

    def run_once(self) -> None:
        """One step if there is work, then whatever the step made possible (finished wait-pauses, background
        results). In lockstep the wave protocol decides whether to step (a dummy step too) and when."""
        if self.wave is not None:
            if self.failure is None:
                run_iteration(self.wave, self._all_gather)
        elif self.core.has_work():
            self.step()
        if self.wait_pauses and self.core.pausing.num_in_flight == 0:
            self._end_wait_pauses(clear_cache=True)
        while self.num_background:
            try:
                client, result = self.background.get_nowait()
            except queue.Empty:
                break
            self.num_background -= 1
            self.transport.send_result(client, result)

    def step(self) -> None:
        if self.failure is not None:
            return
        try:
            outputs = self.core.step()
        except BaseException as e:
            # The callers get the failure (EngineDeadError from their client), not an ordinary-looking abort.
            logger.exception("engine step failed")
            self.failure = e
            self.core.abort_requests(list(self.core.requests))
            return
        self._route(outputs)

    def _add(self, client: ClientId, message: AddRequest) -> None:
        message = self._without_taken_ids(client, message)
        if not message.request_ids:
            return
        if self.failure is not None:
            self._route(self._refused(message.request_ids))
            return
        not_serving = self.core.weights.not_serving()
        if not_serving is not None or self.core.pausing.rejecting_new_requests:
            for request_id in message.request_ids:
                self.owners[request_id] = client
            if not_serving is not None:
                self._route(self._refused(message.request_ids, f"generation refused: {not_serving}"))
            else:
                self._route(self._refused(message.request_ids, PAUSED_REFUSAL, retryable=True))
            return
        prompt = decode_token_ids(message.prompt_token_ids)
        for request_id, params in zip(message.request_ids, message.params, strict=True):
            self.owners[request_id] = client
            try:
                self.core.add_request(request_id, prompt, params, message.cache_salt, message.lora_request)
            except ValueError as e:  # the front end validated it; a duplicate id, an adapter that fails to load
                logger.exception("refused request %s", request_id)
                self._route(self._refused([request_id], str(e)))

    def _without_taken_ids(self, client: ClientId, message: AddRequest) -> AddRequest:
        """`message` less the samples whose id a running request holds, each refused to `client` alone: with several
        API servers a client's id can collide with another server's request, whose outputs re-owning the id would
        send here (and the refusal would then drop them: that request would never end)."""
        taken = [rid for rid in message.request_ids if rid in self.owners]
        if not taken:
            return message
        for rid in taken:
            self.transport.send_outputs(client, self._refused([rid], f"request_id: {rid!r} is already in use"))
        kept = [i for i, rid in enumerate(message.request_ids) if rid not in self.owners]
        return msgspec.structs.replace(
            message, request_ids=[message.request_ids[i] for i in kept], params=[message.params[i] for i in kept]
        )

    def _refused(
        self, request_ids: list[str], error: str | None = None, retryable: bool = False
    ) -> list[EngineCoreOutput]:
        version = self.core.weights.version
        return [
            EngineCoreOutput(rid, [], [], None, version, "abort", error=error, error_retryable=retryable)
            for rid in request_ids
        ]

    def _route(self, outputs: list[EngineCoreOutput]) -> None:
        if not outputs:
            return
        by_client: dict[ClientId, list[EngineCoreOutput]] = {}
        owners = self.owners
        for out in outputs:
            client = owners.get(out.request_id)
            if out.finish_reason is not None:
                owners.pop(out.request_id, None)
            if client is not None:
                by_client.setdefault(client, []).append(out)
        for client, batch in by_client.items():
            self.transport.send_outputs(client, batch)

    # ---- control calls ----

    def _call(self, client: ClientId, call: UtilityCall) -> None:
        method = self.utility_calls.get(call.method)
        if method is None:
            self.transport.send_result(client, error_result(call.call_id, ValueError(f"unknown call {call.method!r}")))
            return
        if call.method in _BACKGROUND_METHODS:
            self._call_in_background(client, call, method)
            return
        gate = Gate.RUN if self.wave is None else self.wave.gate(call.method)
        if gate is Gate.DEFER:  # behind a pause that is not agreed yet: runs (or is refused) when it is
            self.wave.defer(
                call.method,
                lambda: self._call_now(client, call, method),
                lambda why: self.transport.send_result(client, error_result(call.call_id, RuntimeError(why))),
            )
        elif gate is Gate.REFUSE:
            error = RuntimeError(self.wave.refusal(call.method))
            self.transport.send_result(client, error_result(call.call_id, error))
        else:
            self._call_now(client, call, method)

    def _call_now(self, client: ClientId, call: UtilityCall, method: Callable) -> None:
        try:
            value = method(client, call, *call.args)
        except BaseException as e:
            self._route(self.core.take_pending_outputs())
            self._pause_lifted()
            self._publish_status()
            self.transport.send_result(client, error_result(call.call_id, e))
            return
        # Outputs of a step the call read back go out before its result (a keep-pause's last tokens included).
        self._route(self.core.take_pending_outputs())
        self._pause_lifted()
        self._publish_status()
        if value is not _DEFERRED:
            self.transport.send_result(client, UtilityResult(call.call_id, value))

    def _pause_lifted(self) -> None:
        if self.wave is not None and self.wave.paused and not self.core.pausing.is_paused():
            self.wave.pause_lifted()

    def _call_in_background(self, client: ClientId, call: UtilityCall, method: Callable) -> None:
        def run() -> None:
            try:
                result = UtilityResult(call.call_id, method(client, call, *call.args))
            except BaseException as e:
                result = error_result(call.call_id, e)
            self.background.put((client, result))

        self.num_background += 1
        threading.Thread(target=run, name=f"rlserve-{call.method}", daemon=True).start()

    def _end_wait_pauses(self, clear_cache: bool) -> None:
        """Return every pending pause(mode="wait"); clear the cache first if one asked and `clear_cache` allows."""
        pauses, self.wait_pauses = self.wait_pauses, []
        if clear_cache and any(p.clear_cache for p in pauses):
            self.core.pausing.clear_cache()
        for p in pauses:
            self.transport.send_result(p.client, UtilityResult(p.call_id, None))

    def pause(self, client: ClientId, call: UtilityCall, mode: str, clear_cache: bool) -> Any:
        if self.wave is not None:
            return self._lockstep_pause(client, call, resolve_pause_mode(mode), clear_cache)
        if mode == "wait":  # any other mode, a bad one included, is the core's to apply or refuse
            self._route(self.core.pausing.pause("wait", clear_cache=False))  # what the step in flight sampled
            self.wait_pauses.append(_WaitPause(client, call.call_id, clear_cache))
            return _DEFERRED
        self._route(self.core.pausing.pause(mode, clear_cache))  # abort: the streams end before the pause returns
        return None

    def _lockstep_pause(self, client: ClientId, call: UtilityCall, mode: str, clear_cache: bool) -> Any:
        """Phase 1: the mode applies here at once; the call is answered when every rank is paused (phase 2), or
        by a resume that comes first (it then clears nothing)."""
        self._route(self.core.pausing.pause(mode, clear_cache and mode != "wait"))

        def reply() -> None:
            if mode == "wait" and clear_cache and self.wave.paused:
                self.core.pausing.clear_cache()
            self.transport.send_result(client, UtilityResult(call.call_id, None))

        self.wave.pause(reply)
        return _DEFERRED

    def resume(self, client: ClientId, call: UtilityCall) -> None:
        self.core.pausing.resume()
        if self.wave is not None:
            self.wave.resume()
            return
        # A pause(mode="wait") still waiting for its requests is over: it returns now rather than when the traffic
        # admitted after this resume happens to drain, which under steady load is never.
        self._end_wait_pauses(clear_cache=False)

    def collective_rpc(self, client: ClientId, call: UtilityCall, method, args, kwargs) -> list[Any]:
        """A worker method's results as they are for a front end in this process; as plain data (tensors as lists)
        for one in another, or a ValueError naming the method (a result the socket cannot carry must not reach it)."""
        results = self.core.rpc.collective_rpc(method, tuple(args), kwargs)
        if self.transport.in_process:
            return results
        return plain_data(results, f"method: {method!r}")

    def load_weights(self, client: ClientId, call: UtilityCall, weights: list, reset_prefix_cache: bool) -> int:
        """(name, tensor) pairs from a front end in this process, packed ones (pack_tensors) from another."""
        if weights and not isinstance(weights[0], tuple):
            weights = unpack_tensors(weights)
        return self.core.weights.load_weights_direct(weights, reset_prefix_cache)

    def sleep(self, client: ClientId, call: UtilityCall, level: int, mode: str = "abort") -> None:
        """vLLM's sleep modes: "abort" ends the requests in flight first (their streams end before sleep returns);
        "keep" freezes them, and they recompute their KV after wake_up."""
        if mode not in SLEEP_MODES:
            raise ValueError(f"mode: sleep mode must be one of {list(SLEEP_MODES)}, got {mode!r}")
        if self.core.config.enable_expert_parallel and not self.wave.paused:
            # A rank without weights cannot serve its experts to a peer's forward, and a peer may be inside one
            # until every rank has agreed to pause.
            raise RuntimeError(
                "sleep: expert parallel: pause the engine first (pause_generation, POST /pause), so that no rank "
                "steps while another's experts are released"
            )
        if mode == "abort":
            self._route(self.core.abort_requests(list(self.core.requests)))
        self.core.sleeping.sleep(level)

    def abort_requests(self, client: ClientId, call: UtilityCall, request_ids: list[str]) -> None:
        """An abort whose outputs (the tokens held back for final-only requests) reach the caller before it
        returns."""
        self._route(self.core.abort_requests(request_ids))

    def engine_info(self, client: ClientId, call: UtilityCall) -> dict[str, Any]:
        """What the front end needs to validate requests without asking the core each time."""
        core = self.core
        return dict(
            max_model_len=core.max_model_len,
            vocab_size=core.vocab_size,
            max_logprobs=core.config.max_logprobs,
            worker_extension_methods=sorted(extension_methods(core.rpc.worker)),
        )

    def stats(self, client: ClientId, call: UtilityCall) -> dict[str, Any]:
        """The core's gauges and counters (counts since start): what every front end reports on /metrics."""
        core = self.core
        config = core.config
        return dict(
            num_running=len(core.scheduler.running),
            num_waiting=len(core.scheduler.waiting),
            num_waiting_deferred=min(core.scheduler.num_deferred, len(core.scheduler.waiting)),
            num_prompt_tokens=core.num_prompt_tokens,
            num_generated_tokens=core.num_generated_tokens,
            num_preemptions=core.scheduler.num_preemptions,
            num_dummy_steps=core.num_dummy_steps,
            kv_cache_usage=core.kv_cache.usage,
            kv_cache_free_blocks=core.kv_cache.num_free_blocks,
            kv_cache_blocks=core.kv_cache.num_blocks,
            prefix_cache_queries=core.kv_cache.prefix_queries,
            prefix_cache_hits=core.kv_cache.prefix_hits,
            is_paused=core.pausing.is_paused(),
            sleep_state=core.sleeping.sleep_state,
            weight_version=core.weights.version,
            num_unwritten_weights=len(core.weights.unwritten),
            # vLLM's CacheConfig fields that rlserve has, under vLLM's names (vllm:cache_config_info's labels)
            cache_config=dict(
                block_size=config.block_size,
                num_gpu_blocks=core.kv_cache.num_blocks,
                kv_cache_size_tokens=core.kv_cache.num_blocks * config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                gpu_memory_utilization=config.gpu_memory_utilization,
            ),
        )


def _with_the_arguments(method: Callable) -> Callable:
    """A collaborator's method as a utility call: called with the call's arguments (the caller is not its business)."""

    def call(client: ClientId, call: UtilityCall, *args: Any) -> Any:
        return method(*args)

    return call


_DEFERRED = object()  # the result is sent later (a pause(mode="wait"))
_BACKGROUND_METHODS = frozenset({"init_weight_transfer_engine"})
