"""The engine core: owns scheduler, KV cache and model runner; steps the batch; pauses; applies weight updates.

It is synchronous and single-threaded on purpose: `LLM` drives it directly, `AsyncLLM` from one background thread,
so a weight update can never race a forward pass.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.distributed import TCPStore

from rlserve.config import EngineConfig, WeightTransferConfig
from rlserve.dtypes import dtype_from_name
from rlserve.engine.core.device_defaults import with_device_defaults
from rlserve.engine.core.lora_manager import LoRAManager
from rlserve.engine.core.profiling import ProfileSession
from rlserve.engine.sched.kv_cache import KVCacheManager
from rlserve.engine.sched.request import Request, RequestStatus
from rlserve.engine.sched.scheduler import PauseState, Scheduler, SchedulerConfig
from rlserve.engine.wire.call_policy import check_rpc_method, confined_weight_dir
from rlserve.engine.wire.messages import ENGINE_RPC_METHODS, EngineCoreOutput, resolve_pause_mode
from rlserve.engine.wire.profiling import ALREADY_ACTIVE, check_session, profiling_enabled, require_profiling
from rlserve.engine.worker.extension import call as call_worker
from rlserve.engine.worker.extension import extension_methods, make_worker
from rlserve.engine.worker.model_runner import LaunchedStep
from rlserve.engine.worker.tp_workers import create_runner
from rlserve.engine.worker.tracing import TraceProfiler, trace_name
from rlserve.lora.request import LoRARequest
from rlserve.outputs import DEFAULT_WEIGHT_VERSION, PositionLogprobsData
from rlserve.sampling_params import SamplingParams
from rlserve.weight_transfer.base import TRAINER_LOST, WeightUpdateRefused

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (0, 1, 2)
# What update_config may change: (vLLM's config name, its field) -> the EngineConfig field.
UPDATABLE_CONFIG = {("load_config", "load_format"): "load_format"}
WAKE_UP_TAGS = ("weights", "kv_cache", "scheduling")


@dataclass(slots=True)
class _InFlightStep:
    launched: LaunchedStep
    starts: list[int]  # each scheduled request's num_computed_tokens at launch
    weight_version: str  # the weights the step ran with


class EngineCore:
    def __init__(self, config: EngineConfig, dp_store: TCPStore | None = None) -> None:
        """`dp_store`: the data-parallel ranks' rendezvous (lockstep), for the expert-parallel group."""
        config = with_device_defaults(config)  # the batch limits left unset, chosen for this process's device
        self.config = config
        # rank 0's, with the other tensor-parallel ranks in processes of their own
        self.runner = create_runner(config, dp_store)
        try:
            self._init(config)
        except BaseException:
            self.runner.shutdown()
            raise

    def _init(self, config: EngineConfig) -> None:
        spec = self.runner.spec
        self.vocab_size = spec.vocab_size
        self.max_model_len = self.runner.max_model_len
        if not config.enable_chunked_prefill and self.max_model_len > config.max_num_batched_tokens:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled"
            )
        if self.runner.num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({self.runner.num_blocks} blocks of {config.block_size} tokens) cannot hold one "
                f"sequence "
                f"of max_model_len={self.max_model_len}; lower max_model_len or give the cache more memory"
            )
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill),
            self.kv_cache,
        )
        self.requests: dict[str, Request] = {}
        self.lora = LoRAManager(self.runner, config.max_loras, config.max_lora_rank) if config.enable_lora else None
        self.eos_token_ids = frozenset(_eos_token_ids(self.runner.hf_config, config.model))
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.weight_transfer = None  # created by init_weight_transfer_engine
        self._weight_transfer_backend: str | None = None  # its backend's name
        self.worker = make_worker(self.runner, config.worker_extension_cls)
        self.weight_update_active = False
        # Checkpoint tensors that hold no valid weights: released by sleep(level=2), partly written by a failed
        # update_weights, or left from another version by an abandoned update. While any is, nothing is scheduled,
        # new requests are refused (`not_serving`) and finish_weight_update refuses, until writes cover them all.
        self.unwritten_weights: set[str] = set()
        self._unwritten_since = ""  # what made them so, for the error messages
        self._update_written: set[str] = set()  # what the update in progress has written so far
        self._snapshot: dict[str, torch.Tensor] | None = None  # weight_update_snapshot's buffers, kept for reuse
        self._snapshot_valid = False  # they hold the weights of the update in progress's start
        self.asleep = False
        self.sleep_level = 0  # the deepest level since it fell asleep
        self._pause_before_sleep = PauseState.UNPAUSED
        self._in_flight: _InFlightStep | None = None  # launched, not yet read back (async scheduling)
        self._pending_outputs: list[EngineCoreOutput] = []  # read back by _drain, returned by the next step
        # vLLM 0.33's user pause in mode abort or wait: new requests are refused (retryable) until resume, not queued.
        self.rejecting_new_requests = False
        self.num_generated_tokens = 0  # counters for metrics
        self.num_prompt_tokens = 0  # of the requests that got their first token (vLLM counts them at prefill)
        self.num_steps = 0
        self.num_dummy_steps = 0
        self._now = 0.0  # time.monotonic() of the step (or abort) whose outputs are being made
        # start_profile/stop_profile (profiler.py): this process's profiler, and the session between the two calls
        self.profiler = TraceProfiler(config.profiler_config, self.runner.device) if profiling_enabled(config) else None
        self.profile_session: ProfileSession | None = None

    # ---- requests ----

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue one sample (n == 1; the front end splits n > 1 into several requests) that passed `validate`. An
        adapter not loaded is loaded first (from its lora_path)."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValueError("bad_words: not tokenized; requests reach the core through a front end's validate_prompt")
        lora = None if lora_request is None else self._lora_manager("lora_request").get(lora_request)
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            self.eos_token_ids,
            self.max_model_len,
            generator,
            self.config.stream_interval,
            cache_salt=cache_salt,
        )
        if lora is not None:
            request.lora, request.lora_slot = (lora.request.lora_int_id, lora.version), lora.slot
        request.queued_ts = time.monotonic()
        self.requests[request_id] = request
        self.runner.add_request(request)
        self.scheduler.add_request(request)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ----

    def _lora_manager(self, field: str) -> LoRAManager:
        if self.lora is None:
            raise ValueError(f"{field}: not supported without enable_lora (start the engine with enable_lora)")
        return self.lora

    def add_lora(self, lora_request: LoRARequest | dict) -> bool:
        """Load an adapter (a no-op if loaded under the same id, unless `load_inplace`, which reloads it)."""
        request = LoRARequest.of(lora_request)
        manager = self._lora_manager("lora_request")
        self._drain()  # an in-place reload writes slots that the step in flight may read
        manager.add(request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter (False if not loaded); requests already running with it finish with it."""
        return self._lora_manager("lora_id").remove(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora_manager("list_loras").ids()

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        outputs = []
        self._now = time.monotonic()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._emit(outputs, request, [], [], None, request.held_weight_version or self.weight_version)
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.routed_experts = self.runner.take_routed_experts(request)  # before its blocks are freed
        self.scheduler.finish(request, status)
        self.runner.release(request.request_id)
        if request.lora is not None:
            self.lora.release(request.lora_slot)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        schedulable = not self.unwritten_weights and self.scheduler.has_schedulable_work()
        return schedulable or self._in_flight is not None or bool(self._pending_outputs)

    def step(self) -> list[EngineCoreOutput]:
        if self.profile_session is None:
            return self._step()
        with self._profiled_step():
            return self._step()

    def _step(self) -> list[EngineCoreOutput]:
        """Read back one step's results. With async scheduling the next step is scheduled and launched first, so
        the host work of step N+1 (scheduling, input preparation) and of step N (stop checks, outputs) overlaps the
        device work of step N+1; requests that step N finishes have one wasted token computed in step N+1."""
        outputs, self._pending_outputs = self._pending_outputs, []
        try:
            current = self._in_flight or self._launch(None)
            self._in_flight = None
            if current is None:
                if self.config.enable_expert_parallel:  # the peers' forwards need this rank's (expert_parallel.py)
                    self._dummy_step()
                return outputs
            if self.config.async_scheduling:
                self._in_flight = self._launch(current)
            outputs += self._resolve(current)
        except BaseException:
            self._in_flight = None
            raise
        return outputs

    def dummy_step(self) -> None:
        """A step without requests (data-parallel lockstep: this rank has none, a peer has some). Skipped while the
        weights or the KV cache are released (asleep): there is nothing to run it on."""
        if self.profile_session is None:
            self._dummy_step()
            return
        with self._profiled_step():
            self._dummy_step()

    def _dummy_step(self) -> None:
        if self.runner.weights_resident and self.runner.kv_cache_resident:
            self.runner.execute_dummy_batch()
        self.num_dummy_steps += 1

    def _launch(self, prev: _InFlightStep | None) -> _InFlightStep | None:
        if self.unwritten_weights:  # requests wait (a keep-pause's included) rather than run on garbage
            return None
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return None
        starts = [item.request.num_computed_tokens for item in scheduled]
        launched = self.runner.launch(scheduled, prev.launched if prev is not None else None)
        self.scheduler.advance(scheduled, launched.sample_rows)
        # Share full blocks now, not when the step is read back: steps that could read them run after this one on
        # the same stream, and a request admitted next step (a GRPO sibling) would otherwise miss them. Blocks
        # holding a placeholder wait until it is resolved (their hash needs the token).
        for item in scheduled:
            request = item.request
            resolved = request.num_tokens - request.num_placeholders
            self.kv_cache.commit_full_blocks(request, min(request.num_computed_tokens, resolved))
        return _InFlightStep(launched, starts, self.weight_version)

    def _resolve(self, step: _InFlightStep) -> list[EngineCoreOutput]:
        result = self.runner.resolve(step.launched)
        self.num_steps += 1
        self._now = now = time.monotonic()  # once per step: every output of the step carries this time
        outputs = []
        for i, item in enumerate(step.launched.scheduled):
            request = item.request
            if request.status.finished:  # finished or aborted while this step ran: its row was wasted work
                continue
            start = step.starts[i]
            # A request preempted since the launch has no KV left to share (num_computed_tokens is 0).
            self.kv_cache.commit_full_blocks(request, min(start + item.num_new_tokens, request.num_computed_tokens))
            prompt_logprobs = _unsent_prompt_logprobs(request, start, result.prompt_logprobs.get(i))
            token = result.sampled_token_ids[i]
            if token is None:
                if prompt_logprobs:
                    self._emit(outputs, request, [], [], prompt_logprobs, step.weight_version)
                continue
            self.num_generated_tokens += 1
            if not request.first_token_ts:
                request.first_token_ts = now
                self.num_prompt_tokens += request.num_prompt_tokens
            status = request.resolve_placeholder(token)
            if status is not None:
                self._finish(request, status)
            self._emit(outputs, request, [token], [result.logprobs[i]], prompt_logprobs, step.weight_version)
        return outputs

    def _emit(self, outputs, request, new_tokens, new_logprobs, prompt_logprobs, weight_version: str) -> None:
        """Add the request's output for this step, or hold its tokens when its caller wants only the final output or
        streams every stream_interval tokens (an output object per request per step is most of the host's work at
        large batches). Held tokens go out
        with the finishing output, or first on their own when the weight version changes (one version per output)."""
        if request.held_token_ids and request.held_weight_version != weight_version:
            version = request.held_weight_version
            outputs.append(self._output(request, *request.take_held(), None, version, last=False))
        if (
            not request.status.finished
            and not prompt_logprobs
            and len(request.held_token_ids) + len(new_tokens) <= request.max_held_tokens
        ):
            request.hold(new_tokens, new_logprobs, weight_version)
            return
        if request.held_token_ids:
            held_tokens, held_logprobs = request.take_held()
            new_tokens, new_logprobs = held_tokens + new_tokens, held_logprobs + new_logprobs
        outputs.append(self._output(request, new_tokens, new_logprobs, prompt_logprobs, weight_version))

    def _drain(self) -> None:
        """Read back the step in flight (its outputs go out with the next `step`, or `take_pending_outputs`), so
        that the engine's state is settled: no placeholders, no device work that could race what the caller does
        next."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._pending_outputs += self._resolve(step)

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        """The outputs `_drain` read back, for the caller of a control call to send before the call's result: what a
        pause(mode="keep") drained reaches its consumers before the pause returns, not after."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _output(
        self, request, new_tokens, new_logprobs, prompt_logprobs, weight_version: str, last: bool = True
    ) -> EngineCoreOutput:
        """`last=False`: not the request's last output this step, so it carries no finish reason."""
        finished = last and request.status.finished
        first_token = None
        if new_tokens and not request.first_token_sent:
            request.first_token_sent = True
            first_token = (request.queued_ts, request.scheduled_ts, request.first_token_ts)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            new_logprobs=new_logprobs,
            new_prompt_logprobs=prompt_logprobs,
            weight_version=weight_version,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason if finished else None,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            timestamp=self._now,
            first_token=first_token,
            routed_experts=request.routed_experts if finished else self._routed_experts_so_far(request),
        )

    def _routed_experts_so_far(self, request: Request) -> np.ndarray | None:
        """A request the front end may stop on a stop string gets its routing with every output: when the front end
        stops it, the core's final output (which carries the rest) is no longer read."""
        return self.runner.take_routed_experts(request) if request.sampling_params.stop else None

    # ---- pause / resume ----

    def pause(self, mode: str, clear_cache: bool) -> list[EngineCoreOutput]:
        """Apply a pause mode. For "wait" the caller keeps stepping until `num_in_flight` is 0, then clears.
        The step in flight (async scheduling) is read back first: its tokens belong before the pause, and after a
        keep-pause returns, nothing may arrive until resume: its outputs come first among those returned."""
        mode = resolve_pause_mode(mode)
        self._drain()
        outputs = self.take_pending_outputs()  # before any abort's last outputs
        if mode == "abort":
            outputs += self.abort_requests(list(self.requests))
        self._set_pause_state(PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW)
        self.rejecting_new_requests = mode != "keep"
        if clear_cache and mode != "wait":
            self.clear_cache()
        return outputs

    def _set_pause_state(self, state: PauseState) -> None:
        # Asleep, nothing may be scheduled: the state takes effect at wake_up.
        if self.asleep:
            self._pause_before_sleep = state
        else:
            self.scheduler.pause_state = state

    @property
    def num_in_flight(self) -> int:
        return self.scheduler.num_in_flight

    def clear_cache(self) -> None:
        """Drop all KV: running requests are preempted (they recompute later) and the prefix cache is emptied."""
        self._drain()
        self.scheduler.preempt_all()
        self.kv_cache.reset_prefix_cache()

    def resume(self) -> None:
        """Lift the pause. With weights missing (see `not_serving`) nothing runs until they are written."""
        self._set_pause_state(PauseState.UNPAUSED)
        self.rejecting_new_requests = False

    def not_serving(self) -> str | None:
        """Why generation is refused (new requests end with this error, requests in flight wait), or None."""
        if not self.unwritten_weights:
            return None
        missing, total = len(self.unwritten_weights), len(self.runner.weight_names)
        example = sorted(self.unwritten_weights)[0]
        return (
            f"the model's weights are incomplete ({self._unwritten_since}): {missing} of {total} tensors (e.g. "
            f"{example!r}) hold no valid weights; generation resumes once a weight update (start_weight_update, "
            "update_weights, finish_weight_update) or a reload (load_weights, update_weights with weight_dir) has "
            "written them"
        )

    def _mark_unwritten(self, names: set[str], why: str) -> None:
        if names:
            if not self.unwritten_weights:
                self._unwritten_since = why
            self.unwritten_weights |= names

    def _written(self, names: set[str]) -> None:
        self.unwritten_weights -= names
        if self.weight_update_active:
            self._update_written |= names

    def is_paused(self) -> bool:
        state = self._pause_before_sleep if self.asleep else self.scheduler.pause_state
        return state is not PauseState.UNPAUSED

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """Forget every cached prefix; `reset_running_requests` (vLLM's) also preempts the running requests, whose
        KV then recomputes, rather than letting them keep it."""
        if reset_running_requests:
            self.clear_cache()
        else:
            self.kv_cache.reset_prefix_cache()

    # ---- sleep / wake (vLLM's names): a colocated trainer takes the device memory between rollouts ----

    def sleep(self, level: int = 1) -> None:
        """Stop scheduling and free device memory. Level 0 keeps both; level 1 drops the KV cache and moves the
        weights to host memory; level 2 drops both (the next weight update must write every weight). Requests in
        flight keep their tokens and recompute their KV after wake_up."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level: sleep level must be one of {list(SLEEP_LEVELS)}, got {level!r}")
        if self.weight_update_active:
            raise RuntimeError("sleep: a weight update is in progress; finish it first")
        self._drain()
        if not self.asleep:
            self._pause_before_sleep = self.scheduler.pause_state
            self.asleep = True
            self.sleep_level = level
        self.sleep_level = max(self.sleep_level, level)
        self.scheduler.pause_state = PauseState.PAUSED_ALL
        if level >= 1:
            self.clear_cache()  # running requests give their blocks back; they recompute after wake_up
            self.runner.release_kv_cache()
            self.runner.release_weights(keep_host_copy=level == 1)
        if level == 2:
            self._mark_unwritten(set(self.runner.weight_names), "sleep(level=2) released them")

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back what sleep released: `tags` any of "weights", "kv_cache", "scheduling" (default: all).
        As in vLLM 0.33, scheduling resumes (and the engine is awake) as soon as weights and KV cache are both back,
        so any wake_up ends a sleep of level 0. Returns whether the engine is awake."""
        tags = list(WAKE_UP_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in WAKE_UP_TAGS]
        if unknown:
            raise ValueError(f"tags: unknown wake_up tags {unknown}; expected a subset of {list(WAKE_UP_TAGS)}")
        if self.asleep:
            self.runner.restore(weights="weights" in tags, kv_cache="kv_cache" in tags)
            if self.runner.weights_resident and self.runner.kv_cache_resident:
                self.scheduler.pause_state = self._pause_before_sleep
                self.asleep = False
        return not self.asleep

    @property
    def sleep_state(self) -> str:
        """vLLM's engine_sleep_state, in words: "awake", "weights_offloaded" (level 1), "discard_all" (level 2), or
        "scheduling_paused" (level 0)."""
        if not self.asleep:
            return "awake"
        return ("scheduling_paused", "weights_offloaded", "discard_all")[self.sleep_level]

    def is_sleeping(self) -> bool:
        return self.asleep

    def _require_weights(self, operation: str) -> None:
        if not self.runner.weights_resident:
            raise RuntimeError(f"{operation}: the engine is asleep; call wake_up(tags=['weights']) first")

    # ---- weight updates ----

    def init_weight_transfer_engine(self, init_info: dict, backend: str | None = None) -> None:
        """`backend`: the one a framework's route speaks (prime-rl's /init_broadcaster, say), used when the engine
        was started without a weight-transfer config; one started with another backend refuses it."""
        from rlserve.weight_transfer import WeightTransferEngineFactory

        transfer_config = self._weight_transfer_config(backend)
        tp_size = self.config.tensor_parallel_size
        index = self.config.data_parallel_rank * tp_size  # vLLM's: dp_rank * TP + tp_rank; this is tp_rank 0
        if self.weight_transfer is not None and self._weight_transfer_backend != transfer_config.backend:
            self._close_weight_transfer()  # a framework route's backend replaces the previous one
        if self.weight_transfer is None:
            self._weight_transfer_backend = transfer_config.backend
            self.weight_transfer = WeightTransferEngineFactory.create_engine(
                transfer_config,
                self.runner.device,
                index,
                self.config.weight_transfer_timeout_s,
                model=self.runner.model,
                model_config=self.config,
            )
        parsed = self.weight_transfer.parse_init_info(init_info)
        # The other ranks start their rendezvous on threads of their own and answer at once; they join with this one.
        config = self.config
        self.runner.call_followers(
            "init_weight_transfer", transfer_config, init_info, index, config.weight_transfer_timeout_s
        )
        self.weight_transfer.init_transfer_engine(parsed)

    def _weight_transfer_config(self, backend: str | None) -> WeightTransferConfig:
        configured = self.config.weight_transfer_config
        if backend is None and configured is None:
            # The core cannot tell which front end its caller used: the fix for each, the HTTP one first.
            raise RuntimeError(
                "Weight transfer not configured: start `rlserve serve` with --weight-transfer-config "
                '\'{"backend":"nccl"}\' (over HTTP), or create the engine with '
                "weight_transfer_config=WeightTransferConfig() (in Python)"
            )
        if backend is None:
            return configured
        if configured is not None and configured.backend != backend:
            raise RuntimeError(
                f"this route speaks the {backend!r} weight transfer, but the engine was started with backend "
                f"{configured.backend!r} (--weight-transfer-config): start it without one, or with {backend!r}"
            )
        return WeightTransferConfig(backend=backend)

    def _require_transfer_engine(self, operation: str):
        if self.weight_transfer is None:
            raise RuntimeError(
                f"{operation}: the weight transfer engine is not initialized; call init_weight_transfer_engine first"
            )
        return self.weight_transfer

    def start_weight_update(self) -> None:
        self._drain()
        transfer = self._require_transfer_engine("start_weight_update")
        self._require_weights("start_weight_update")
        if self.weight_update_active:
            raise RuntimeError(
                "start_weight_update: a weight update is already in progress; finish it first, or abandon it "
                "(abandon_weight_update) if its trainer is gone"
            )
        # A copy of the weights before the first byte of the update is written; only of complete weights.
        self._snapshot_valid = self.config.weight_update_snapshot and not self.unwritten_weights
        if self._snapshot_valid:
            self._snapshot = self.runner.snapshot_weights(self._snapshot)
        self._update_written.clear()
        transfer.start_weight_update()
        self.weight_update_active = True

    def update_weights(self, update_info: dict) -> None:
        self._drain()  # no step may run while weights are being written (the core steps between update calls)
        transfer = self._require_transfer_engine("update_weights")
        if not self.weight_update_active:
            raise RuntimeError("update_weights: no weight update in progress; call start_weight_update first")
        info = transfer.parse_update_info(update_info)
        with self.runner.on_device():
            try:
                metadata = zip(info.names, info.shapes, info.dtype_names, strict=True)
                self.runner.model.check_weights(
                    ((n, tuple(s), dtype_from_name(d)) for n, s, d in metadata), whole_update=True
                )
            except ValueError:
                # The trainer may already be sending: take its bytes and drop them (on every rank, which has
                # written nothing either) so it does not hang.
                with self.runner.mirrored("receive_weights", update_info, False):
                    transfer.discard_weights(info)
                raise
            touched: set[str] = set()  # what load_weights was handed: a write that failed may have done part

            def load(weights: list[tuple[str, torch.Tensor]]) -> None:
                touched.update(self.runner.checkpoint_names(name for name, _ in weights))
                self.runner.load_weights(weights)

            if transfer.receives_into_model():  # it writes the model itself: count every tensor it names
                touched.update(self.runner.checkpoint_names(info.names))
            try:
                # Every tensor-parallel rank receives the same broadcast and keeps its part.
                with self.runner.mirrored("receive_weights", update_info, True):
                    transfer.receive(info, load)
                if self.runner.device.type == "cuda":
                    torch.cuda.synchronize(self.runner.device)
            except WeightUpdateRefused as e:  # refused before writing: nothing changed, the update stays open
                raise ValueError(f"update_info: {e}") from e  # a builtin type: it crosses to the front end as is
            except TRAINER_LOST as e:
                self._update_written |= touched
                outcome = self._abandon_weight_update(f"the trainer was lost during update_weights: {e}")
                self._close_weight_transfer()  # the transport is broken; the next trainer inits a new one
                raise RuntimeError(
                    f"update_weights: the trainer was lost during the transfer ({e}); the update was abandoned "
                    f"({outcome}); a trainer can init_weight_transfer_engine and start a new update"
                ) from e
            except Exception:
                # The trainer is still there (a refused handle, a failed copy): the update stays open, and what was
                # handed to load_weights must be sent again. Nothing handed over, nothing changed.
                self._update_written |= touched
                self._mark_unwritten(touched, "an update_weights call failed part-way through writing them")
                raise
        if transfer.applies_deltas:  # patched, not rewritten: a tensor with no valid weights still has none
            self._update_written |= touched
        else:
            self._written(touched)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._drain()
        if not self.weight_update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update")
        reason = self.not_serving()
        if reason is not None:
            raise RuntimeError(f"finish_weight_update: {reason}; send them with update_weights first")
        self.weight_update_active = False
        self._update_written.clear()
        if self.weight_transfer is not None:
            self.weight_transfer.finish_weight_update()
        # KV computed under the old weights must not be served to requests that start from now on.
        self.kv_cache.reset_prefix_cache()
        if weight_version is not None:
            self.weight_version = str(weight_version)

    def abandon_weight_update(self) -> str:
        """Give up the update in progress by hand (its trainer is gone between calls, or stuck); see
        `_abandon_weight_update`. Returns what became of the weights."""
        self._drain()
        if not self.weight_update_active:
            raise RuntimeError("abandon_weight_update: no weight update in progress")
        return self._abandon_weight_update("abandoned by hand")

    def _abandon_weight_update(self, why: str) -> str:
        """End the update in progress without finishing it. Weights it wrote are rolled back to the snapshot taken at
        its start (weight_update_snapshot), else they are from two versions and generation is refused until a full
        update. The pause it ran under is lifted: the trainer that would resume is gone, and a pause nobody lifts
        would hold every request forever (without weights nothing runs anyway). Returns "restored", "incomplete" or
        "unchanged"."""
        self.weight_update_active = False
        written, self._update_written = self._update_written, set()
        if not written:
            outcome = "unchanged"
        elif self._snapshot_valid:
            self.runner.restore_weights(self._snapshot)
            self.unwritten_weights.clear()  # the snapshot is of complete weights: a failed call's went back too
            outcome = "restored"
        else:
            self._mark_unwritten(set(self.runner.weight_names), f"a weight update was abandoned: {why}")
            outcome = "incomplete"
        self._snapshot_valid = False
        self.kv_cache.reset_prefix_cache()  # KV computed under weights that are no longer served
        self.resume()
        logger.warning("weight update abandoned (%s): weights %s", why, outcome)
        return outcome

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's collective_rpc: run `method` on every worker (one per tensor-parallel rank) between steps; one
        result per worker, in rank order. What it changes behind the engine's back (weights, say) is its own affair:
        a method that writes weights should be followed by reset_prefix_cache, as in vLLM. vLLM's own worker methods
        `update_config`, `reload_weights` and `reset_weights` run on the core, which keeps its bookkeeping of the
        weights right (and reaches every rank through its loader)."""
        self._drain()
        if isinstance(method, str):  # a function comes only from a front end in this process, which owns it
            check_rpc_method(method, extension_methods(self.worker))
            if method in ENGINE_RPC_METHODS:
                return [getattr(self, method)(*args, **(kwargs or {}))]
        args, kwargs = tuple(args), dict(kwargs or {})
        with self.runner.on_device(), self.runner.mirrored("collective_rpc", method, args, kwargs) as others:
            mine = call_worker(self.worker, method, args, kwargs)
        return [mine, *others]

    def update_config(self, overrides: dict[str, Any]) -> None:
        """vLLM's worker update_config, for what rlserve's engine reads after its start: the load format, which
        vLLM's skip_loading_weights_in_engine_init example switches from "dummy" to "auto" before reload_weights.
        Any other field is refused by name."""
        if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
            raise ValueError(f"overrides: expected {{config name: {{field: value}}}}, got {overrides!r}")
        changes: dict[str, Any] = {}
        for section, values in overrides.items():
            for name, value in values.items():
                if (section, name) not in UPDATABLE_CONFIG:
                    raise ValueError(
                        f"overrides: {section}.{name} cannot be updated on a running engine; supported: "
                        f"{[f'{s}.{n}' for s, n in UPDATABLE_CONFIG]}"
                    )
                changes[UPDATABLE_CONFIG[section, name]] = value
        try:
            config = replace(self.config, **changes)  # checked as at start
        except ValueError as e:
            raise ValueError(f"overrides: {e}") from e
        self.config = self.runner.config = config

    def reload_weights(
        self, weights_iterator=None, weights_path: str | None = None, is_checkpoint_format: bool = True
    ) -> None:
        """vLLM's worker reload_weights: write `weights_iterator` (checkpoint names; a core in the caller's process
        only), else read the checkpoint in `weights_path`, else the model's own directory, in place. Every tensor is
        checked before any is written, and the prefix cache is emptied."""
        if is_checkpoint_format is not True:
            raise ValueError(
                f"is_checkpoint_format: rlserve loads checkpoint-format names only, got {is_checkpoint_format!r}"
            )
        if weights_iterator is not None:
            self.load_weights_direct(weights_iterator)
            return
        if self.config.load_format == "dummy":
            raise ValueError(
                "load_format: the engine's load format is 'dummy', which reads no checkpoint; switch it first with "
                "collective_rpc('update_config', args=({'load_config': {'load_format': 'auto'}},))"
            )
        if weights_path is None:  # the served model's own directory, whatever the allowed ones
            self._load_checkpoint_dir(self.config.model, "weights_path")
        else:
            self.load_weights_from_dir(weights_path, "weights_path")

    def reset_weights(self) -> None:
        """vLLM's weight-checker reset: every weight zeroed, to check that the next update writes them all. rlserve
        refuses generation (not_serving) until writes cover them again, rather than serve from zeros."""
        self._require_weights("reset_weights")
        with self.runner.on_device():
            for _, tensor in self.runner.model.checkpoint_weights():
                tensor.zero_()
        self._mark_unwritten(set(self.runner.weight_names), "the weight checker's reset zeroed them")
        self.kv_cache.reset_prefix_cache()

    def load_weights_direct(self, weights, reset_prefix_cache: bool = True) -> int:
        """Write checkpoint-format tensors straight into the model. `reset_prefix_cache=False` keeps KV computed
        under the old weights servable (only a tool that demonstrates stale KV wants that)."""
        self._drain()
        self._require_weights("load_weights")
        weights = list(weights)
        written = self.runner.load_weights_on_all_ranks(weights)  # checks every tensor before writing any
        self._written(self.runner.checkpoint_names(name for name, _ in weights))
        if reset_prefix_cache:
            self.kv_cache.reset_prefix_cache()
        return written

    def load_weights_from_dir(self, weight_dir: str, param: str = "weight_dir") -> int:
        """prime-rl's checkpoint-directory update: the safetensors files the trainer wrote to `weight_dir` (which
        the API server has checked against the operator's allowed directories), read here rather than shipped
        through the front end, and written through `load_weights_direct`: every tensor is checked before any is
        written, so a refused directory changes nothing. With `allowed_weight_dirs` configured the core checks the
        directory too (the API server's check, again)."""
        allowed = self.config.allowed_weight_dirs
        if allowed is not None:
            weight_dir = confined_weight_dir(weight_dir, allowed, param)
        return self._load_checkpoint_dir(weight_dir, param)

    def _load_checkpoint_dir(self, weight_dir: str, param: str) -> int:
        from rlserve.model.loader import iterate_checkpoint

        try:
            weights = list(iterate_checkpoint(weight_dir))
        except Exception as e:  # no safetensors there, a truncated file, ...
            raise ValueError(f"{param}: cannot read safetensors weights from {weight_dir!r}: {e}") from e
        try:
            return self.load_weights_direct(weights)
        except ValueError as e:  # the model's check names the tensor; the client sent the directory
            raise ValueError(f"{param}: {e}") from e

    def shutdown_weight_transfer_engine(self) -> None:
        """vLLM's: close the trainer's transfer group (a later init_weight_transfer_engine opens a new one)."""
        if self.weight_update_active:
            raise RuntimeError("shutdown_weight_transfer_engine: a weight update is in progress; finish it first")
        self._close_weight_transfer()

    def get_weight_version(self) -> str:
        return self.weight_version

    def checksums(self) -> dict[str, str]:
        self._drain()
        self._require_weights("weight checksums")
        from rlserve.weight_transfer.checksum import weight_checksums

        # The whole tensors (every rank's part put together): what a trainer, or an engine of another size, has.
        return weight_checksums(self.runner.full_checkpoint_weights())

    # ---- profiling (vLLM's start_profile / stop_profile; see profiler.py) ----

    def start_profile(
        self,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
        profiler_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Open a profiling session; tracing starts now, or after `delay_iterations` steps."""
        config = require_profiling(self.config)
        if self.profile_session is not None:
            raise RuntimeError(ALREADY_ACTIVE)
        check_session(config, profile_prefix, delay_iterations, max_iterations, profiler_kwargs)
        session = ProfileSession(
            profile_prefix,
            config.delay_iterations if delay_iterations is None else delay_iterations,
            config.max_iterations if max_iterations is None else max_iterations,
            profiler_kwargs,
        )
        if session.should_start():
            self._start_tracing(session)
        self.profile_session = session

    def stop_profile(self) -> None:
        """End the session, writing each rank's trace if it is tracing; a no-op (logged) without a session, as in
        vLLM."""
        require_profiling(self.config)
        session, self.profile_session = self.profile_session, None
        if session is None:
            logger.warning("stop_profile: no profiling session is active; nothing to stop")
            return
        if session.tracing:
            self._stop_tracing(session)
        elif not session.done:
            logger.info("stop_profile: the session ended within its %d delay steps; nothing was traced", session.delay)

    def _start_tracing(self, session: ProfileSession) -> None:
        """Start this rank's profiler and its tensor-parallel followers'; all or none."""
        self.profiler.start(trace_name(self.config, 0, session.prefix), session.overrides)
        try:
            self.runner.call_followers("start_profile", session.prefix, session.overrides)
        except BaseException:
            self.profiler.stop()
            raise
        session.tracing = True

    def _stop_tracing(self, session: ProfileSession) -> None:
        session.tracing = False
        paths = [self.profiler.stop()]
        paths += self.runner.call_followers("stop_profile")
        logger.info("profile traces written: %s", ", ".join(paths))

    @contextlib.contextmanager
    def _profiled_step(self):
        """One step of a profiling session: tracing starts before it once the delay has passed, the step is a range of
        the trace, and tracing stops after it at max_steps (a profiler's failure is logged, never a failed step)."""
        session = self.profile_session
        if session.should_start():
            try:
                self._start_tracing(session)
            except Exception:
                logger.exception("the profiler did not start; this session traces nothing")
                session.done = True
        if session.tracing:
            with self.profiler.step_range(len(self.requests)):
                yield
        else:
            yield
        if session.stepped():
            session.done = True
            try:
                self._stop_tracing(session)
            except Exception:
                logger.exception("writing the profile trace failed")

    def shutdown(self) -> None:
        session, self.profile_session = self.profile_session, None
        if session is not None and session.tracing:  # the trace so far is written, as vLLM's worker shutdown does
            try:
                self._stop_tracing(session)
            except Exception:
                logger.exception("writing the profile trace at shutdown failed")
        self._close_weight_transfer()
        self.runner.shutdown()

    def _close_weight_transfer(self) -> None:
        if self.weight_transfer is not None:
            with self.runner.mirrored("close_weight_transfer"):
                self.weight_transfer.shutdown()
            self.weight_transfer = None


def _unsent_prompt_logprobs(
    request: Request, start: int, computed: list[PositionLogprobsData] | None
) -> list[PositionLogprobsData] | None:
    """The part of a prefill chunk's prompt logprobs (its first row is prompt position `start`) not sent before: a
    request preempted after its prompt was computed recomputes it, and must not send those positions twice."""
    if computed is None:
        return None
    unsent = computed[max(0, request.num_prompt_logprobs_emitted - start) :]
    request.num_prompt_logprobs_emitted += len(unsent)
    return unsent


def _eos_token_ids(hf_config, model_dir: str) -> set[int]:
    from transformers import GenerationConfig

    ids = getattr(hf_config, "eos_token_id", None)
    try:
        ids = GenerationConfig.from_pretrained(model_dir).eos_token_id or ids
    except OSError:
        pass
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else set(ids)
