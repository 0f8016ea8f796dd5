"""Prometheus metrics of one server, in a registry of its own (several apps in one process must not collide).

Engine state is read from `AsyncLLM.stats()` at scrape time rather than pushed, so the engine core needs no hooks;
only what the server alone sees (how requests finished, how long RL control calls took) is counted as it happens.
The RL histograms answer where a slow weight sync goes: each control route's duration, start -> finish of every
weight update, and how long generation stood still between a pause and its resume.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rlserve.engine.async_llm import AsyncLLM


class _EngineCollector:
    """Reports the engine core's counters as of the last `update` (the core lives in another process: reading them
    is an async call, and prometheus collects synchronously)."""

    def __init__(self, model_name: str) -> None:
        self.stats: dict | None = None
        self.model_name = model_name
        # Tokens/s is the rate between two scrapes: (time, generated tokens) at the previous one.
        self._last: tuple[float, int] | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            metric = GaugeMetricFamily(name, doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            metric = CounterMetricFamily(name, doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        tokens = stats["num_generated_tokens"]
        now = time.monotonic()
        rate = 0.0
        if self._last is not None and now > self._last[0]:
            rate = (tokens - self._last[1]) / (now - self._last[0])
        self._last = (now, tokens)
        queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]

        yield gauge("rlserve_num_requests_running", "Requests in the running batch.", stats["num_running"])
        yield gauge("rlserve_num_requests_waiting", "Requests queued for admission.", stats["num_waiting"])
        yield counter("rlserve_generation_tokens", "Output tokens generated.", tokens)
        yield gauge("rlserve_generation_tokens_per_second", "Output tokens/s since the previous scrape.", rate)
        yield gauge("rlserve_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", stats["kv_cache_usage"])
        yield counter("rlserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("rlserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield gauge(
            "rlserve_prefix_cache_hit_rate", "Prefix-cache hits over queries (0-1).", hits / queries if queries else 0.0
        )
        yield gauge("rlserve_is_paused", "1 while generation is paused.", float(stats["is_paused"]))
        info = InfoMetricFamily("rlserve_weight_version", "The weight version now served.", labels=labels)
        info.add_metric(values, {"weight_version": stats["weight_version"]})
        yield info


# From a millisecond (an ipc sync of a small model) to a minute (an NCCL rendezvous).
RL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
        self.registry = CollectorRegistry()
        self._engine_collector = _EngineCollector(model_name)
        self.registry.register(self._engine_collector)
        self._finished = Counter(
            "rlserve_request_success",
            "Finished requests (per choice) by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
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
        self.model_name = model_name

    def count_finished(self, finish_reason: str) -> None:
        self._finished.labels(self.model_name, finish_reason).inc()

    def observe_rl_call(self, route: str, seconds: float) -> None:
        self._rl_call.labels(self.model_name, route).observe(seconds)

    def weight_update_started(self) -> None:
        self._weight_update.begin()

    def weight_update_finished(self) -> None:
        self._weight_update.end()

    def generation_paused(self) -> None:
        self._paused.begin()

    def generation_resumed(self) -> None:
        self._paused.end()

    async def render(self) -> tuple[bytes, str]:
        self._engine_collector.stats = await self.engine.stats()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
