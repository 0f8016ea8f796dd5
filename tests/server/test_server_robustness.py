"""Issue 20's bad inputs against a real server: each one a 4xx naming the field (or 413, or 504 for a timeout),
never a 5xx; connections kept; /health answering while a pathological request is handled; the engine serving after."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from server_helpers import MODEL_NAME, Server, free_port
from test_server_errors import GREEDY, assert_error

from rlserve.engine.frontend.validation import MAX_SAMPLES_PER_REQUEST, MAX_STRING_CHARS, MAX_STRINGS_PER_FIELD
from rlserve.server.guards import DEFAULT_MAX_REQUEST_BODY_BYTES, RequestGuard

JSON = {"content-type": "application/json"}
NOT_UTF8 = b'{"method": "describe\xff\xfe"}'
# /health's bound while one bad request is handled, issue 28's 1 s on CPU: 0.14-0.25 s measured on 2 cores shared by
# four engineers' runs (load 5) since a chat is refused before its messages are validated (1.2 s before); the stalls
# this guards against were 2.7 to 30 s.
HEALTH_BOUND_S = 1.0


def test_bad_bodies_are_400s_naming_the_field(server: Server) -> None:
    with server.client() as http:
        for path in (
            "/update_weights",
            "/finish_weight_update",
            "/collective_rpc",
            "/start_weight_update",
            "/init_weight_transfer_engine",
            "/update_weight_version",
            "/abort_requests",
            "/weight_checker",
            "/inference/v1/generate",
            "/v1/completions",
            "/tokenize",
        ):
            assert_error(http.post(path, content=NOT_UTF8, headers=JSON), 400)

        for ids in ([{}], [[1]], [None], "r1"):
            assert_error(http.post("/abort_requests", json={"request_ids": ids}), 400, "request_ids")
        for baseline in (["a"], "sha"):
            body = {"action": "compare", "baseline": baseline}
            assert_error(http.post("/weight_checker", json=body), 400, "baseline")
        for version in (False, 1.5, None):
            assert_error(http.post("/update_weight_version", json={"new_version": version}), 400, "new_version")
        assert_error(http.post("/finish_weight_update", json={"weight_version": True}), 400, "weight_version")
        for timeout in (0, -1, 0.5, "soon"):
            body = {"method": "describe", "timeout": timeout}
            assert_error(http.post("/collective_rpc", json=body), 400, "timeout")
        assert_error(http.post("/update_weights", json={"weight_dir": "/tmp/a\0b"}), 400, "weight_dir")
        # The core process takes 64-bit integers: a larger one is the field's fault, not the server's.
        assert_error(http.post("/update_weights", json={"update_info": {"names": [2**70]}}), 400, "update_info")

        # Lone surrogates (JSON's "\ud800" escape) are no text a tokenizer takes.
        surrogate = '"a\\ud800b"'
        for path, body, field in (
            ("/v1/completions", f'{{"model": "{MODEL_NAME}", "prompt": {surrogate}}}', "prompt"),
            ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {surrogate}}}]}}', "messages"),
            ("/v1/completions", f'{{"prompt": "x", "stop": [{surrogate}]}}', "stop"),
            ("/tokenize", f'{{"prompt": {surrogate}}}', "prompt"),
        ):
            error = assert_error(http.post(path, content=body.encode(), headers=JSON), 400, field)
            assert "surrogate" in error["message"]

        # Non-finite numbers (Python's JSON parser reads NaN and Infinity).
        for field, value in (("temperature", "NaN"), ("top_p", "Infinity"), ("presence_penalty", "-Infinity")):
            body = f'{{"model": "{MODEL_NAME}", "prompt": "x", "{field}": {value}}}'
            assert_error(http.post("/v1/completions", content=body.encode(), headers=JSON), 400, field)
        body = '{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": Infinity}}'
        assert_error(http.post("/v1/chat/completions", content=body.encode(), headers=JSON), 400, "logit_bias")
        body = '{"token_ids": [1, 2], "sampling_params": {"temperature": NaN}}'
        response = http.post("/inference/v1/generate", content=body.encode(), headers=JSON)
        assert_error(response, 400, "sampling_params.temperature")

        # Limits: what one request may multiply.
        def completion(**fields: object) -> httpx.Response:
            return http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", **fields})

        assert_error(completion(n=MAX_SAMPLES_PER_REQUEST + 1), 400, "n")
        assert_error(completion(prompt=["a", "b"], n=MAX_SAMPLES_PER_REQUEST // 2 + 1), 400, "n")
        assert_error(completion(stop=[f"s{i}" for i in range(MAX_STRINGS_PER_FIELD + 1)]), 400, "stop")
        assert_error(completion(stop="s" * (MAX_STRING_CHARS + 1)), 400, "stop")
        assert_error(completion(bad_words=[f"w{i}" for i in range(MAX_STRINGS_PER_FIELD + 1)]), 400, "bad_words")
        generate = {"token_ids": [1], "sampling_params": {"n": MAX_SAMPLES_PER_REQUEST + 1}}
        assert_error(http.post("/inference/v1/generate", json=generate), 400, "sampling_params.n")
        assert_error(completion(prompt="y" * 10**6), 400, "prompt")

        # A request's own chat template needs --trust-request-chat-template (this server has not).
        messages = [{"role": "user", "content": "hi"}]
        chat = {"messages": messages, "chat_template": "{{ messages[0].content }}"}
        assert_error(http.post("/v1/chat/completions", json=chat), 400, "chat_template")
        assert_error(http.post("/v1/chat/completions/render", json=chat), 400, "chat_template")
        kwargs_template = {"messages": messages, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}
        assert_error(http.post("/v1/chat/completions", json=kwargs_template), 400, "chat_template_kwargs")

        assert http.get("/health").status_code == 200
        served = completion(max_tokens=3, **GREEDY)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3


def test_a_body_over_the_limit_is_413_as_it_arrives(server: Server) -> None:
    too_big = b" " * (DEFAULT_MAX_REQUEST_BODY_BYTES + 1)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts the bytes as they come
        for start in range(0, len(too_big), 1 << 20):
            yield too_big[start : start + (1 << 20)]

    with server.client() as http:
        for content in (too_big, chunks()):
            error = assert_error(http.post("/v1/completions", content=content, headers=JSON), 413)
            assert "--max-request-body-bytes" in error["message"]
        assert http.get("/health").status_code == 200


def test_connections_are_kept_after_errors(server: Server) -> None:
    """An error answer leaves the connection open for the client's next request (http.client raises
    RemoteDisconnected if the server closed it)."""
    address = urlsplit(server.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    headers = {**server.headers, **JSON}
    try:
        for body in (NOT_UTF8, b'{"request_ids": [null]}', b"{", b'{"request_ids": ["nobody"]}'):
            connection.request("POST", "/abort_requests", body=body, headers=headers)
            response = connection.getresponse()
            response.read()
            assert response.status in (200, 400)
        assert response.status == 200
    finally:
        connection.close()


@pytest.fixture
def failing_app_url() -> Iterator[str]:
    """A real uvicorn serving an app whose route raises: RequestGuard's 500 path, which no input of the rlserve
    server is known to reach."""
    app = FastAPI()
    app.add_middleware(RequestGuard, max_body_bytes=1024)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("unexpected")

    @app.get("/fine")
    async def fine() -> dict[str, bool]:
        return {"fine": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_an_unexpected_exception_is_a_json_500_on_a_kept_connection(failing_app_url: str) -> None:
    connection = http.client.HTTPConnection(failing_app_url, timeout=30)
    try:
        connection.request("GET", "/boom")
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 500 and error["code"] == 500 and "unexpected" in error["message"]
        connection.request("GET", "/fine")  # same connection
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read()) == {"fine": True}
    finally:
        connection.close()


def test_health_answers_while_a_pathological_request_is_handled(server: Server) -> None:
    """A chat of 100,000 messages (a ~5 MB body: the template renders megabytes, refused before tokenizing) and a
    prompt at the character limit tokenized: /health answers within HEALTH_BOUND_S throughout."""
    messages = [{"role": "user", "content": f"message {i} " + "z" * 30} for i in range(100_000)]

    async def go() -> tuple[list[httpx.Response], float, int]:
        async with server.async_client() as bad, httpx.AsyncClient(base_url=server.url, timeout=30) as probe:
            requests = asyncio.gather(
                bad.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages}),
                bad.post("/tokenize", json={"prompt": "t" * 30_000}),
            )
            worst, probes = 0.0, 0
            while not requests.done():
                start = time.perf_counter()
                assert (await probe.get("/health")).status_code == 200
                worst, probes = max(worst, time.perf_counter() - start), probes + 1
                await asyncio.sleep(0.02)
            return await requests, worst, probes

    (chat, tokenized), worst, probes = asyncio.run(go())
    assert_error(chat, 400, "messages")
    assert tokenized.status_code == 200 and tokenized.json()["count"] == 30_000
    # At least one probe ran while they were handled: since issue 28 the chat is refused before its messages are
    # validated, so the pair may end within a probe or two.
    assert probes >= 1 and worst < HEALTH_BOUND_S, (probes, worst)


def test_a_collective_rpc_timeout_is_504_and_the_call_stays_visible(extension_server: Server) -> None:
    with extension_server.client() as http:
        slow = http.post("/collective_rpc", json={"method": "nap", "args": [3.0], "timeout": 1.0})
        assert_error(slow, 504, "timeout")
        # The core cannot interrupt the call: until it returns, other calls are refused, not queued behind it.
        assert_error(http.post("/collective_rpc", json={"method": "describe"}), 409, "method")
        deadline = time.monotonic() + 30
        while (described := http.post("/collective_rpc", json={"method": "describe"})).status_code == 409:
            assert time.monotonic() < deadline, "the timed-out call never ended"
            time.sleep(0.2)
        assert described.status_code == 200 and described.json()["results"][0]["device"] == "cpu"
        fast = http.post("/collective_rpc", json={"method": "nap", "args": [0.0], "timeout": 30})
        assert fast.status_code == 200 and fast.json() == {"results": [0.0]}


def test_an_idle_connection_outlives_the_clients_pool_expiry(server: Server) -> None:
    """A kept-alive connection left idle longer than httpx's 5 s pool expiry still takes the next request: the server
    is not the side that closes it under a client (the race that lost requests under load, issue 20.6)."""
    host, port = server.url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(request)
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(5.5)
        conn.sendall(request)
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
