"""`rlserve serve --enable-return-routed-experts` with a tiny Qwen3-MoE: each finished choice carries vLLM's
`routed_experts` (base64 of a .npy array [tokens - 1 - routed_experts_prompt_start, layers, top_k]), equal to the
Hugging Face router's choices, on the completion, chat, streaming and token-in-token-out routes."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import _serve
from server_helpers import API_KEY, MODEL_NAME, Server

from rlserve.toy import make_model_dir

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
MAX_TOKENS = 6
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": MAX_TOKENS, "return_token_ids": True}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("moe-server") / "moe", preset="tiny-moe", initializer_range=0.2)


@pytest.fixture(scope="module")
def http(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    log = tmp_path_factory.mktemp("server-logs") / "moe.log"
    for server in _serve(moe_dir, log, "--enable-return-routed-experts", "--num-kv-blocks", "64", api_key=API_KEY):
        server: Server
        with server.client() as client:
            yield client


def decode(field: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(field)), allow_pickle=False)


@torch.inference_mode()
def hf_routing(hf_model, token_ids: list[int], top_k: int) -> np.ndarray:
    router_logits = hf_model(torch.tensor([token_ids]), output_router_logits=True).router_logits
    choices = [torch.topk(logits.softmax(-1), top_k, dim=-1).indices.numpy() for logits in router_logits]
    return np.stack(choices, axis=1).astype(np.uint8)


def completion(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, **GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_routed_experts_over_http(http, moe_dir, hf) -> None:
    choice = completion(http)
    routed = decode(choice["routed_experts"])
    sequence = PROMPT + choice["token_ids"]
    assert routed.shape == (len(sequence) - 1, 2, 2) and routed.dtype == np.uint8
    np.testing.assert_array_equal(routed, hf_routing(hf.model(moe_dir), sequence[:-1], top_k=2))
    # routed_experts_prompt_start drops the routing of the prompt's first tokens (a multi-turn caller has them).
    skipped = decode(completion(http, routed_experts_prompt_start=4)["routed_experts"])
    np.testing.assert_array_equal(skipped, routed[4:])
    response = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, **GREEDY, "routed_experts_prompt_start": 10}
    )
    assert response.status_code == 400 and "routed_experts_prompt_start" in response.text
    # Token in, tokens out: the same routing.
    sampling = {k: v for k, v in GREEDY.items() if k != "return_token_ids"}
    body = {"model": MODEL_NAME, "token_ids": PROMPT, "sampling_params": sampling}
    response = http.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    np.testing.assert_array_equal(decode(response.json()["choices"][0]["routed_experts"]), routed)


def test_routed_experts_on_chat_and_the_last_stream_chunk(http) -> None:
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **GREEDY}
    response = http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert decode(choice["routed_experts"]).shape[0] >= MAX_TOKENS
    chunks = []
    body = {"model": MODEL_NAME, "prompt": PROMPT, **GREEDY, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += json.loads(line[len("data: ") :])["choices"]
    assert [c["routed_experts"] is not None for c in chunks] == [c["finish_reason"] is not None for c in chunks]
    np.testing.assert_array_equal(decode(chunks[-1]["routed_experts"]), decode(completion(http)["routed_experts"]))


def test_skyrl_generate_packs_routed_experts(http) -> None:
    """SkyRL a9564572's RemoteInferenceClient._generate_single with enable_return_routed_experts: POST
    /skyrl/v1/generate {sampling_params, model, token_ids}; it reads choices[0].token_ids, finish_reason,
    logprobs.content[].logprob, and decodes routed_experts as generate_wire.decode_packed_routed_experts does (a
    dict; base64 of the raw array in its canonical dtype: uint8 below 256 experts; shape [tokens, layers, top_k])."""
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    payload = {"sampling_params": sampling, "model": MODEL_NAME, "token_ids": PROMPT}
    response = http.post("/skyrl/v1/generate", json=payload, headers={"X-Session-ID": "episode-1"})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert len(choice["token_ids"]) == MAX_TOKENS and choice["finish_reason"] == "length"
    assert len([entry["logprob"] for entry in choice["logprobs"]["content"]]) == MAX_TOKENS
    packed = choice["routed_experts"]
    assert isinstance(packed, dict) and packed["dtype"] == "uint8"
    shape = tuple(packed["shape"])
    experts = np.frombuffer(base64.b64decode(packed["data"], validate=True), dtype=packed["dtype"]).reshape(shape)
    reference = completion(http)  # rlserve's own field for the same greedy request
    assert choice["token_ids"] == reference["token_ids"]
    np.testing.assert_array_equal(experts, decode(reference["routed_experts"]))
