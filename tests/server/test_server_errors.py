"""Authentication, the RL API switch, and bad inputs: each answered with OpenAI's error JSON, the server unharmed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
from server_helpers import API_KEY, MODEL_NAME, Server, Stream, read_stream

from rlserve.rl.client import RLServeClient

RL_ROUTES = [
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/start_weight_update"),
    ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"),
    ("POST", "/update_weight_version"),
    ("GET", "/weight_version"),
    ("GET", "/weight_info"),
    ("GET", "/get_world_size"),
    ("POST", "/abort_requests"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/weight_checker"),
]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_rl_routes_are_404_when_disabled(plain_server: Server) -> None:
    with httpx.Client(base_url=plain_server.url, timeout=30) as http:
        for method, path in RL_ROUTES:
            assert http.request(method, path, json={}).status_code == 404, path
        # No key configured: the OpenAI routes are open.
        body = {"model": MODEL_NAME, "prompt": "open", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200


def test_rl_and_v1_routes_demand_the_api_key(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
            for method, path in [*RL_ROUTES, ("POST", "/v1/completions"), ("GET", "/v1/models")]:
                assert_error(http.request(method, path, json={}), 401)
            assert http.get("/health").status_code == 200
    with server.client() as http:
        assert http.get("/is_paused").json() == {"is_paused": False}
        assert http.get("/get_world_size").json() == {"world_size": 1}
        # vLLM 0.33's model-format names: refused by name (as LLM.start_weight_update refuses them), nothing started.
        refused = http.post("/start_weight_update", json={"is_checkpoint_format": False})
        assert_error(refused, 400, "is_checkpoint_format")


def test_enable_rl_api_without_a_key_refuses_to_start(server_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RLSERVE_API_KEY"}
    cmd = [sys.executable, "-m", "rlserve.cli", "serve", str(server_model_dir), "--enable-rl-api", "--port", "9"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "API key" in done.stderr


def test_bad_inputs_are_refused_and_the_server_keeps_serving(server: Server, rl: RLServeClient) -> None:
    async def go() -> Stream:
        stream = Stream()
        async with server.async_client() as http:
            body = {"model": MODEL_NAME, "prompt": "undisturbed", "max_tokens": 120, **GREEDY}
            task = asyncio.create_task(read_stream(http, "/v1/completions", body, into=stream))
            while stream.tokens_so_far < 1:
                assert not task.done(), task.exception()
                await asyncio.sleep(0.01)
            await asyncio.to_thread(send_bad_inputs, server)
            await asyncio.wait_for(task, 60)
        return stream

    stream = asyncio.run(go())
    assert stream.only.finish_reasons == ["length"] and stream.only.num_tokens == 120 and not stream.errors
    assert not rl.is_paused()
    with server.client() as http:
        response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "fine", "max_tokens": 3, **GREEDY})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def send_bad_inputs(server: Server) -> None:
    with server.client() as http:

        def completion(**body: object) -> httpx.Response:
            return http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", **body})

        def chat(**body: object) -> httpx.Response:
            messages = [{"role": "user", "content": "x"}]
            return http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, **body})

        json_type = {"content-type": "application/json"}
        assert_error(http.post("/v1/completions", content=b'{"prompt": "x",', headers=json_type), 400)
        assert_error(completion(max_tokens="many"), 400, "max_tokens")
        assert_error(completion(temperature="hot"), 400, "temperature")
        assert_error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": "hi"}), 400, "messages")

        assert_error(completion(temperature=-1), 400, "temperature")
        assert_error(completion(top_p=2), 400, "top_p")
        assert_error(completion(n=0), 400, "n")
        assert_error(completion(max_tokens=0), 400, "max_tokens")
        assert_error(completion(logprobs=1000), 400, "logprobs")
        assert_error(completion(prompt="y" * 1100), 400, "prompt")
        assert_error(completion(prompt="y" * 1000, max_tokens=100), 400, "max_tokens")
        assert_error(completion(prompt=[10**9]), 400, "prompt")
        assert_error(completion(presence_penalty=2.5), 400, "presence_penalty")
        assert_error(completion(repetition_penalty=0), 400, "repetition_penalty")
        assert_error(completion(logit_bias={"seven": 1.0}), 400, "logit_bias")
        assert_error(completion(logit_bias={str(10**9): 1.0}), 400, "logit_bias")
        assert_error(completion(allowed_token_ids=[]), 400, "allowed_token_ids")
        assert_error(chat(allowed_token_ids=[10**9]), 400, "allowed_token_ids")
        assert_error(chat(bad_words=[""]), 400, "bad_words")
        assert_error(chat(top_logprobs=1000, logprobs=True), 400, "top_logprobs")
        assert_error(chat(top_logprobs=2), 400, "top_logprobs")
        assert_error(chat(max_completion_tokens=-3), 400, "max_completion_tokens")
        # The message names the field as the request does (the engine's check says max_tokens).
        too_long = assert_error(chat(max_completion_tokens=5000), 400, "max_completion_tokens")
        assert too_long["message"].startswith("max_completion_tokens: this model's maximum context length")
        assert assert_error(chat(top_logprobs=2), 400, "top_logprobs")["message"].startswith("top_logprobs")
        assert_error(completion(model="another-model"), 404, "model")

        assert_error(http.post("/pause", params={"mode": "nap"}), 400, "query.mode")
        assert http.get("/is_paused").json() == {"is_paused": False}
        assert_error(http.post("/init_weight_transfer_engine", content=b"{", headers=json_type), 400)
        assert_error(http.post("/init_weight_transfer_engine", json={"init_info": 5}), 400, "init_info")
        incomplete = {"init_info": {"master_port": 1}}
        assert_error(http.post("/init_weight_transfer_engine", json=incomplete), 400, "init_info")
        assert_error(http.post("/update_weights", json={}), 400, "update_info")
        assert_error(http.post("/finish_weight_update", json={}), 409)
        assert_error(http.post("/update_weight_version", json={}), 400, "new_version")
        assert_error(http.post("/weight_checker", json={"action": "fold"}), 400, "action")


def test_weight_update_out_of_lifecycle_order_is_a_conflict(server: Server) -> None:
    # Whether or not a transfer group exists yet, neither call is valid before start_weight_update.
    with server.client() as http:
        empty = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
        assert_error(http.post("/update_weights", json=empty), 409)
        assert_error(http.post("/finish_weight_update"), 409)
