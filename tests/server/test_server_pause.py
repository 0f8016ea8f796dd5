"""Pause modes over HTTP, with streams in flight: abort, wait, keep; clear_cache; requests sent while paused.

"Before /pause returns" is checked on the client: what the server sent before answering /pause is already in the
client's socket buffers when the answer arrives, so after a short yield to the readers the streams must show it.
No resume happens in between, so a stream that had not ended could not end by itself in abort mode, nor have all its
tokens in wait mode.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable

import httpx
import pytest
from server_helpers import API_KEY, BLOCK_SIZE, HTTP_TIMEOUT_S, MODEL_NAME, Server, Stream, read_stream

from rlserve.rl.client import AsyncRLServeClient, RLServeClient, RLServeError

GREEDY = {"temperature": 0.0, "ignore_eos": True}
READER_YIELD_S = 0.1
STREAM_TIMEOUT_S = 60.0


async def start_streams(
    http: httpx.AsyncClient, count: int, max_tokens: int, min_tokens_seen: int = 2
) -> tuple[list[Stream], list[asyncio.Task]]:
    """Start `count` streaming completions and return once each has delivered `min_tokens_seen` tokens."""
    streams = [Stream() for _ in range(count)]
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, **GREEDY}
    tasks = [
        asyncio.create_task(read_stream(http, "/v1/completions", {**body, "prompt": f"stream {i}:"}, into=s))
        for i, s in enumerate(streams)
    ]
    deadline = time.monotonic() + STREAM_TIMEOUT_S
    while any(s.tokens_so_far < min_tokens_seen for s in streams):
        assert time.monotonic() < deadline, "streams did not start"
        assert not any(t.done() and t.exception() for t in tasks), [t.exception() for t in tasks if t.done()]
        await asyncio.sleep(0.01)
    return streams, tasks


def rl_async(server: Server) -> AsyncRLServeClient:
    return AsyncRLServeClient(server.url, api_key=API_KEY, timeout=HTTP_TIMEOUT_S)


def test_pause_abort_ends_streams_before_returning(server: Server, rl: RLServeClient) -> None:
    async def go() -> list[Stream]:
        async with server.async_client() as http, rl_async(server) as control:
            streams, tasks = await start_streams(http, 3, max_tokens=900)
            await control.pause(mode="abort")
            await asyncio.sleep(READER_YIELD_S)
            assert all(s.finished_at is not None for s in streams)
            assert await control.is_paused()
            await asyncio.wait_for(asyncio.gather(*tasks), STREAM_TIMEOUT_S)
            return streams

    for stream in asyncio.run(go()):
        assert stream.only.finish_reasons == ["abort"] and stream.done_markers == 1
        assert 2 <= stream.only.num_tokens < 900


def test_pause_wait_lets_streams_finish_before_returning(server: Server, rl: RLServeClient) -> None:
    max_tokens = 150

    async def go() -> list[Stream]:
        async with server.async_client() as http, rl_async(server) as control:
            streams, tasks = await start_streams(http, 3, max_tokens=max_tokens)
            await control.pause(mode="wait")
            await asyncio.sleep(READER_YIELD_S)
            assert all(s.finished_at is not None for s in streams)
            await asyncio.wait_for(asyncio.gather(*tasks), STREAM_TIMEOUT_S)
            return streams

    for stream in asyncio.run(go()):
        assert stream.only.finish_reasons == ["length"] and stream.only.num_tokens == max_tokens
        assert stream.done_markers == 1


@pytest.mark.parametrize("clear_cache", [True, False])
def test_pause_keep_freezes_streams_until_resume(server: Server, rl: RLServeClient, clear_cache: bool) -> None:
    max_tokens = 200

    async def go() -> list[Stream]:
        async with server.async_client() as http, rl_async(server) as control:
            streams, tasks = await start_streams(http, 2, max_tokens=max_tokens)
            await control.pause(mode="keep", clear_cache=clear_cache)
            await asyncio.sleep(0.2)  # chunks already on the wire may still land
            frozen = [s.tokens_so_far for s in streams]
            await asyncio.sleep(1.5)
            assert [s.tokens_so_far for s in streams] == frozen, "tokens arrived while paused with mode=keep"
            assert all(s.finished_at is None for s in streams) and all(0 < n < max_tokens for n in frozen)
            await control.resume()
            await asyncio.wait_for(asyncio.gather(*tasks), STREAM_TIMEOUT_S)
            return streams

    for stream in asyncio.run(go()):
        assert stream.only.finish_reasons == ["length"] and stream.done_markers == 1
        assert stream.only.num_tokens == max_tokens and len(stream.only.weight_versions) == max_tokens


class RawStream:
    """A streaming completion read straight off its socket, so that a test can take exactly what has arrived so far
    without waiting for more. HTTP/1.0: the body is the SSE bytes themselves, with no chunked framing."""

    def __init__(self, server: Server, body: dict) -> None:
        url = httpx.URL(server.url)
        self.sock = socket.create_connection((url.host, url.port), timeout=STREAM_TIMEOUT_S)
        # Each token's weight version counts the tokens of every chunk (Stream's count), as read_stream asks for it.
        payload = json.dumps({**body, "stream": True, "return_token_weight_versions": True}).encode()
        head = f"POST /v1/completions HTTP/1.0\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in server.headers.items())
        self.sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        self.pending = b""
        self.in_body = False
        self.stream = Stream()
        self.closed = False

    def _take(self, data: bytes) -> None:
        self.closed = self.closed or not data
        self.pending += data
        if not self.in_body and b"\r\n\r\n" in self.pending:
            status, self.pending = self.pending.split(b"\r\n\r\n", 1)
            assert status.startswith(b"HTTP/1.1 200") or status.startswith(b"HTTP/1.0 200"), status
            self.in_body = True
        while self.in_body and b"\n\n" in self.pending:
            event, self.pending = self.pending.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if line.startswith("data: "):
                    self.stream.add(line[len("data: ") :])

    def read_available(self) -> None:
        """Everything that has reached this socket, without waiting."""
        self.sock.setblocking(False)
        try:
            while not self.closed:
                self._take(self.sock.recv(1 << 16))
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(STREAM_TIMEOUT_S)

    def read_until(self, done: Callable[[Stream], bool]) -> None:
        while not done(self.stream):
            assert not self.closed, "the stream ended early"
            self._take(self.sock.recv(1 << 16))


def test_no_token_reaches_the_client_after_keep_pause_returns(server: Server, rl: RLServeClient) -> None:
    """vLLM 0.33's contract, on the client's side of the wire: what the server sent before answering /pause is in
    the client's socket by then (loopback), so it is all taken at once when /pause returns; nothing may follow it
    until /resume (with async scheduling, the step in flight used to deliver one more token)."""
    max_tokens = 400
    raw = RawStream(server, {"model": MODEL_NAME, "prompt": "keep contract", "max_tokens": max_tokens, **GREEDY})
    try:
        for _ in range(3):
            raw.read_until(lambda s, seen=raw.stream.tokens_so_far: s.tokens_so_far >= seen + 3)
            rl.pause(mode="keep", clear_cache=False)
            raw.read_available()
            frozen = raw.stream.tokens_so_far
            time.sleep(0.3)
            raw.read_available()
            assert raw.stream.tokens_so_far == frozen, "a token arrived after /pause?mode=keep returned"
            rl.resume()
        raw.read_until(lambda s: s.done_markers == 1)
    finally:
        raw.sock.close()
    assert raw.stream.only.num_tokens == max_tokens and raw.stream.only.finish_reasons == ["length"]


@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_request_sent_while_paused_is_refused_retryable(server: Server, rl: RLServeClient, mode: str) -> None:
    """vLLM 0.33: a pause in mode abort or wait refuses new requests with 503 and a retryable error until resume
    (keep still queues them); streams too are refused before they start."""
    body = {"model": MODEL_NAME, "prompt": f"sent while paused ({mode})", "max_tokens": 8, **GREEDY}
    with server.client() as http:
        rl.pause(mode=mode)
        for stream in (False, True):
            response = http.post("/v1/completions", json={**body, "stream": stream})
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
            assert "paused" in error["message"] and "retry" in error["message"]
        rl.resume()
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8


def test_request_sent_while_keep_paused_runs_after_resume(server: Server, rl: RLServeClient) -> None:
    mode = "keep"

    async def go() -> dict:
        async with server.async_client() as http, rl_async(server) as control:
            await control.pause(mode=mode)
            body = {"model": MODEL_NAME, "prompt": f"sent while paused ({mode})", "max_tokens": 8, **GREEDY}
            task = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(1.0)
            assert not task.done(), "a request finished while the server was paused"
            await control.resume()
            response = await asyncio.wait_for(task, STREAM_TIMEOUT_S)
            assert response.status_code == 200, response.text
            return response.json()

    out = asyncio.run(go())
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 8


def test_pause_and_resume_are_idempotent(server: Server, rl: RLServeClient) -> None:
    for mode in ("abort", "wait", "keep"):
        rl.pause(mode=mode)
        rl.pause(mode=mode)
        assert rl.is_paused()
        rl.resume()
        rl.resume()
        assert not rl.is_paused()
    with server.client() as http:
        body = {"model": MODEL_NAME, "prompt": "after idempotence", "max_tokens": 4, **GREEDY}
        assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_clear_cache_drops_prefix_hits_and_false_keeps_them(server: Server, rl: RLServeClient, mode: str) -> None:
    # Long and unique per mode, so whole blocks exist and no other test's requests share them.
    prompt = f"clear-cache test for mode {mode}: " + "the same long prefix, over and over; " * 4
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "return_token_ids": True, **GREEDY}

    def run() -> tuple[int, list[int]]:
        with server.client() as http:
            response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        out = response.json()
        assert out["usage"]["prompt_tokens"] > 3 * BLOCK_SIZE
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["token_ids"]

    _, tokens = run()
    cached, again = run()
    assert cached > 0 and cached % BLOCK_SIZE == 0 and again == tokens

    rl.pause(mode=mode, clear_cache=True)
    rl.resume()
    cached, again = run()
    assert cached == 0 and again == tokens

    rl.pause(mode=mode, clear_cache=False)
    rl.resume()
    cached, again = run()
    assert cached > 0 and again == tokens


def sleep_state(http: httpx.Client) -> dict[str, float]:
    """vllm:engine_sleep_state by its sleep_state label."""
    states = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:engine_sleep_state{"):
            states[line.split('sleep_state="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return states


def test_sleep_and_wake_over_http(server: Server, rl: RLServeClient) -> None:
    """/sleep frees the engine's memory and holds requests; /wake_up brings both back, awake (vLLM 0.33) as soon as
    weights and KV cache are; bad levels, modes and tags are 400s; vllm:engine_sleep_state follows."""
    with server.client() as http:
        body = {"model": MODEL_NAME, "prompt": "sleep and wake", "max_tokens": 6, **GREEDY}
        before = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        for bad, field in ((lambda: rl.sleep(level=5), "query.level"), (lambda: rl.wake_up(["nap"]), "query.tags")):
            with pytest.raises(RLServeError) as err:
                bad()
            assert err.value.status_code == 400 and err.value.param == field
        refused = http.post("/sleep", params={"level": 1, "mode": "nap"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "query.mode"
        assert not rl.is_sleeping()
        assert sleep_state(http) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
        assert http.post("/sleep", params={"level": 1, "mode": "keep"}).json() == {"status": "sleeping", "level": 1}
        try:
            assert rl.is_sleeping()
            assert sleep_state(http) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
            with pytest.raises(httpx.ReadTimeout):  # held, not refused, while asleep
                http.post("/v1/completions", json=body, timeout=1.0)
            woken = http.post("/wake_up", params={"tags": "weights"}).json()
            assert woken == {"status": "sleeping", "tags": ["weights"]} and rl.is_sleeping()
            assert http.post("/wake_up", params={"tags": "kv_cache"}).json()["status"] == "awake"
            assert not rl.is_sleeping()
        finally:
            rl.wake_up()
        assert not rl.is_sleeping()
        assert sleep_state(http) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == before
    assert httpx.post(f"{server.url}/sleep").status_code == 401  # the API key is required
