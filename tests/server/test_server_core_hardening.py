"""Issue 28's engine-core findings, against one real `rlserve serve` (tiny model, loopback): what a keyed call or a
local user could do to the engine core, and what the core now does instead."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from conftest import TESTS_DIR, _stop, _wait_healthy
from server_helpers import API_KEY, MODEL_NAME, Server, Stream, free_port, launch

from rlserve.engine.frontend.args import make_engine_config
from rlserve.engine.frontend.core_client import MPClient
from rlserve.engine.frontend.launcher import CoreProcess
from rlserve.engine.wire.backends import registered_backends
from rlserve.engine.wire.messages import UtilityCall

MAX_TRACED_STEPS = 2  # the operator's profiler_config.max_iterations


@pytest.fixture(scope="module")
def core_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with a worker extension, under umask 000 and a temp dir of its own (where the core's socket is)."""
    root = tmp_path_factory.mktemp("core-hardening")
    (root / "tmp").mkdir()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}
    env["TMPDIR"] = str(root / "tmp")
    argv = [str(server_model_dir), "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--enable-rl-api"]
    argv += ["--worker-extension-cls", "worker_extension:CheckpointLoader", "--log-level", "warning"]
    profiler = {"profiler": "torch", "torch_profiler_dir": str(root / "traces"), "max_iterations": MAX_TRACED_STEPS}
    argv += ["--profiler-config", json.dumps(profiler)]
    old_umask = os.umask(0)  # inherited by the server: every file it creates is world-writable unless it says not
    try:
        server = launch(root, *argv, env=env, headers={"Authorization": f"Bearer {API_KEY}"})
    finally:
        os.umask(old_umask)
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(server)


def _complete(server: Server, **fields) -> dict:
    body = {"model": MODEL_NAME, "prompt": "core", "max_tokens": 4, "temperature": 0.0, **fields}
    with server.client() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_collective_rpc_results_never_kill_the_core(core_server: Server) -> None:
    """Issue 28 row 1: a tensor result used to kill the core (msgspec cannot encode it). Tensors come back as
    lists; an object or a method's own KeyError is a 400 naming the method; the core serves on after each."""
    with core_server.client() as http:
        tensor = http.post("/collective_rpc", json={"method": "first_weights", "args": [3]})
        assert tensor.status_code == 200, tensor.text
        [values] = tensor.json()["results"]
        assert len(values) == 3 and all(isinstance(v, float) for v in values)
        for method, args, says in (("opaque", [], "builtins.object is not plain data"), ("lookup", ["x"], "KeyError")):
            refused = http.post("/collective_rpc", json={"method": method, "args": args})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "method" and repr(method) in error["message"] and says in error["message"]
        assert http.get("/health").status_code == 200
    assert _complete(core_server)["choices"][0]["finish_reason"] == "length"


async def _abandon_stream(http: httpx.AsyncClient, body: dict) -> None:
    """Start a stream and leave after its first event: the server aborts the request in the core."""
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return


def test_a_request_id_still_held_by_the_engine_is_409(core_server: Server) -> None:
    """Issue 28: a request id reused right after its stream was left used to get the earlier request's abort
    (finish_reason "abort" after a token or none) or a 503. Until the core has ended the earlier one the id is the
    client's conflict (409 naming request_id); after that it serves in full."""

    async def run() -> list[tuple[int, str | None]]:
        outcomes = []
        async with core_server.async_client() as http:
            for i in range(12):
                body = {
                    "model": MODEL_NAME,
                    "prompt": "reuse",
                    "max_tokens": 40,
                    "ignore_eos": True,
                    "request_id": f"reused-{i}",
                }
                await _abandon_stream(http, body)
                response = await http.post("/v1/completions", json=body)
                if response.status_code == 409:
                    assert response.json()["error"]["param"] == "request_id"
                    outcomes.append((409, None))
                else:
                    assert response.status_code == 200, response.text
                    outcomes.append((200, response.json()["choices"][0]["finish_reason"]))
        return outcomes

    outcomes = asyncio.run(run())
    assert all(outcome in ((409, None), (200, "length")) for outcome in outcomes), outcomes


def test_the_operators_profiler_max_iterations_is_a_ceiling(core_server: Server) -> None:
    """Issue 28 row 10: a /start_profile body traced past the operator's max_iterations. It may ask for fewer steps;
    more, or 0 (until /stop_profile), is a 400 naming max_iterations."""
    with core_server.client() as http:
        for asked in (MAX_TRACED_STEPS + 1, 0):
            refused = http.post("/start_profile", json={"max_iterations": asked})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "max_iterations"
            assert f"at most {MAX_TRACED_STEPS}" in refused.json()["error"]["message"]
        assert http.post("/start_profile", json={"max_iterations": 1}).status_code == 200
        assert http.post("/stop_profile").status_code == 200


def _core_socket(core_server: Server) -> Path:
    [path] = (p for p in (Path(core_server.log).parent / "tmp").rglob("*.sock") if "rlserve-core-" in str(p))
    return path


def test_the_core_socket_is_private_and_keyed(core_server: Server) -> None:
    """Issue 28 row 2: under umask 000 the core's socket was world-writable, and a hand-written ZMQ client drove the
    core (rewrote the weight version, paused it). The socket's directory is 0700 whatever the umask, and a client
    without the core's secret (none, or a wrong one) gets no connection: nothing it sends reaches the core."""
    path = _core_socket(core_server)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with core_server.client() as http:
        version = http.get("/weight_version").json()["weight_version"]
    _drive_without_the_secret(f"ipc://{path}")
    with core_server.client() as http:
        assert http.get("/weight_version").json()["weight_version"] == version
        assert http.get("/is_paused").json() == {"is_paused": False}
    assert _complete(core_server)["choices"][0]["finish_reason"] == "length"


def _drive_without_the_secret(address: str) -> None:
    """What issue 28's intruder did (rewrite the weight version, pause the engine), as a ZMQ client without the
    core's secret and then with a wrong one; each must get no answer."""
    calls = [UtilityCall(1, "update_weight_version", ["pwned"]), UtilityCall(2, "pause", ["keep", False])]
    with zmq.Context() as context:
        for password in (None, b"not-the-secret"):
            with context.socket(zmq.DEALER) as intruder:
                intruder.setsockopt(zmq.LINGER, 0)
                if password is not None:
                    intruder.plain_username, intruder.plain_password = b"rlserve", password
                intruder.connect(address)
                for call in calls:
                    intruder.send(msgspec.msgpack.encode(call), zmq.NOBLOCK)
                assert not intruder.poll(1500), "the core answered a client without its secret"


def test_a_core_listening_on_tcp_is_keyed(server_model_dir: Path) -> None:
    """Issue 28 row 2: a Ray core on another node listens on TCP (core/actor.py), where no directory's mode guards
    the socket. The same core loop on a TCP address: a client without the secret (none, or a wrong one) gets no
    answer, and the weight version and pause state its calls would have changed are unchanged."""
    config = make_engine_config(str(server_model_dir), num_kv_blocks=16, max_model_len=64)
    address = f"tcp://127.0.0.1:{free_port()}"
    client = MPClient(config, lambda config: CoreProcess(config, registered_backends(config), address=address))
    try:
        client.connect()
        assert client.process.address == address
        version = client.call("get_weight_version")
        _drive_without_the_secret(address)
        assert client.call("get_weight_version") == version and client.call("is_paused") is False
    finally:
        client.shutdown()
    assert not client.process.is_alive()


def test_allowed_token_ids_are_bounded_and_built_once(core_server: Server, server_model_dir: Path) -> None:
    """Issue 28 row 3: `[5] * 1e6` (n=4) held the engine 7-9 s, rebuilt every step. A list longer than the vocabulary
    is a 400 naming the field, at once; a valid one still constrains the output; one as long as the vocabulary
    (every id) is built once per request, so neither it nor a request beside it waits long (the toy's vocabulary is
    small: this bounds the time, the saving shows with a real one)."""
    vocab_size = json.loads((server_model_dir / "config.json").read_text())["vocab_size"]
    with core_server.client() as http:
        started = time.monotonic()
        refused = http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "allowed_token_ids": [5] * 10**6}
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "allowed_token_ids", refused.text
        assert time.monotonic() - started < 10.0
        out_of_range = http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "allowed_token_ids": [vocab_size]}
        )
        assert out_of_range.status_code == 400 and out_of_range.json()["error"]["param"] == "allowed_token_ids"
    constrained = _complete(
        core_server, allowed_token_ids=[7, 9, 7], max_tokens=8, ignore_eos=True, temperature=1.0, return_token_ids=True
    )
    assert set(constrained["choices"][0]["token_ids"]) <= {7, 9}

    async def run() -> tuple[float, float]:
        every_id = list(range(vocab_size))
        async with core_server.async_client() as http:
            big = {"model": MODEL_NAME, "prompt": "x", "allowed_token_ids": every_id, "n": 4, "max_tokens": 16}
            small = {"model": MODEL_NAME, "prompt": "y", "max_tokens": 4}

            async def timed(body: dict) -> float:
                started = time.monotonic()
                response = await http.post("/v1/completions", json={**body, "ignore_eos": True})
                assert response.status_code == 200, response.text
                return time.monotonic() - started

            big_task = asyncio.create_task(timed(big))
            await asyncio.sleep(0.3)  # the big one is in the engine
            small_s = await timed(small)
            return await big_task, small_s

    big_s, small_s = asyncio.run(run())
    assert big_s < 10.0 and small_s < 3.0, (big_s, small_s)


def test_bad_words_are_bounded_and_built_once(core_server: Server) -> None:
    """Issue 28: 128 bad words of 300 characters made an n=8 request 7.5x slower (every step walked every word).
    That many tokens of bad words is a 400 naming the field; words within the bound are built once per request and
    cost a step little."""
    with core_server.client() as http:
        too_many = {"model": MODEL_NAME, "prompt": "x", "bad_words": [f"{i:03d}" + "b" * 297 for i in range(128)]}
        refused = http.post("/v1/completions", json=too_many)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words", refused.text
    words = [f"{i:03d}" + "q" * 16 for i in range(90)]  # near the bound: 90 x 2 forms x 19-20 tokens

    def timed(**fields) -> float:
        started = time.monotonic()
        _complete(core_server, n=8, max_tokens=64, ignore_eos=True, temperature=1.0, **fields)
        return time.monotonic() - started

    plain_s = min(timed() for _ in range(2))
    with_words_s = min(timed(bad_words=words) for _ in range(2))
    assert with_words_s < 2 * plain_s + 0.5, (with_words_s, plain_s)


async def _accepted_stream(http: httpx.AsyncClient, body: dict) -> Stream | None:
    """A stream read to its end, or None when the server refused it (the pause had begun: a retryable 503)."""
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            assert response.status_code == 503, (await response.aread()).decode()
            return None
        stream = Stream()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                stream.add(line[len("data: ") :])
        stream.finished_at = time.monotonic()
        return stream


def test_streams_accepted_before_an_abort_pause_end_with_abort(core_server: Server) -> None:
    """Issue 28: streams accepted (200, stream begun) just before an abort pause waited and then got an error event
    ("generation is paused; retry") with no finish_reason. Every accepted stream ends promptly with finish_reason
    "abort" and no error event, as the pause ended the others; only a request the pause came first for is a 503."""
    body = {"model": MODEL_NAME, "max_tokens": 500, "ignore_eos": True}

    async def round_of(http: httpx.AsyncClient, rl: httpx.AsyncClient, i: int) -> tuple[list[Stream], float]:
        tasks = [asyncio.create_task(_accepted_stream(http, {**body, "prompt": f"r{i} s{k}"})) for k in range(12)]
        await asyncio.sleep(0.01 * i)  # the pause lands at a different point of the streams' start each round
        assert (await rl.post("/pause", params={"mode": "abort"})).status_code == 200
        paused_at = time.monotonic()
        streams = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert (await rl.post("/resume")).status_code == 200
        return [s for s in streams if s is not None], paused_at

    async def run() -> list[tuple[list[Stream], float]]:
        async with core_server.async_client() as http, core_server.async_client() as rl:
            return [await round_of(http, rl, i) for i in range(6)]

    for streams, paused_at in asyncio.run(run()):
        for stream in streams:
            assert stream.errors == [] and stream.done_markers == 1, stream.errors
            assert [c.finish_reasons for c in stream.choices.values()] == [["abort"]], stream.choices
            assert stream.finished_at - paused_at < 3.0
