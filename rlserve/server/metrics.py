"""Prometheus metrics of one server, in a registry of its own (several apps in one process must not collide).

Engine state is read from `AsyncLLM.stats()` at scrape time rather than pushed, so the engine core needs no hooks;
only what the server alone sees (how requests finished) is counted as it happens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rlserve.engine.async_llm import AsyncLLM


class _EngineCollector:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        # Tokens/s is the rate between two scrapes: (time, generated tokens) at the previous one.
        self._last: tuple[float, int] | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
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


class ServerMetrics:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self._finished = Counter(
            "rlserve_request_success",
            "Finished requests (per choice) by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name

    def count_finished(self, finish_reason: str) -> None:
        self._finished.labels(self.model_name, finish_reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
