"""The engine core in its own process, seen from outside: what the server does when the core dies, and several API
server processes in front of one core."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import _start, _stop, _wait_healthy
from process_tree import descendants, engine_core_pids, survivors
from server_helpers import API_KEY, MODEL_NAME, Server, Stream, free_port, read_stream

TWO_API_SERVERS = ("--api-server-count", "2", "--enable-rl-api")
DEATH_NOTICE_S = 3.0  # a pending request or call fails this soon after the core is killed (1 s promised + slack)
EXIT_S = 15.0


def _kill_core(server: Server) -> int:
    (core,) = engine_core_pids(server.proc.pid)
    os.kill(core, signal.SIGKILL)
    return core


def _watch_health(server: Server, until: float) -> set[int]:
    """Every /health status seen until the server stops answering (or `until`)."""
    seen = set()
    # A fresh connection per poll (the server may be going), on one client: httpx.get makes a client per call.
    with httpx.Client(timeout=1.0, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        while time.monotonic() < until:
            try:
                seen.add(http.get(server.url + "/health").status_code)
            except httpx.TransportError:
                break
            time.sleep(0.05)
    return seen


def test_core_killed_during_streaming(start_server):
    server = start_server()
    children = descendants(server.proc.pid)
    with server.client() as client:
        max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": max_model_len - 8, "ignore_eos": True, "stream": True}
    with server.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"choices"' in first
        killed_at = time.monotonic()
        _kill_core(server)
        events = [line for line in lines if line.startswith("data: ")]
        ended_after = time.monotonic() - killed_at
    error = json.loads(next(e for e in events if '"error"' in e).removeprefix("data: "))
    assert error["error"]["code"] == 503 and "engine" in error["error"]["message"]
    assert events[-1] == "data: [DONE]"
    assert ended_after < DEATH_NOTICE_S
    assert 503 in _watch_health(server, time.monotonic() + 5)
    assert server.proc.wait(EXIT_S) == 1
    assert not survivors(children)


def test_core_killed_during_a_weight_update_call(start_server):
    """init_weight_transfer_engine waits for a trainer that never joins (the core runs it on a thread); killing
    the core fails the pending call with 503, and the server exits non-zero leaving no process behind."""
    server = start_server("--enable-rl-api", "--weight-transfer-config", '{"backend": "nccl"}')
    children = descendants(server.proc.pid)
    result: dict = {}

    def init() -> None:
        info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
        with server.client() as client:
            response = client.post("/init_weight_transfer_engine", json={"init_info": info})
        result["status"], result["body"], result["at"] = response.status_code, response.json(), time.monotonic()

    caller = threading.Thread(target=init)
    caller.start()
    time.sleep(1.0)  # the call is inside the core, waiting for the trainer
    assert caller.is_alive()
    killed_at = time.monotonic()
    _kill_core(server)
    caller.join(DEATH_NOTICE_S + 2)
    assert not caller.is_alive()
    assert result["status"] == 503, result
    assert result["at"] - killed_at < DEATH_NOTICE_S
    assert server.proc.wait(EXIT_S) == 1
    assert not survivors(children)


@pytest.fixture(scope="module")
def two_api_servers(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Server]]:
    """two_api_servers() -> a running server with two API servers in front of one core, shared by the tests that
    use it in turn (the last one here stops it); started again if a test before stopped it."""
    started: list[Server] = []
    logs = tmp_path_factory.mktemp("two-api-servers")

    def get() -> Server:
        if not started or started[-1].proc.poll() is not None:
            server = _start(server_model_dir, logs / f"server-{len(started)}.log", *TWO_API_SERVERS, api_key=API_KEY)
            started.append(server)
            _wait_healthy(server)
        return started[-1]

    yield get
    for server in started:
        _stop(server)


def test_an_id_taken_on_another_api_server_leaves_the_running_request_alone(two_api_servers):
    """Two API servers, one core: a client id that collides with a request running through the other server is
    refused, and the running request still ends. Before the fix the core gave the id's outputs to the newcomer and,
    refusing it, dropped them: the running stream never ended."""
    server = two_api_servers()
    # As long as the model allows: 400 tokens ended before the twelve collisions on an idle CI machine.
    max_tokens = httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"][0]["max_model_len"] - 8
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "request_id": "held"}
    stream = Stream()

    async def held() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            await read_stream(client, "/v1/completions", body, into=stream, headers=server.headers)

    reader = threading.Thread(target=lambda: asyncio.run(held()))
    reader.start()
    deadline = time.monotonic() + 30
    while stream.tokens_so_far == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.tokens_so_far > 0
    post = lambda path, **kw: httpx.post(server.url + path, headers=server.headers, timeout=30, **kw)  # noqa: E731
    # Fresh connections while it runs: the kernel spreads them over both servers, so some reach the core from the other.
    answers = {post("/v1/completions", json={**body, "stream": False}).status_code for _ in range(12)}
    assert stream.finished_at is None, "the running request ended before the collisions: make it longer"
    reader.join(60)
    assert not reader.is_alive(), "the running request never ended"
    assert answers <= {409, 503}, answers
    assert stream.only.finish_reasons == ["length"] and stream.only.num_tokens == max_tokens and not stream.errors


def test_two_api_servers_share_one_core(two_api_servers):
    server = two_api_servers()
    children = descendants(server.proc.pid)
    assert len(engine_core_pids(server.proc.pid)) == 1
    assert len([p for p in children if p not in engine_core_pids(server.proc.pid)]) >= 2  # the API servers
    body = {
        "model": MODEL_NAME,
        "prompt": "hello",
        "max_tokens": 4,
        "return_token_weight_versions": True,
        "ignore_eos": True,
    }
    # Fresh connections: the kernel spreads them over both processes' accept queues.
    post = lambda path, **kw: httpx.post(server.url + path, headers=server.headers, timeout=60, **kw)  # noqa: E731
    results = [post("/v1/completions", json=body) for _ in range(12)]
    assert all(r.status_code == 200 and len(r.json()["choices"][0]["token_weight_versions"]) == 4 for r in results)
    try:
        assert httpx.post(server.url + "/pause?mode=keep", headers=server.headers, timeout=30).status_code == 200
        seen = {
            httpx.get(server.url + "/is_paused", headers=server.headers, timeout=30).json()["is_paused"]
            for _ in range(12)
        }
        assert seen == {True}  # a pause through one API server is the core's state, whichever server answers
    finally:
        httpx.post(server.url + "/resume", headers=server.headers, timeout=30)
    assert httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=60).status_code == 200
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(EXIT_S) == 0
    assert not survivors(children)


def test_sigterm_to_the_whole_process_group_is_an_orderly_stop(start_server):
    # As a supervisor stops `rlserve serve` (kill -- -PGID): the server, its fork server and its core all get SIGTERM
    # at once. The core's clean exit must not read as a crash in the log.
    server = start_server("--log-level", "info")
    group = [server.proc.pid, *descendants(server.proc.pid)]
    assert engine_core_pids(server.proc.pid)
    for pid in group:
        os.kill(pid, signal.SIGTERM)
    assert server.proc.wait(EXIT_S) == 0
    assert not survivors(group)
    log = server.log_tail(20_000)
    assert "died" not in log and "ERROR" not in log, log


def test_sigterm_to_the_server_ends_streams_with_an_error_and_exits_0(start_server):
    """SIGTERM to `rlserve serve` alone (uvicorn's signal) with a stream running, a stream queued behind a keep-pause
    and an init_weight_transfer_engine waiting for a trainer that never comes: each stream ends with an error event
    and [DONE], the engine shuts down (no process left) and the exit status is 0 (issue 20.5)."""
    server = start_server("--enable-rl-api", "--weight-transfer-config", json.dumps({"backend": "nccl"}))
    children = descendants(server.proc.pid)
    body = {"model": MODEL_NAME, "prompt": "on and on", "max_tokens": 1000, "ignore_eos": True}
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
    init_outcome: list[object] = []

    def wait_for_a_trainer() -> None:
        try:
            init_outcome.append(
                httpx.post(
                    server.url + "/init_weight_transfer_engine",
                    json={"init_info": init_info},
                    headers=server.headers,
                    timeout=EXIT_S,
                )
            )
        except httpx.TransportError as e:  # the server closed the connection as it stopped
            init_outcome.append(e)

    init = threading.Thread(target=wait_for_a_trainer, daemon=True)

    async def go() -> list[Stream]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=EXIT_S) as http:
            running, queued = Stream(), Stream()
            tasks = [asyncio.create_task(read_stream(http, "/v1/completions", body, into=running))]
            while running.tokens_so_far < 2:
                assert not tasks[0].done(), tasks[0].exception()
                await asyncio.sleep(0.01)
            assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
            tasks.append(asyncio.create_task(read_stream(http, "/v1/completions", body, into=queued)))
            init.start()
            await asyncio.sleep(0.5)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*tasks), EXIT_S)
            return [running, queued]

    for stream in asyncio.run(go()):
        assert stream.done_markers == 1 and len(stream.errors) == 1, stream
        assert stream.errors[0]["code"] == 503 and "shutting down" in stream.errors[0]["message"]
    assert server.proc.wait(EXIT_S) == 0
    init.join(EXIT_S)
    assert init_outcome, "the init call still waits after the server exited"
    assert not survivors(children)
    # The pending call ended as an answer or a closed connection, not as an unhandled exception (issue 28).
    log = server.log_tail(100_000)
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
