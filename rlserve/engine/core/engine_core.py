"""The engine core's data plane: owns the scheduler, the KV cache and rank 0's model runner, and steps the batch in
four phases: schedule, run (launch on the device), update (read back, each request takes its token) and emit.

What controls the engine between steps lives in collaborators, each holding its own state: `pausing` (pause.py),
`sleeping` (sleep.py), `weights` (weights.py), `loras` (loras.py), `profiling` (profiling.py) and `rpc`
(worker_rpc.py). EngineCoreService (service.py) routes the front ends' control calls to them.

It is synchronous and single-threaded on purpose: `LLM` drives it directly, `AsyncLLM` from one background thread,
so a weight update can never race a forward pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed import TCPStore

from rlserve.config import EngineConfig
from rlserve.engine.core.device_defaults import with_device_defaults
from rlserve.engine.core.lora_manager import LoRAManager
from rlserve.engine.core.loras import LoRAControl
from rlserve.engine.core.pause import PauseControl
from rlserve.engine.core.profiling import ProfileControl
from rlserve.engine.core.sleep import SleepControl
from rlserve.engine.core.weights import WeightControl
from rlserve.engine.core.worker_rpc import WorkerRPC
from rlserve.engine.sched.batch import ScheduledRequest
from rlserve.engine.sched.kv_cache import KVCacheManager
from rlserve.engine.sched.request import Request, RequestStatus
from rlserve.engine.sched.scheduler import Scheduler, SchedulerConfig
from rlserve.engine.wire.messages import EngineCoreOutput
from rlserve.engine.worker.step_outputs import LaunchedStep, RunnerOutput
from rlserve.engine.worker.tp_workers import create_runner
from rlserve.lora.request import LoRARequest
from rlserve.outputs import PositionLogprobsData
from rlserve.sampling_params import SamplingParams


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
        self.eos_token_ids = frozenset(_eos_token_ids(self.runner.hf_config, config.model))
        self._in_flight: _InFlightStep | None = None  # launched, not yet read back (async scheduling)
        self._pending_outputs: list[EngineCoreOutput] = []  # read back by `drain`, returned by the next step
        self.num_generated_tokens = 0  # counters for metrics
        self.num_prompt_tokens = 0  # of the requests that got their first token (vLLM counts them at prefill)
        self.num_steps = 0
        self.num_dummy_steps = 0
        self._now = 0.0  # time.monotonic() of the step (or abort) whose outputs are being made
        # The control plane (see the module doc).
        self.pausing = PauseControl(self)
        self.weights = WeightControl(self, self.pausing)
        self.sleeping = SleepControl(self, self.pausing, self.weights)
        lora = LoRAManager(self.runner, config.max_loras, config.max_lora_rank) if config.enable_lora else None
        self.loras = LoRAControl(self, lora)
        self.rpc = WorkerRPC(self, self.weights)
        self.profiling = ProfileControl(self)

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
        lora = None if lora_request is None else self.loras.require("lora_request").get(lora_request)
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

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        outputs = []
        self._now = time.monotonic()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._emit(outputs, request, [], [], None, request.held_weight_version or self.weights.version)
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.routed_experts = self.runner.take_routed_experts(request)  # before its blocks are freed
        self.scheduler.finish(request, status)
        self.runner.release(request.request_id)
        if request.lora is not None:
            self.loras.manager.release(request.lora_slot)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        schedulable = not self.weights.unwritten and self.scheduler.has_schedulable_work()
        return schedulable or self._in_flight is not None or bool(self._pending_outputs)

    # ---- the step: schedule, run, update, emit ----

    def step(self) -> list[EngineCoreOutput]:
        """Return one step's outputs. With async scheduling the next step is scheduled and run (launched) before this
        one is read back, so the host work of step N+1 (scheduling, input preparation) and of step N (stop checks,
        outputs) overlaps the device work of step N+1; requests that step N finishes have one wasted token computed
        in step N+1."""
        with self.profiling.step():
            outputs = self.take_pending_outputs()
            try:
                current = self._in_flight or self._schedule_and_run(None)
                self._in_flight = None
                if current is None:
                    if self.config.enable_expert_parallel:  # the peers' forwards need this rank's (expert_parallel.py)
                        self._dummy_step()
                    return outputs
                if self.config.async_scheduling:
                    self._in_flight = self._schedule_and_run(current)
                outputs += self._read_back(current)
            except BaseException:
                self._in_flight = None
                raise
            return outputs

    def dummy_step(self) -> None:
        """A step without requests (data-parallel lockstep: this rank has none, a peer has some). Skipped while the
        weights or the KV cache are released (asleep): there is nothing to run it on."""
        with self.profiling.step():
            self._dummy_step()

    def _dummy_step(self) -> None:
        if self.runner.weights_resident and self.runner.kv_cache_resident:
            self.runner.execute_dummy_batch()
        self.num_dummy_steps += 1

    def _schedule_and_run(self, prev: _InFlightStep | None) -> _InFlightStep | None:
        scheduled = self._schedule()
        return self._run(scheduled, prev) if scheduled else None

    def _schedule(self) -> list[ScheduledRequest]:
        if self.weights.unwritten:  # requests wait (a keep-pause's included) rather than run on garbage
            return []
        return self.scheduler.schedule()

    def _run(self, scheduled: list[ScheduledRequest], prev: _InFlightStep | None) -> _InFlightStep:
        """Launch the batch on the device without waiting for it, and count its tokens as computed."""
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
        return _InFlightStep(launched, starts, self.weights.version)

    def _read_back(self, step: _InFlightStep) -> list[EngineCoreOutput]:
        """Wait for a step's results, update each request with its row, and emit their outputs."""
        result = self.runner.resolve(step.launched)
        self.num_steps += 1
        self._now = time.monotonic()  # once per step: every output of the step carries this time
        outputs: list[EngineCoreOutput] = []
        for i, item in enumerate(step.launched.scheduled):
            request = item.request
            if request.status.finished:  # finished or aborted while this step ran: its row was wasted work
                continue
            token, prompt_logprobs = self._update(item, step.starts[i], result, i)
            if token is not None:
                self._emit(outputs, request, [token], [result.logprobs[i]], prompt_logprobs, step.weight_version)
            elif prompt_logprobs:
                self._emit(outputs, request, [], [], prompt_logprobs, step.weight_version)
        return outputs

    def _update(
        self, item: ScheduledRequest, start: int, result: RunnerOutput, i: int
    ) -> tuple[int | None, list[PositionLogprobsData] | None]:
        """Apply row `i` of a step read back to its request: its full blocks shared, its sampled token (if it
        sampled) taken, which may finish it. Returns the token and the prompt logprobs not sent before."""
        request = item.request
        # A request preempted since the launch has no KV left to share (num_computed_tokens is 0).
        self.kv_cache.commit_full_blocks(request, min(start + item.num_new_tokens, request.num_computed_tokens))
        prompt_logprobs = _unsent_prompt_logprobs(request, start, result.prompt_logprobs.get(i))
        token = result.sampled_token_ids[i]
        if token is None:
            return None, prompt_logprobs
        self.num_generated_tokens += 1
        if not request.first_token_ts:
            request.first_token_ts = self._now
            self.num_prompt_tokens += request.num_prompt_tokens
        status = request.resolve_placeholder(token)
        if status is not None:
            self._finish(request, status)
        return token, prompt_logprobs

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

    def drain(self) -> None:
        """Read back the step in flight (its outputs go out with the next `step`, or `take_pending_outputs`), so
        that the engine's state is settled: no placeholders, no device work that could race what the caller does
        next."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._pending_outputs += self._read_back(step)

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        """The outputs `drain` read back, for the caller of a control call to send before the call's result: what a
        pause(mode="keep") drained reaches its consumers before the pause returns, not after."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    # ---- control calls of a caller that drives this core itself (tests, tools), made on its collaborators ----

    def pause(self, mode: str, clear_cache: bool) -> list[EngineCoreOutput]:
        return self.pausing.pause(mode, clear_cache)

    def resume(self) -> None:
        self.pausing.resume()

    def is_paused(self) -> bool:
        return self.pausing.is_paused()

    def add_lora(self, lora_request: LoRARequest | dict) -> bool:
        return self.loras.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.loras.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.loras.list_loras()

    def shutdown(self) -> None:
        self.profiling.shutdown()
        self.weights.close_transfer()
        self.runner.shutdown()


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
