"""/metrics under vLLM's names, against real `rlserve serve` processes: scrape, send requests, scrape again, and check
that the counters grew by exactly the tokens sent and the histograms by one observation per request."""

from __future__ import annotations

import asyncio
import math

import httpx
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL_NAME, Server, read_stream

from rlserve.server.metrics import _observe_many

ENGINE = {"model_name": MODEL_NAME, "engine": "0"}
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:request_success",
)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
PER_REQUEST = (
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
)
HISTOGRAMS = (*PER_REQUEST, "vllm:inter_token_latency_seconds")
BODY = {"model": MODEL_NAME, "temperature": 0.0, "ignore_eos": True}


class Scrape:
    """One /metrics answer, parsed: each family's type, and each sample's value by name and labels."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for sample in family.samples:
                self.samples[sample.name, frozenset(sample.labels.items())] = sample.value

    def value(self, name: str, **labels: str) -> float:
        """0 for a labelled series not observed yet (a finish reason no request had)."""
        return self.samples.get((name, frozenset({**ENGINE, **labels}.items())), 0.0)


def scrape(url: str) -> Scrape:
    response = httpx.get(url + "/metrics", timeout=30)  # a fresh connection each time: any API server may answer
    assert response.status_code == 200
    return Scrape(response.text)


async def _send(server: Server, prompts: list[str], max_tokens: list[int]) -> list[tuple[int, int]]:
    """One streamed completion (the first prompt) and plain ones; (prompt, completion) tokens of each."""
    async with server.async_client() as http:
        body = {**BODY, "prompt": prompts[0], "max_tokens": max_tokens[0]}
        streamed = read_stream(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        plain = [
            http.post("/v1/completions", json={**BODY, "prompt": p, "max_tokens": m})
            for p, m in zip(prompts[1:], max_tokens[1:], strict=True)
        ]
        stream, *responses = await asyncio.gather(streamed, *plain)
    assert stream.only.finish_reasons == ["length"] and stream.only.num_tokens == max_tokens[0]
    usages = [stream.usage]
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "length"
        usages.append(response.json()["usage"])
    return [(u["prompt_tokens"], u["completion_tokens"]) for u in usages]


def _check_growth(before: Scrape, after: Scrape, sent: list[tuple[int, int]]) -> None:
    def grew(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    assert grew("vllm:prompt_tokens_total") == sum(p for p, _ in sent)
    assert grew("vllm:generation_tokens_total") == sum(c for _, c in sent)
    assert grew("vllm:request_success_total", finished_reason="length") == len(sent)
    assert grew("vllm:prefix_cache_queries_total") > 0
    for name in PER_REQUEST:
        assert grew(name + "_count") == len(sent), name
        assert grew(name + "_sum") >= 0, name
        assert grew(name + "_bucket", le="+Inf") == len(sent), name
    # Every token but each request's first follows a gap.
    assert grew("vllm:inter_token_latency_seconds_count") == sum(c - 1 for _, c in sent)
    assert grew("vllm:time_to_first_token_seconds_sum") > 0 and grew("vllm:e2e_request_latency_seconds_sum") > 0


def _check_names(scraped: Scrape) -> None:
    for name in COUNTERS:
        assert scraped.types.get(name) == "counter", name
    for name in GAUGES:
        assert scraped.types.get(name) == "gauge", name
        assert (name, frozenset(ENGINE.items())) in scraped.samples, name
    for name in HISTOGRAMS:
        assert scraped.types.get(name) == "histogram", name
    (config,) = [labels for name, labels in scraped.samples if name == "vllm:cache_config_info"]
    config = dict(config)
    assert config["engine"] == "0" and int(config["block_size"]) > 0 and int(config["num_gpu_blocks"]) > 0
    assert scraped.value("rlserve_is_paused") == 0 and "rlserve_weight_version_info" in scraped.types
    # The tokens/s gauge computed against the previous scrape is gone: two scrapers read different rates from it.
    assert not [name for name in scraped.types if "per_second" in name]


def test_vllm_metrics_grow_by_the_requests_sent(server: Server) -> None:
    before = scrape(server.url)
    sent = asyncio.run(_send(server, ["metrics one", "metrics two, longer", "metrics three"], [6, 4, 5]))
    after = scrape(server.url)
    _check_names(after)
    _check_growth(before, after, sent)
    again = scrape(server.url)
    assert again.value("vllm:generation_tokens_total") == after.value("vllm:generation_tokens_total")
    assert again.value("vllm:num_requests_running") == 0 and again.value("vllm:num_requests_waiting") == 0


def test_several_api_servers_count_each_request_once(start_server) -> None:
    server = start_server("--api-server-count", "2")
    before = scrape(server.url)
    sent = asyncio.run(_send(server, [f"two servers {i}" for i in range(6)], [3, 4, 5, 3, 4, 5]))
    # Fresh connections spread over both processes: each one's answer sums both processes' requests.
    scrapes = [scrape(server.url) for _ in range(8)]
    for after in scrapes:
        _check_names(after)
        _check_growth(before, after, sent)


def test_observe_many_equals_repeated_observe() -> None:
    """_observe_many writes prometheus_client's internals: the exposition must be what `count` observes give."""
    texts = []
    for weighted in (False, True):
        registry = CollectorRegistry()
        histogram = Histogram("h", "h", buckets=(0.1, 0.5, 1.0), registry=registry)
        # Binary fractions: the sums are exact either way. 0.5 sits on a bound (buckets are `le`).
        for value, count in ((0.0625, 3), (0.5, 2), (0.75, 4), (5.0, 1)):
            if weighted:
                _observe_many(histogram, value, count)
            else:
                for _ in range(count):
                    histogram.observe(value)
        texts.append([line for line in generate_latest(registry).decode().splitlines() if "_created" not in line])
    assert texts[0] == texts[1]
    assert 'h_bucket{le="0.5"} 5.0' in texts[0] and "h_count 10.0" in texts[0] and "h_sum 9.1875" in texts[0]


def _prime_rl_engine_load(text: str) -> dict[str, float]:
    """/metrics as prime-rl 559b4477 reads it for its concurrency controller (src/prime_rl/orchestrator/
    inference_metrics.py: parse_prometheus_text, build_load_sample), replayed: `vllm:` gauges summed over labels but
    the waiting reasons, and the KV capacity from vllm:cache_config_info's labels."""
    gauges: dict[str, float] = {}
    cache_config: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:") or family.type not in ("counter", "gauge", "histogram"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created") or not math.isfinite(sample.value):
                continue
            if family.name == "vllm:cache_config_info":
                cache_config.update(sample.labels)
                continue
            name = sample.name.removeprefix("vllm:")
            if name == "num_requests_waiting_by_reason":
                name = f"num_requests_waiting_reason_{sample.labels.get('reason', 'unknown')}"
            if family.type == "gauge":
                gauges[name] = gauges.get(name, 0.0) + sample.value
    return {
        "kv_capacity_tokens": int(cache_config["kv_cache_size_tokens"]),
        "blocks_times_size": int(cache_config["num_gpu_blocks"]) * int(cache_config["block_size"]),
        "waiting": gauges["num_requests_waiting"],
        "waiting_capacity": gauges["num_requests_waiting_reason_capacity"],
        "waiting_deferred": gauges["num_requests_waiting_reason_deferred"],
    }


def test_prime_rl_reads_the_capacity_queue(server: Server) -> None:
    """Requests held by a keep-mode pause wait for capacity: vllm:num_requests_waiting_by_reason{reason="capacity"}
    counts them, as prime-rl's controller reads it, and the reasons sum to vllm:num_requests_waiting."""

    def load() -> dict[str, float]:
        return _prime_rl_engine_load(httpx.get(server.url + "/metrics", timeout=30).text)

    async def go() -> tuple[dict[str, float], list[httpx.Response]]:
        async with server.async_client() as http:
            assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
            try:
                body = {**BODY, "prompt": "queued behind a pause", "max_tokens": 4}
                sent = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(3)]
                for _ in range(200):  # bounded: the requests reach the engine's queue in well under 20 s
                    seen = await asyncio.to_thread(load)
                    if seen["waiting"] == 3:
                        break
                    await asyncio.sleep(0.1)
            finally:
                assert (await http.post("/resume")).status_code == 200
            return seen, await asyncio.gather(*sent)

    idle = load()
    assert idle["kv_capacity_tokens"] == idle["blocks_times_size"] > 0
    assert idle["waiting"] == idle["waiting_capacity"] == idle["waiting_deferred"] == 0
    paused, responses = asyncio.run(go())
    assert paused["waiting"] == 3 and paused["waiting_capacity"] == 3 and paused["waiting_deferred"] == 0
    assert all(r.status_code == 200 for r in responses)
    assert load()["waiting_capacity"] == 0
