"""Front-end side of the engine: turns core outputs into RequestOutputs (text, logprobs, n samples per request).

It also times each sample for metrics (vLLM's per-request histograms) when given a `RequestStatsObserver`: the front
end's clock for arrival and end, the core's step times for the rest. Both are time.monotonic() of the same host
(the core is reached over an ipc:// socket or runs in this process), so their differences are meaningful.
"""

from __future__ import annotations

import time
import types
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from transformers import PreTrainedTokenizerBase

from rlserve.engine.frontend.core_client import RequestRefusedError, refusal
from rlserve.engine.frontend.detokenizer import Detokenizer, find_stop_string, make_detokenizer
from rlserve.engine.wire.messages import EngineCoreOutput
from rlserve.outputs import CompletionOutput, Logprob, PositionLogprobs, PositionLogprobsData, RequestOutput
from rlserve.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass
class _Sample:
    index: int
    params: SamplingParams
    detokenizer: Detokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    weight_versions: list[str] = field(default_factory=list)
    routed_experts: list[np.ndarray] = field(default_factory=list)  # as the core's outputs bring them
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for DELTA outputs
    sent_text: int = 0
    first_token: tuple[float, float, float] | None = None  # the core's (queued, scheduled, first token) times
    last_token_ts: float = 0.0  # the core's time of the step that sent the latest token


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    kind: RequestOutputKind
    prompt_logprobs: list[PositionLogprobs | None] | None
    arrival: float = 0.0  # time.monotonic() when the front end took the request
    num_cached_tokens: int = 0
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        # A loop, not all(genexpr): read for every request at every step, and a generator per call showed up.
        for s in self.samples:
            if s.finish_reason is None:
                return False
        return True


class RequestStatsObserver(Protocol):
    """Receives each sample's latencies as its outputs arrive (the server's Prometheus metrics implement it)."""

    def first_token(self, ttft: float) -> None: ...

    def inter_token(self, latency: float, count: int) -> None:
        """`count` tokens whose mean gap is `latency`: one output may carry several (stream_interval, final-only
        requests), and the core sends one time per output, not per token."""

    def finished(self, finish_reason: str, e2e: float, phases: tuple[float, float, float] | None) -> None:
        """`phases`: (queue, prefill, decode) seconds, or None for a sample that ended before its first token."""


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.stats: RequestStatsObserver | None = None
        self.states: dict[str, _RequestState] = {}  # by request id
        self.child_to_parent: dict[str, tuple[str, int]] = {}
        self._token_text: dict[int, str] = {}
        # Request id -> the core's refusal of it; the front end takes it (`take_error`) with the request's final
        # output and raises it instead. Empty but for refusals.
        self.errors: dict[str, RequestRefusedError] = {}
        # Child id -> request id, for the samples this front end is done with that the core has not ended yet (an
        # abort on its way): their late outputs must not reach a new request of the same id.
        self.unended: dict[str, str] = {}
        self._unended_requests: Counter[str] = Counter()

    @property
    def request_states(self) -> Mapping[str, _RequestState]:
        """vLLM's name for the requests in flight, by request id; read-only (verl lists them before it pauses)."""
        return types.MappingProxyType(self.states)

    def in_use(self, request_id: str, n: int = 1) -> bool:
        """Whether a request `request_id` of `n` samples would share an id with one the core may still run."""
        if request_id in self.states or request_id in self._unended_requests:
            return True
        children = (child_request_id(request_id, i, n) for i in range(n))
        return any(c in self.child_to_parent or c in self.unended for c in children)

    def _left_to_the_core(self, child_id: str, request_id: str) -> None:
        self.unended[child_id] = request_id
        self._unended_requests[request_id] += 1

    def _ended_by_the_core(self, child_id: str) -> None:
        request_id = self.unended.pop(child_id)
        self._unended_requests[request_id] -= 1
        if not self._unended_requests[request_id]:
            del self._unended_requests[request_id]

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; returns the (child request id, params) pairs to hand to the engine core."""
        samples, children = [], []
        for i in range(params.n):
            child_params = params.child(i)
            # Text is built token by token only where someone reads it early (streams, stop strings); a final-only
            # output decodes once at the end, which keeps detokenization off the step loop of offline runs.
            detok = None
            if params.detokenize and (params.stop or params.output_kind is not RequestOutputKind.FINAL_ONLY):
                detok = make_detokenizer(self.tokenizer, params.skip_special_tokens)
            samples.append(_Sample(i, child_params, detok, logprobs=[] if params.logprobs is not None else None))
            child_id = child_request_id(request_id, i, params.n)
            self.child_to_parent[child_id] = (request_id, i)
            children.append((child_id, child_params))
        prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.states[request_id] = _RequestState(
            request_id, prompt, list(prompt_token_ids), samples, params.output_kind, prompt_logprobs, time.monotonic()
        )
        return children

    def child_ids(self, request_id: str) -> list[str]:
        state = self.states.get(request_id)
        if state is None:
            return []
        return [child_request_id(request_id, s.index, len(state.samples)) for s in state.samples]

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _position_logprobs(self, data: PositionLogprobsData, token_id: int) -> PositionLogprobs:
        ids, values, token_value, token_rank = data
        if not ids:  # only the chosen token's logprob (logprobs=0, RL's usual ask): one entry, built directly
            return {token_id: Logprob(token_value, token_rank, self.token_text(token_id))}
        entry = {
            tid: Logprob(v, rank + 1, self.token_text(tid))
            for rank, (tid, v) in enumerate(zip(ids, values, strict=True))
        }
        if token_id not in entry:
            entry[token_id] = Logprob(token_value, token_rank, self.token_text(token_id))
        else:
            entry[token_id].rank = token_rank
        return entry

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to deliver and the child request ids the core must stop (stop strings hit)."""
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        stats = self.stats
        for out in core_outputs:
            if self.unended and out.request_id in self.unended:
                if out.finish_reason is not None:
                    self._ended_by_the_core(out.request_id)
                continue
            parent = self.child_to_parent.get(out.request_id)
            if parent is None:
                continue
            state = self.states[parent[0]]
            sample = state.samples[parent[1]]
            if sample.finish_reason is not None:
                continue  # the core may run a token or two past a stop string before its abort lands
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.error is not None:
                self.errors.setdefault(state.request_id, refusal(out.error, out.error_retryable))
            if out.new_prompt_logprobs and state.prompt_logprobs is not None and sample.index == 0:
                offset = len(state.prompt_logprobs)
                for j, data in enumerate(out.new_prompt_logprobs):
                    state.prompt_logprobs.append(self._position_logprobs(data, state.prompt_token_ids[offset + j]))
            self._add_tokens(sample, out)
            if stats is not None and out.new_token_ids:
                _observe_tokens(stats, state, sample, out)
            if sample.finish_reason is None and out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            elif sample.finish_reason is not None and out.finish_reason is None:
                to_abort.append(out.request_id)  # finished by a stop string
                self._left_to_the_core(out.request_id, state.request_id)
            if sample.finish_reason is not None:
                self.child_to_parent.pop(out.request_id, None)
                if stats is not None:
                    _observe_finished(stats, state, sample)
            touched[state.request_id] = state
        results = []
        for state in touched.values():
            finished = state.finished
            if state.kind is RequestOutputKind.FINAL_ONLY and not finished:
                continue
            results.append(self._make_output(state, finished))
            if finished:
                del self.states[state.request_id]
        return results, to_abort

    def take_error(self, request_id: str) -> RequestRefusedError | None:
        """The core's refusal of request `request_id` (None if it did not refuse it), once."""
        return self.errors.pop(request_id, None) if self.errors else None

    def _add_tokens(self, sample: _Sample, out: EngineCoreOutput) -> None:
        params = sample.params
        # Whole lists at a time: a final-only output carries every token of its sample at once.
        sample.token_ids.extend(out.new_token_ids)
        sample.weight_versions.extend([out.weight_version] * len(out.new_token_ids))
        if out.routed_experts is not None:
            sample.routed_experts.append(out.routed_experts)
        if sample.logprobs is not None:
            cumulative = sample.cumulative_logprob or 0.0
            for token_id, data in zip(out.new_token_ids, out.new_logprobs, strict=True):
                if data is not None:
                    entry = self._position_logprobs(data, token_id)
                    sample.logprobs.append(entry)
                    cumulative += entry[token_id].logprob
                    sample.cumulative_logprob = cumulative
        if sample.detokenizer is None or not out.new_token_ids:
            return
        new_ids = (
            out.new_token_ids[:-1]
            if _hides_stop_token(params, out.finish_reason, out.stop_reason)
            else out.new_token_ids
        )
        delta = sample.detokenizer.add(new_ids)
        if out.finish_reason is not None:  # no token will complete a pending character now
            delta += sample.detokenizer.flush()
        sample.text += delta
        if params.stop and delta:
            hit = find_stop_string(sample.text, len(delta), params.stop, params.include_stop_str_in_output)
            if hit is not None:
                sample.text = sample.text[: hit[1]]
                sample.finish_reason, sample.stop_reason = "stop", hit[0]

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        completions = []
        delta = state.kind is RequestOutputKind.DELTA
        for s in state.samples:
            if s.detokenizer is None and s.params.detokenize and s.finish_reason is not None:
                ids = s.token_ids[:-1] if _hides_stop_token(s.params, s.finish_reason, s.stop_reason) else s.token_ids
                s.text = self.tokenizer.decode(ids, skip_special_tokens=s.params.skip_special_tokens)
            t0, c0 = (s.sent_tokens, s.sent_text) if delta else (0, 0)
            completions.append(
                CompletionOutput(
                    index=s.index,
                    text=s.text[c0:],
                    token_ids=s.token_ids[t0:],
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=None if s.logprobs is None else s.logprobs[t0:],
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    weight_versions=s.weight_versions[t0:],
                    routed_experts=(
                        np.concatenate(s.routed_experts) if s.finish_reason is not None and s.routed_experts else None
                    ),
                )
            )
            s.sent_tokens, s.sent_text = len(s.token_ids), len(s.text)
        prompt_logprobs = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:
            prompt_logprobs = None
        state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
        )

    def abort(self, request_id: str, in_core: bool = True) -> RequestOutput | None:
        """Mark every unfinished sample of the request aborted and return its final output. `in_core`: the core
        got the request, so its id stays in use until the core ends each sample (False: the send failed)."""
        state = self.states.get(request_id)
        if state is None:
            return None
        for s in state.samples:
            child_id = child_request_id(request_id, s.index, len(state.samples))
            if s.finish_reason is None:
                s.finish_reason = "abort"
                if in_core:
                    self._left_to_the_core(child_id, request_id)
                if self.stats is not None:
                    _observe_finished(self.stats, state, s)
            self.child_to_parent.pop(child_id, None)
        del self.states[request_id]
        return self._make_output(state, finished=True)


def _observe_tokens(stats: RequestStatsObserver, state: _RequestState, sample: _Sample, out: EngineCoreOutput) -> None:
    """Time to first token (from the front end's arrival) and the gaps between the core's steps, per output."""
    count = len(out.new_token_ids)
    previous = sample.last_token_ts
    if out.first_token is not None:
        sample.first_token = out.first_token
        previous = out.first_token[2]
        stats.first_token(previous - state.arrival)
        count -= 1  # the first token has no gap before it
    if count and previous:
        stats.inter_token((out.timestamp - previous) / count, count)
    sample.last_token_ts = out.timestamp


def _observe_finished(stats: RequestStatsObserver, state: _RequestState, sample: _Sample) -> None:
    phases = None
    if sample.first_token is not None:
        queued, scheduled, first = sample.first_token
        phases = (scheduled - queued, first - scheduled, sample.last_token_ts - first)
    stats.finished(sample.finish_reason, time.monotonic() - state.arrival, phases)


def _hides_stop_token(params: SamplingParams, finish_reason: str | None, stop_reason: int | str | None) -> bool:
    """vLLM leaves the token that stopped a request (a stop token id or EOS) out of the text, unless asked."""
    return finish_reason == "stop" and not isinstance(stop_reason, str) and not params.include_stop_str_in_output
