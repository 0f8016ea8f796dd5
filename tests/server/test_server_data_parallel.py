"""`rlserve serve -dp 2`: two engine-core processes behind one server, seen over real HTTP.

Outputs equal one core's; a session (`X-Session-ID`) and a GRPO group (separate requests, one prompt) stay on their
rank even when the other rank is less loaded, which the prefix cache shows (`cached_tokens`); pause in every mode
holds on both ranks with no request lost or duplicated; one trainer broadcast (gloo) updates both ranks; SIGTERM
leaves no process behind, also with several API servers; /metrics labels each rank's series with its engine index.
In lockstep (`--data-parallel-lockstep`) the same HTTP pause holds both ranks, and each rank reports its dummy steps.
The DP server is shared by the module; the weight update and the stop come last.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import _serve, rl_client
from process_tree import descendants, engine_core_pids, survivors
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file
from server_helpers import API_KEY, BLOCK_SIZE, HTTP_TIMEOUT_S, MODEL_NAME, Server, Stream, free_port, read_stream

from rlserve import LLM, SamplingParams
from rlserve.dtypes import dtype_name
from rlserve.rl.client import AsyncRLServeClient, RLServeClient
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine, compare_checksums
from rlserve.weight_transfer.checksum import weight_checksums

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = [list(range(10 + 3 * i, 10 + 3 * i + 4 + 5 * i)) for i in range(6)]
MAX_TOKENS = 12
STREAM_TIMEOUT_S = 60.0
RENDEZVOUS_TIMEOUT_S = 60.0
EXIT_S = 15.0
NEW_VERSION = "dp-step-1"


@pytest.fixture(scope="module")
def dp_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server-logs") / "data-parallel.log"
    wt = json.dumps({"backend": "nccl"})
    args = ("-dp", "2", "--enable-rl-api", "--weight-transfer-config", wt)
    yield from _serve(server_model_dir, log, *args, api_key=API_KEY)


@pytest.fixture
def rl(dp_server: Server) -> Iterator[RLServeClient]:
    yield from rl_client(dp_server)


def rl_async(server: Server) -> AsyncRLServeClient:
    return AsyncRLServeClient(server.url, api_key=API_KEY, timeout=HTTP_TIMEOUT_S)


def offline_tokens(model_dir: Path) -> list[list[int]]:
    """What one core (DP=1) generates for PROMPTS."""
    llm = LLM(str(model_dir), num_kv_blocks=64)
    try:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


def served_tokens(server: Server) -> list[list[int]]:
    """PROMPTS in one request: its prompts run at once, spread over the ranks."""
    body = {"model": MODEL_NAME, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "return_token_ids": True, **GREEDY}
    with server.client() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return [c["token_ids"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


def test_world_size_counts_the_ranks(dp_server: Server) -> None:
    with dp_server.client() as http:
        assert http.get("/get_world_size").json() == {"world_size": 2}
        assert http.get("/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 1}


def test_greedy_outputs_equal_one_cores(dp_server: Server, server_model_dir: Path) -> None:
    assert served_tokens(dp_server) == offline_tokens(server_model_dir)


def test_sessions_and_groups_stay_on_their_rank(dp_server: Server) -> None:
    """Streams kept in flight make one rank the busier; requests with affinity go there anyway and hit the prefix
    cache, requests without go to the other rank and miss it."""
    prompt_a = list(range(30, 30 + 3 * BLOCK_SIZE))
    prompt_g = list(range(130, 130 + 3 * BLOCK_SIZE))

    async def go() -> None:
        async with dp_server.async_client() as http:

            async def cached(tokens: list[int], session: str | None = None) -> int:
                headers = {"X-Session-ID": session} if session else {}
                body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": 2, **GREEDY}
                response = await http.post("/v1/completions", json=body, headers=headers)
                assert response.status_code == 200, response.text
                return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

            async def busy(session: str, first_token: int) -> tuple[Stream, asyncio.Task]:
                stream = Stream()
                body = {"model": MODEL_NAME, "prompt": [first_token, 1, 2], "max_tokens": 900, **GREEDY}
                headers = {"X-Session-ID": session}
                task = asyncio.create_task(read_stream(http, "/v1/completions", body, stream, headers))
                deadline = time.monotonic() + STREAM_TIMEOUT_S
                while stream.tokens_so_far < 1:
                    assert time.monotonic() < deadline and not task.done(), "a busy stream did not start"
                    await asyncio.sleep(0.01)
                return stream, task

            assert await cached(prompt_a, "s1") == 0  # session s1 now lives on some rank R
            s1_stream, s1_task = await busy("s1", 200)  # R: 1 in flight, the other rank: 0
            assert await cached(prompt_a + [1, 2, 3], "s1") >= 2 * BLOCK_SIZE  # the session's rank, busier or not
            assert await cached(prompt_a + [4, 5, 6]) == 0  # no affinity: the other rank, which never saw prompt_a
            assert await cached(prompt_g) == 0  # a GRPO group's first request: the other rank too
            s2 = [await busy("s2", 210), await busy("s2", 211)]  # session s2 goes there too: now the busier rank
            for _ in range(2):  # the rest of the group follows its prompt, to the busier rank
                assert await cached(prompt_g) >= 2 * BLOCK_SIZE
            streams = [s1_stream] + [s for s, _ in s2]
            assert all(s.finished_at is None for s in streams), "a busy stream ended: the loads were not as assumed"
            for task in [s1_task] + [t for _, t in s2]:
                task.cancel()

    asyncio.run(go())


async def started_streams(
    http: httpx.AsyncClient, max_tokens: int, first_token: int
) -> tuple[list[Stream], list[asyncio.Task]]:
    """Four greedy streams of distinct prompts (spread two per rank by load), once each has its first tokens."""
    streams = [Stream() for _ in range(4)]
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "return_token_ids": True, **GREEDY}
    tasks = [
        asyncio.create_task(
            read_stream(http, "/v1/completions", {**body, "prompt": [first_token + i, 7, 7, 7]}, into=stream)
        )
        for i, stream in enumerate(streams)
    ]
    deadline = time.monotonic() + STREAM_TIMEOUT_S
    while any(s.tokens_so_far < 2 for s in streams):
        assert time.monotonic() < deadline and not any(t.done() for t in tasks), "streams did not start"
        await asyncio.sleep(0.01)
    return streams, tasks


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_holds_on_every_rank(dp_server: Server, rl: RLServeClient, mode: str) -> None:
    """Four streams, two per rank: pause returns once every rank has applied the mode; a second pause and a second
    resume change nothing; no stream loses or repeats a token."""
    max_tokens = 900 if mode == "abort" else 60

    async def go() -> list[Stream]:
        async with dp_server.async_client() as http, rl_async(dp_server) as control:
            streams, tasks = await started_streams(http, max_tokens, first_token=220)
            await control.pause(mode=mode)
            await control.pause(mode=mode)
            await asyncio.sleep(0.1)  # what the server sent before answering is in the client's buffers
            assert await control.is_paused()
            if mode == "abort":
                assert all(s.only.finish_reasons == ["abort"] for s in streams)
            elif mode == "wait":
                assert all(s.only.finish_reasons == ["length"] for s in streams)
            else:
                frozen = [s.tokens_so_far for s in streams]
                await asyncio.sleep(0.5)
                assert [s.tokens_so_far for s in streams] == frozen and all(s.finished_at is None for s in streams)
            await control.resume()
            await control.resume()
            assert not await control.is_paused()
            await asyncio.wait_for(asyncio.gather(*tasks), STREAM_TIMEOUT_S)
            return streams

    for stream in asyncio.run(go()):
        choice = stream.only
        assert stream.done_markers == 1 and len(choice.finish_reasons) == 1
        if mode == "abort":
            assert choice.finish_reasons == ["abort"] and 2 <= choice.num_tokens < max_tokens
        else:
            assert choice.finish_reasons == ["length"] and choice.num_tokens == max_tokens
            assert len(choice.token_ids) == max_tokens


def per_rank(server: Server, name: str) -> dict[str, float]:
    """A /metrics series' value for each engine label (each data-parallel rank)."""
    text = httpx.get(server.url + "/metrics", timeout=HTTP_TIMEOUT_S).text
    return {
        sample.labels["engine"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def test_metrics_label_each_rank(dp_server: Server) -> None:
    served_tokens(dp_server)
    generated = per_rank(dp_server, "vllm:generation_tokens_total")
    assert set(generated) == {"0", "1"} and all(v > 0 for v in generated.values())  # PROMPTS spread over both
    assert set(per_rank(dp_server, "vllm:cache_config_info")) == {"0", "1"}
    assert set(per_rank(dp_server, "vllm:num_requests_waiting_by_reason")) == {"0", "1"}
    assert per_rank(dp_server, "rlserve_dummy_steps_total") == {"0": 0, "1": 0}  # independent ranks never step idle


def test_lockstep_pause_over_http_holds_both_ranks(start_server) -> None:
    server = start_server(
        "-dp", "2", "--enable-rl-api", "--data-parallel-lockstep", "--data-parallel-sync-interval", "4"
    )

    async def go() -> list[Stream]:
        async with server.async_client() as http, rl_async(server) as control:
            streams, tasks = await started_streams(http, 60, first_token=200)
            await asyncio.gather(control.pause(mode="keep"), control.pause(mode="keep"))
            await asyncio.sleep(0.1)
            frozen = [s.tokens_so_far for s in streams]
            await asyncio.sleep(0.5)
            assert [s.tokens_so_far for s in streams] == frozen and await control.is_paused()
            await asyncio.gather(control.resume(), control.resume())
            await asyncio.wait_for(asyncio.gather(*tasks), STREAM_TIMEOUT_S)
            return streams

    for stream in asyncio.run(go()):
        assert stream.done_markers == 1 and stream.only.finish_reasons == ["length"]
        assert len(stream.only.token_ids) == 60
    # Agreeing on the pause took steps without requests on both ranks (a wave of dummy steps around the pause).
    assert set(per_rank(server, "rlserve_dummy_steps_total")) == {"0", "1"}
    assert sum(per_rank(server, "rlserve_dummy_steps_total").values()) > 0


def test_one_broadcast_updates_both_ranks(dp_server: Server, rl: RLServeClient, tmp_path: Path) -> None:
    new_dir = make_model_dir(tmp_path / "new", seed=7, initializer_range=0.2)
    new_weights = load_file(new_dir / "model.safetensors")
    names = sorted(new_weights)
    expected = offline_tokens(new_dir)
    assert served_tokens(dp_server) != expected, "the new checkpoint generates what the old one does"
    world_size = 1 + rl.get_world_size()  # the trainer and every rank: vLLM's formula
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": world_size}
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(rl.init_weight_transfer_engine, init_info)
        group = NCCLWeightTransferEngine.trainer_init({**init_info, "timeout_s": RENDEZVOUS_TIMEOUT_S})
        joined.result(timeout=RENDEZVOUS_TIMEOUT_S)
        try:
            rl.pause(mode="keep")
            rl.start_weight_update()
            update_info = {
                "names": names,
                "dtype_names": [dtype_name(new_weights[n].dtype) for n in names],
                "shapes": [list(new_weights[n].shape) for n in names],
            }
            updated = pool.submit(rl.update_weights, update_info)
            send_args = NCCLTrainerSendWeightsArgs(group=group)
            NCCLWeightTransferEngine.trainer_send_weights(((n, new_weights[n]) for n in names), send_args)
            updated.result(timeout=RENDEZVOUS_TIMEOUT_S)
            rl.finish_weight_update(weight_version=NEW_VERSION)
            rl.resume()
        finally:
            group.shutdown()
    assert rl.get_weight_version() == NEW_VERSION
    # Checksums that differ between the ranks are an error: one map answers for both.
    assert not compare_checksums(weight_checksums(new_weights.items()), rl.weight_checksums())["mismatches"]
    assert served_tokens(dp_server) == expected


def test_sigterm_stops_every_core(dp_server: Server) -> None:
    children = descendants(dp_server.proc.pid)
    assert len(engine_core_pids(dp_server.proc.pid)) == 2
    dp_server.proc.send_signal(signal.SIGTERM)
    assert dp_server.proc.wait(EXIT_S) in (0, -signal.SIGTERM)  # uvicorn passes the signal on once it has stopped
    assert not survivors(children)


def test_api_servers_share_every_rank(start_server) -> None:
    server = start_server("-dp", "2", "--api-server-count", "2")
    children = descendants(server.proc.pid)
    assert len(engine_core_pids(server.proc.pid)) == 2
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    # Fresh connections: the kernel spreads them over both API servers, each a client of both cores.
    results = [
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=60) for _ in range(8)
    ]
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4 for r in results)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(EXIT_S) == 0
    assert not survivors(children)
