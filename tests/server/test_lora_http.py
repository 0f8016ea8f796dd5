"""LoRA adapters over HTTP against a real `rlserve serve --enable-lora` (vLLM's routes and shapes): adapters named as a
request's `model` in every generating route, listed by /v1/models, loaded, reloaded in place and unloaded at run
time, refused with the status and field a client can act on, and the adapter's output what the checkpoint with it
merged gives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import HTTP_TIMEOUT_S, MODEL_NAME, Server

from rlserve import SamplingParams

PROMPT_IDS = [11, 42, 7, 99, 23, 5]
MAX_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.fixture
def http(lora_server: Server) -> Iterator[httpx.Client]:
    with lora_server.client() as client:
        yield client


def generate(http: httpx.Client, model: str, token_ids: list[int] = PROMPT_IDS, **params) -> dict:
    body = {"model": model, "token_ids": token_ids, "sampling_params": {**GREEDY, **params}}
    response = http.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def load(http: httpx.Client, name: str, path: Path | str, **extra) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


def unload(http: httpx.Client, name: str) -> httpx.Response:
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def error_param(response: httpx.Response) -> str:
    return response.json()["error"]["param"]


def models(http: httpx.Client) -> dict[str, dict]:
    return {card["id"]: card for card in http.get("/v1/models").json()["data"]}


def test_models_list_the_adapters_with_their_parent(http: httpx.Client, server_lora_dirs) -> None:
    cards = models(http)
    assert cards["static"]["parent"] == MODEL_NAME and cards["static"]["root"] == str(server_lora_dirs["static"])
    assert cards[MODEL_NAME]["parent"] is None


def test_the_adapter_computes_what_the_merged_checkpoint_does(http, server_lora_dirs, make_llm) -> None:
    adapted = generate(http, "static")
    assert adapted["token_ids"] != generate(http, MODEL_NAME)["token_ids"]  # the adapter changes the output
    merged = make_llm(server_lora_dirs["static-merged"], in_process=True)
    try:
        params = SamplingParams(**GREEDY)
        (expected,) = merged.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)
    finally:
        merged.shutdown()
    assert adapted["token_ids"] == expected.outputs[0].token_ids


def test_openai_routes_take_the_adapter_as_model(lora_server: Server, http: httpx.Client) -> None:
    oai = lora_server.openai()
    completion = oai.completions.create(
        model="static", prompt=PROMPT_IDS, extra_body={**GREEDY, "return_token_ids": True}
    )
    assert completion.model == "static"
    assert completion.choices[0].model_extra["token_ids"] == generate(http, "static")["token_ids"]
    chat = oai.chat.completions.create(
        model="static", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0
    )
    assert chat.model == "static" and chat.usage.completion_tokens == 4
    stream = oai.chat.completions.create(
        model="static", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        oai.completions.create(model="nope", prompt="hi", max_tokens=2)


def test_load_reload_and_unload(http: httpx.Client, server_lora_dirs) -> None:
    response = load(http, "fresh", server_lora_dirs["fresh"])
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'fresh' added successfully."
    try:
        assert "fresh" in models(http)
        before = generate(http, "fresh")["token_ids"]
        # A second load of the same name is refused unless it asks for a reload; the refusal changes nothing.
        again = load(http, "fresh", server_lora_dirs["fresh-v2"])
        assert again.status_code == 400 and error_param(again) == "lora_name"
        assert generate(http, "fresh")["token_ids"] == before
        # Both slots are taken (static, fresh): a third adapter is a conflict, not a bad request.
        third = load(http, "third", server_lora_dirs["fresh-v2"])
        assert third.status_code == 409 and "max_loras" in third.json()["error"]["message"]
        # In place: the same name now runs the new weights (an RL trainer's step), and no cached KV of the old.
        reload = load(http, "fresh", server_lora_dirs["fresh-v2"], load_inplace=True)
        assert reload.status_code == 200, reload.text
        after = generate(http, "fresh")["token_ids"]
        assert after != before
        # A missing adapter directory: 403 naming lora_path (as one outside --allowed-weight-dirs, so that nobody
        # learns which directories exist), the adapter loaded under that name untouched.
        bad = load(http, "fresh", server_lora_dirs["fresh"].parent / "missing", load_inplace=True)
        assert bad.status_code == 403 and error_param(bad) == "lora_path" and "not a directory under" in bad.text
        assert generate(http, "fresh")["token_ids"] == after
    finally:
        response = unload(http, "fresh")
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'fresh' removed successfully."
    assert "fresh" not in models(http)
    gone = http.post("/inference/v1/generate", json={"model": "fresh", "token_ids": PROMPT_IDS})
    assert gone.status_code == 404 and error_param(gone) == "model"
    again = unload(http, "fresh")
    assert again.status_code == 404 and error_param(again) == "lora_name"


def test_unload_while_a_request_runs_lets_it_finish(lora_server: Server, http, server_lora_dirs) -> None:
    """The running request keeps its adapter to the end; the slot comes back for the next load after it."""
    assert load(http, "fresh", server_lora_dirs["fresh"]).status_code == 200
    expected = generate(http, "fresh", max_tokens=64)["token_ids"]
    body = {"model": "fresh", "token_ids": PROMPT_IDS, "sampling_params": {**GREEDY, "max_tokens": 64}, "stream": True}
    token_ids: list[int] = []
    with lora_server.client() as streaming, streaming.stream("POST", "/inference/v1/generate", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                token_ids += json.loads(line[6:])["choices"][0]["token_ids"]
                break  # the request runs: unload under it
        assert unload(http, "fresh").status_code == 200
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                token_ids += json.loads(line[6:])["choices"][0]["token_ids"]
    assert token_ids == expected
    other = load(http, "other", server_lora_dirs["fresh-v2"])
    assert other.status_code == 200, other.text
    assert unload(http, "other").status_code == 200


def test_adapter_routes_are_behind_the_api_key(lora_server: Server, server_lora_dirs) -> None:
    with httpx.Client(base_url=lora_server.url, timeout=HTTP_TIMEOUT_S) as anonymous:
        assert load(anonymous, "fresh", server_lora_dirs["fresh"]).status_code == 401
        assert unload(anonymous, "static").status_code == 401


def test_bad_bodies_name_their_field(http: httpx.Client, server_lora_dirs: dict[str, Path]) -> None:
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert response.status_code == 400 and "lora_path" in response.text
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x", "surprise": 1})
    assert response.status_code == 400 and "surprise" in response.text
    response = load(http, MODEL_NAME, server_lora_dirs["fresh"])
    assert response.status_code == 400 and error_param(response) == "lora_name"
