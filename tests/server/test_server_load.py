"""A bounded load test: 200 concurrent streams through pause(keep)/resume cycles, every one delivered exactly once."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import httpx
from server_helpers import API_KEY, HTTP_TIMEOUT_S, MODEL_NAME, Server, Stream, read_stream

from rlserve.rl.client import AsyncRLServeClient, RLServeClient

NUM_REQUESTS = 200
NUM_PROMPTS = 10  # requests share prompts, so greedy outputs can be compared within a group
MAX_TOKENS = 12
CYCLES = 4
LOAD_TIMEOUT_S = 150.0


def test_concurrent_streams_through_pause_resume_cycles(server: Server, rl: RLServeClient) -> None:
    async def go() -> list[Stream]:
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 8, max_keepalive_connections=NUM_REQUESTS + 8)
        control = AsyncRLServeClient(server.url, api_key=API_KEY, timeout=HTTP_TIMEOUT_S)
        async with server.async_client(limits=limits) as http, control:
            streams = [Stream() for _ in range(NUM_REQUESTS)]
            tasks = []
            for i, stream in enumerate(streams):
                body = {
                    "model": MODEL_NAME,
                    "prompt": f"load test prompt number {i % NUM_PROMPTS}",
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "stream_options": {"include_usage": True},
                }
                tasks.append(asyncio.create_task(read_stream(http, "/v1/completions", body, into=stream)))
            for cycle in range(CYCLES):
                await asyncio.sleep(0.15)
                # Alternate: frozen KV kept, and KV dropped (running requests preempted and recomputed on resume).
                await control.pause(mode="keep", clear_cache=cycle % 2 == 1)
                await asyncio.sleep(0.1)
                await control.resume()
            await asyncio.wait_for(asyncio.gather(*tasks), LOAD_TIMEOUT_S)
            return streams

    streams = asyncio.run(go())
    by_prompt: dict[int, set[tuple[int, ...]]] = defaultdict(set)
    for i, stream in enumerate(streams):
        assert stream.done_markers == 1 and not stream.errors, (i, stream)
        choice = stream.only
        assert choice.finish_reasons == ["length"], (i, choice)
        assert choice.num_tokens == MAX_TOKENS == len(choice.token_ids), (i, choice)
        assert stream.usage["completion_tokens"] == MAX_TOKENS
        by_prompt[i % NUM_PROMPTS].add(tuple(choice.token_ids))
    # A duplicated or dropped chunk would make a request's tokens differ from its group's.
    assert all(len(outputs) == 1 for outputs in by_prompt.values()), by_prompt
    assert not rl.is_paused()
