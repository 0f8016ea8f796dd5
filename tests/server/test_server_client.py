"""The trainer's typed client (rlserve.rl.client) against the live server: results, and errors with their body."""

from __future__ import annotations

import asyncio

import pytest
from server_helpers import API_KEY, Server

from rlserve.rl.client import AsyncRLServeClient, RLServeClient, RLServeError


def test_sync_client_calls_and_errors(server: Server, rl: RLServeClient) -> None:
    rl.wait_healthy(timeout=10)
    assert rl.get_world_size() == 1 and rl.is_paused() is False
    original = rl.get_weight_version()
    rl.update_weight_version("manual-7")
    assert rl.get_weight_version() == "manual-7"
    rl.update_weight_version(original)
    rl.reset_prefix_cache()
    assert rl.abort_requests(["no-such-request"]) == 0

    with pytest.raises(RLServeError) as bad_mode:
        rl.pause(mode="nap")
    assert bad_mode.value.status_code == 400 and bad_mode.value.param == "query.mode"
    with pytest.raises(RLServeError) as out_of_order:
        rl.finish_weight_update(weight_version="never-started")
    assert out_of_order.value.status_code == 409 and out_of_order.value.body["error"]["type"] == "ConflictError"
    with RLServeClient(server.url, api_key="wrong") as intruder, pytest.raises(RLServeError) as denied:
        intruder.resume()
    assert denied.value.status_code == 401


def test_async_client_pause_cycle(server: Server, rl: RLServeClient) -> None:
    async def go() -> list[bool]:
        async with AsyncRLServeClient(server.url, api_key=API_KEY) as client:
            await client.wait_healthy(timeout=10)
            await client.pause(mode="keep", clear_cache=False)
            paused = await client.is_paused()
            await client.resume()
            return [paused, await client.is_paused()]

    assert asyncio.run(go()) == [True, False]
