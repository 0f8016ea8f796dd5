"""Continuous batching: each step gives running requests their next tokens first, then admits waiting ones.

One step can mix decodes and (chunks of) prefills under a token budget. When KV blocks run out, the most recently
admitted running request is preempted: its blocks are freed and it is recomputed later (no request is lost).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass

from rlserve.engine.sched.batch import ScheduledRequest
from rlserve.engine.sched.kv_cache import KVCacheManager
from rlserve.engine.sched.request import Request, RequestStatus


class PauseState(enum.Enum):
    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"  # running requests continue; nothing new is admitted
    PAUSED_ALL = "paused_all"  # nothing is scheduled


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pause_state = PauseState.UNPAUSED
        self.num_preemptions = 0  # since start, for metrics
        # Waiting requests the last step held back for another request's prefix rather than for capacity (vLLM's
        # "deferred" waiting reason), for metrics.
        self.num_deferred = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_in_flight(self) -> int:
        """Requests that have started: running ones and preempted ones waiting to be readmitted."""
        return len(self.running) + sum(1 for r in self.waiting if r.num_preemptions)

    def has_schedulable_work(self) -> bool:
        if self.pause_state is PauseState.PAUSED_ALL:
            return False
        if self.pause_state is PauseState.PAUSED_NEW:
            return self.num_in_flight > 0
        return bool(self.running or self.waiting)

    def schedule(self) -> list[ScheduledRequest]:
        self.num_deferred = 0
        if self.pause_state is PauseState.PAUSED_ALL:
            return []
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_output_tokens >= request.max_output_tokens:
                i += 1  # its last token is still on the device; reading it back finishes the request
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate(request, num_new):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1
        # After a preemption blocks are short: admitting now would only thrash.
        if not preempted:
            self._admit_waiting(scheduled, budget)
        return scheduled

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        deferred: list[Request] = []  # their prefix is being computed by another request; they keep their place
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            # While pausing for new work (PAUSED_NEW), only requests that already started may come back.
            if self.pause_state is PauseState.PAUSED_NEW and not request.num_preemptions:
                break
            if self.kv_cache.waits_for_another(request):
                deferred.append(self.waiting.popleft())
                if len(deferred) >= self.config.max_num_seqs:
                    break  # bounds the scan of a long queue of one prompt's samples to what a step could admit
                continue
            num_cached = self.kv_cache.match_prefix(request)
            request.num_computed_tokens = num_cached
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    self.kv_cache.free(request)
                    request.num_computed_tokens = 0
                    break
                num_new = budget
            if not self.kv_cache.allocate(request, num_new):
                self.kv_cache.free(request)
                request.num_computed_tokens = 0
                break
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if not request.scheduled_ts:  # the first admission: a readmission after preemption is not queue time
                request.scheduled_ts = time.monotonic()
            self.kv_cache.mark_in_progress(request, num_cached)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        self.num_deferred = len(deferred)

    def preempt(self, request: Request) -> None:
        """Free the request's KV and queue it first in line; it recomputes its tokens when readmitted."""
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def preempt_all(self) -> None:
        for request in reversed(list(self.running)):
            self.preempt(request)

    def advance(self, scheduled: list[ScheduledRequest], sample_rows: list[int]) -> None:
        """Account for a launched step: its tokens count as computed, and each request that samples gets a
        placeholder token, so the next step can be scheduled before this one's tokens are read back."""
        for item in scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        for i in sample_rows:
            scheduled[i].request.append_placeholder()

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv_cache.free(request)
