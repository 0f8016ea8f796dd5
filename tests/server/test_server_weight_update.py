"""A live weight update over HTTP with requests in flight, the trainer in this process, bytes over gloo.

vLLM's flow (`examples/rl/rlhf_http_nccl.py`): thread{/init_weight_transfer_engine} ∥ trainer_init, then per update
/pause?mode=keep → /start_weight_update → thread{/update_weights} ∥ trainer_send_weights → /finish_weight_update →
/resume. The new weights come from another random checkpoint of the same shapes, so a transfer that did not happen
cannot pass; the server's greedy output afterwards must equal an offline engine built on that checkpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file
from server_helpers import API_KEY, HTTP_TIMEOUT_S, MODEL_NAME, Server, Stream, free_port, read_stream

from rlserve import LLM, SamplingParams
from rlserve.dtypes import dtype_name
from rlserve.rl.client import AsyncRLServeClient, RLServeClient
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import (
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    WeightTransferGroup,
    compare_checksums,
    weight_checksums,
)

RENDEZVOUS_TIMEOUT_S = 60.0
MAX_TOKENS = 150
NEW_VERSION = "step-1"
PROMPT = "after the update"


@pytest.fixture(scope="module")
def new_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("new-weights") / "toy", seed=7, initializer_range=0.2)


@pytest.fixture(scope="module")
def trainer_group(server: Server) -> Iterator[WeightTransferGroup]:
    """Join the server's transfer group as rank 0 while a thread asks the server to join (both block until both)."""
    port = free_port()
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    with RLServeClient(server.url, api_key=API_KEY, timeout=RENDEZVOUS_TIMEOUT_S) as rl, ThreadPoolExecutor(1) as pool:
        joined = pool.submit(rl.init_weight_transfer_engine, init_info)
        group = NCCLWeightTransferEngine.trainer_init({**init_info, "timeout_s": RENDEZVOUS_TIMEOUT_S})
        joined.result(timeout=RENDEZVOUS_TIMEOUT_S)
    yield group
    group.shutdown()


def test_weight_update_with_requests_in_flight(
    server: Server, rl: RLServeClient, trainer_group: WeightTransferGroup, new_weights_dir: Path
) -> None:
    new_weights = load_file(new_weights_dir / "model.safetensors")
    names = sorted(new_weights)
    update_info = {
        "names": names,
        "dtype_names": [dtype_name(new_weights[n].dtype) for n in names],
        "shapes": [list(new_weights[n].shape) for n in names],
    }
    before = rl.weight_checksums()
    with server.client() as http:
        metrics_before = http.get("/metrics").text  # the server is shared: RL histograms are read as differences
    assert compare_checksums(before, weight_checksums(new_weights.items()))["mismatches"], "same weights already"

    def send() -> None:
        args = NCCLTrainerSendWeightsArgs(group=trainer_group)
        NCCLWeightTransferEngine.trainer_send_weights(((n, new_weights[n]) for n in names), args)

    async def go() -> list[Stream]:
        control = AsyncRLServeClient(server.url, api_key=API_KEY, timeout=HTTP_TIMEOUT_S)
        async with server.async_client() as http, control:
            streams = [Stream() for _ in range(3)]
            body = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
            tasks = [
                asyncio.create_task(read_stream(http, "/v1/completions", {**body, "prompt": f"rollout {i}"}, into=s))
                for i, s in enumerate(streams)
            ]
            while any(s.tokens_so_far < 2 for s in streams):
                assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
                await asyncio.sleep(0.01)
            await control.pause(mode="keep")
            await control.start_weight_update()
            await asyncio.gather(control.update_weights(update_info), asyncio.to_thread(send))
            await control.finish_weight_update(weight_version=NEW_VERSION)
            await control.resume()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            return streams

    for stream in asyncio.run(go()):
        choice = stream.only
        assert choice.finish_reasons == ["length"] and stream.done_markers == 1
        assert choice.num_tokens == MAX_TOKENS, "tokens lost or duplicated across the update"
        versions = choice.weight_versions
        switch = versions.index(NEW_VERSION)
        assert 0 < switch and versions == ["default"] * switch + [NEW_VERSION] * (MAX_TOKENS - switch)

    assert rl.get_weight_version() == NEW_VERSION
    assert compare_checksums(weight_checksums(new_weights.items()), rl.weight_checksums())["match"]
    with server.client() as http:
        compared = http.post("/weight_checker", json={"action": "compare", "baseline": before}).json()
        assert not compared["match"] and compared["mismatches"]
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        asked = {**body, "return_token_ids": True, "return_token_weight_versions": True}
        served = http.post("/v1/completions", json=asked).json()["choices"][0]
        assert served["token_weight_versions"] == [NEW_VERSION] * 16

    # The RL histograms saw the sequence: one update (start -> finish), one standstill (pause -> resume), each route.
    with server.client() as http:
        metrics_after = http.get("/metrics").text

    def grew(name: str, **labels: str) -> float:
        return _sample(metrics_after, name, **labels) - _sample(metrics_before, name, **labels)

    assert grew("rlserve_weight_update_seconds_count") == 1
    assert grew("rlserve_pause_seconds_count") == 1
    update_s = grew("rlserve_weight_update_seconds_sum")
    assert 0 < update_s < grew("rlserve_pause_seconds_sum")  # the update happens inside the pause
    for route in ("/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"):
        assert grew("rlserve_rl_call_seconds_count", route=route) == 1, route
    assert grew("rlserve_rl_call_seconds_sum", route="/update_weights") <= update_s

    # The server now generates exactly what an engine started on the new checkpoint does.
    offline = LLM(str(new_weights_dir), num_kv_blocks=64)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        expected = offline.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        offline.shutdown()
    assert served["token_ids"] == expected


def _sample(metrics_text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition, matched by name and (a subset of) its labels; 0 for a
    labelled series not observed yet."""
    for line in metrics_text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
