"""Prometheus metrics of one server: vLLM's `vllm:` series (same names, types, labels and buckets, so scrapers and
dashboards written for vLLM read them) and rlserve's RL series.

Where each figure comes from:
- the engine core's gauges and counters (running/waiting, KV usage, prefix-cache queries/hits, prompt/generation
  tokens, preemptions) are read from `AsyncLLM.stats()` at scrape time: the core lives in another process and counts
  for every front end, so any API server reports the engine-wide values;
- per-request histograms (TTFT, inter-token latency, e2e, queue, prefill, decode) and finished requests are observed
  in this front end as outputs arrive (`RequestStatsObserver`), each API server for its own requests. With several
  API server processes `rlserve serve` sets PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode, vLLM's
  choice too): every process writes its series there, and a scrape of any of them sums all of them, each request
  counted once;
- the RL histograms answer where a slow weight sync goes: each control route's duration, start -> finish of every
  weight update, and how long generation stood still between a pause and its resume.

Separate registries per server (not the global one): several apps in one process must not collide.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from rlserve.engine.frontend.async_llm import AsyncLLM

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# vLLM labels its engine series with the model and the engine index: per data-parallel rank for the engine cores'
# series; the per-request series of a front end are engine "0".
ENGINE_INDEX = "0"
ENGINE_LABELS = ("model_name", "engine")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vllm:engine_sleep_state's (level 0: all at 0)

# vLLM's buckets (vllm/v1/metrics/buckets.py), so histograms from both engines can be compared and aggregated.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
# From a millisecond (an ipc sync of a small model) to a minute (an NCCL rendezvous).
RL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reports the engine core's state as of the last `update` (the core lives in another process: reading it is an
    async call, and prometheus collects synchronously). Counters are the core's counts since start, so they are
    monotonic whoever scrapes and however often. With data parallel each rank is a sample of its own, labelled
    engine="<rank>" as vLLM labels its engine cores (a dashboard sums them); one core is engine="0"."""

    def __init__(self, model_name: str) -> None:
        self.stats: dict[str, Any] | None = None
        self.model_name = model_name

    def _family(self, kind: type, name: str, doc: str, ranks: list[dict[str, Any]], key: str) -> Metric:
        metric = kind(name, doc, labels=ENGINE_LABELS)
        for rank, stats in enumerate(ranks):
            metric.add_metric([self.model_name, str(rank)], float(stats[key]))
        return metric

    def _waiting_by_reason(self, ranks: list[dict[str, Any]]) -> Metric:
        """vLLM 0.33's split of vllm:num_requests_waiting (its label values): "capacity", waiting for room in the
        batch or the KV cache; "deferred", held back by a transient constraint (here: another request is computing
        the same prefix). prime-rl's concurrency controller reads the capacity queue."""
        metric = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints. Sum of all reasons equals vllm:num_requests_waiting.",
            labels=(*ENGINE_LABELS, "reason"),
        )
        for rank, stats in enumerate(ranks):
            deferred = stats["num_waiting_deferred"]
            metric.add_metric([self.model_name, str(rank), "capacity"], float(stats["num_waiting"] - deferred))
            metric.add_metric([self.model_name, str(rank), "deferred"], float(deferred))
        return metric

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        ranks = stats.get("data_parallel") or [stats]
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for kind, name, doc, key in (
            (gauge, "vllm:num_requests_running", "Requests in the running batch.", "num_running"),
            (gauge, "vllm:num_requests_waiting", "Requests waiting to run.", "num_waiting"),
            (gauge, "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", "kv_cache_usage"),
            (counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in prefix cache.", "prefix_cache_queries"),
            (counter, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
            (counter, "vllm:prompt_tokens", "Prefill tokens processed.", "num_prompt_tokens"),
            (counter, "vllm:generation_tokens", "Generation tokens processed.", "num_generated_tokens"),
            (counter, "vllm:num_preemptions", "Preemptions of running requests.", "num_preemptions"),
            (gauge, "rlserve_is_paused", "1 while generation is paused.", "is_paused"),
            (
                counter,
                "rlserve_dummy_steps",
                "Steps run without requests to keep data-parallel ranks in lockstep.",
                "num_dummy_steps",
            ),
        ):
            yield self._family(kind, name, doc, ranks, key)
        yield self._waiting_by_reason(ranks)
        # vLLM's info series is a gauge at 1 whose labels are the cache config and the engine (no model_name).
        configs = [
            {name: str(value) for name, value in rank_stats["cache_config"].items()} | {"engine": str(rank)}
            for rank, rank_stats in enumerate(ranks)
        ]
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the engine's cache config.", labels=configs[0]
        )
        for config in configs:
            info.add_metric(list(config.values()), 1.0)
        yield info
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            labels=(*ENGINE_LABELS, "sleep_state"),
        )
        for rank, rank_stats in enumerate(ranks):
            for state in SLEEP_STATES:
                sleep.add_metric([self.model_name, str(rank), state], float(rank_stats["sleep_state"] == state))
        yield sleep
        incomplete = GaugeMetricFamily(
            "rlserve_weights_incomplete",
            "1 while generation is refused because weights are missing (sleep level 2, an abandoned update) until an "
            "update writes them.",
            labels=ENGINE_LABELS,
        )
        version = InfoMetricFamily("rlserve_weight_version", "The weight version now served.", labels=ENGINE_LABELS)
        for rank, rank_stats in enumerate(ranks):
            incomplete.add_metric([self.model_name, str(rank)], float(rank_stats["num_unwritten_weights"] > 0))
            version.add_metric([self.model_name, str(rank)], {"weight_version": rank_stats["weight_version"]})
        yield incomplete
        yield version


def _observe_many(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of `value` at the cost of one: an output carrying a stream_interval's or a final-only
    request's tokens has one mean gap, and a loop per token would put per-token work on the hot path.
    prometheus_client has no weighted observe; this writes its per-child values as `observe` does (bucket counts
    stored per bucket, summed at collection), which tests/server/test_metrics.py checks against `observe`."""
    histogram._sum.inc(value * count)
    histogram._buckets[bisect.bisect_left(histogram._upper_bounds, value)].inc(count)


class _RequestMetrics:
    """vLLM's per-request series, observed by the engine's output processor (a RequestStatsObserver). The labelled
    children are resolved once: `labels()` per observation is a dict lookup and a lock on the hot path."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = (model_name, ENGINE_INDEX)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ENGINE_LABELS, buckets=buckets, registry=registry).labels(*labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency.", ITL_BUCKETS)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of end-to-end request latency.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Time from queued to first scheduled.", REQUEST_LATENCY_BUCKETS
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds", "Time from first scheduled to first token.", REQUEST_LATENCY_BUCKETS
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds", "Time from first token to last token.", REQUEST_LATENCY_BUCKETS
        )
        self._labels = labels
        self._success_counter = Counter(
            "vllm:request_success",
            "Finished requests (each of a request's n samples) by finish reason.",
            [*ENGINE_LABELS, "finished_reason"],
            registry=registry,
        )
        self._success: dict[str, Counter] = {}

    def first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def inter_token(self, latency: float, count: int) -> None:
        if count == 1:
            self.itl.observe(latency)
        else:
            _observe_many(self.itl, latency, count)

    def finished(self, finish_reason: str, e2e: float, phases: tuple[float, float, float] | None) -> None:
        success = self._success.get(finish_reason)
        if success is None:
            success = self._success[finish_reason] = self._success_counter.labels(*self._labels, finish_reason)
        success.inc()
        self.e2e.observe(e2e)
        if phases is not None:
            queue, prefill, decode = phases
            self.queue.observe(queue)
            self.prefill.observe(prefill)
            self.decode.observe(decode)


class _Interval:
    """Time from the first `begin` to the `end` that closes it, into a histogram. Repeated begins (an idempotent
    pause) keep the first; an end without a begin records nothing."""

    def __init__(self, histogram) -> None:
        self.histogram = histogram
        self.since: float | None = None

    def begin(self) -> None:
        if self.since is None:
            self.since = time.perf_counter()

    def end(self) -> None:
        if self.since is not None:
            self.histogram.observe(time.perf_counter() - self.since)
            self.since = None


class ServerMetrics:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        # Where this process's series are registered, and what a scrape exposes: the same registry, or in
        # multiprocess mode the sum of every API server's series as written to the shared directory.
        self.registry = CollectorRegistry()
        self._exposed = self.registry
        if os.environ.get(MULTIPROC_DIR_ENV):
            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed)
        self._engine_collector = _EngineCollector(model_name)
        self._exposed.register(self._engine_collector)
        # One observer per engine: the last server built on an engine gets its requests' figures.
        engine.output_processor.stats = _RequestMetrics(self.registry, model_name)
        self._rl_call = Histogram(
            "rlserve_rl_call_seconds",
            "Duration of each RL control call as the server handled it, by route (failed calls included).",
            ["model_name", "route"],
            buckets=RL_BUCKETS,
            registry=self.registry,
        )

        def interval(name: str, documentation: str) -> _Interval:
            histogram = Histogram(name, documentation, ["model_name"], buckets=RL_BUCKETS, registry=self.registry)
            return _Interval(histogram.labels(model_name))

        self._weight_update = interval(
            "rlserve_weight_update_seconds", "start_weight_update to finish_weight_update, per finished weight update."
        )
        self._paused = interval(
            "rlserve_pause_seconds", "How long generation stood still: a pause to the resume that ended it."
        )

    def observe_rl_call(self, route: str, seconds: float) -> None:
        self._rl_call.labels(self.model_name, route).observe(seconds)

    def weight_update_started(self) -> None:
        # A start succeeds only with no update in progress: one begun earlier was abandoned, and is not timed.
        self._weight_update.since = None
        self._weight_update.begin()

    def weight_update_finished(self) -> None:
        self._weight_update.end()

    def generation_paused(self) -> None:
        self._paused.begin()

    def generation_resumed(self) -> None:
        self._paused.end()

    async def render(self) -> tuple[bytes, str]:
        self._engine_collector.stats = await self.engine.stats()
        return generate_latest(self._exposed), CONTENT_TYPE_LATEST
