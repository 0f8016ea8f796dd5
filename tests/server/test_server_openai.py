"""The OpenAI-compatible routes against a real server: the `openai` client, response shapes, sampling options."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
from server_helpers import MODEL_NAME, Server, Stream, read_stream

from rlserve.rl.client import RLServeClient

PROMPT = "The quick brown fox jumps over"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def oai(server: Server) -> openai.OpenAI:
    return server.openai()


def complete(server: Server, **body) -> dict:
    with server.client() as http:
        response = http.post("/v1/completions", json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_openai_client_streams_chat(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    chunks = list(
        oai.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True, "return_token_weight_versions": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content is not None]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    versions = [v for c in content for v in (c.choices[0].model_extra.get("token_weight_versions") or [])]
    assert len(versions) == 8 and set(versions) == {"default"}

    streamed_ids = [t for c in content for t in (c.choices[0].model_extra.get("token_ids") or [])]
    full = oai.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert full.choices[0].model_extra["token_ids"] == streamed_ids
    # Streams hold back a trailing incomplete UTF-8 character; the final text may show it as U+FFFD.
    assert full.choices[0].message.content.startswith("".join(c.choices[0].delta.content for c in content))
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8


def test_openai_client_streams_completion_with_logprobs(oai: openai.OpenAI) -> None:
    stream = oai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, logprobs=3, stream=True, temperature=0.0
    )
    tokens, token_logprobs, offsets, text = [], [], [], ""
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            token_logprobs += choice.logprobs.token_logprobs
            offsets += choice.logprobs.text_offset
            for top in choice.logprobs.top_logprobs:
                assert 1 <= len(top) <= 4  # top 3 plus the sampled token when it ranks lower
    full = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, logprobs=3, temperature=0.0)
    lp = full.choices[0].logprobs
    assert len(tokens) == 8 and tokens == lp.tokens
    assert token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert offsets == lp.text_offset and offsets == sorted(offsets) and offsets[0] == 0
    assert all(v <= 0 for v in token_logprobs)
    assert full.choices[0].text.startswith(text)  # a trailing incomplete character shows only in the final text


def test_chat_logprobs_shape(server: Server) -> None:
    with server.client() as http:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}
        response = http.post("/v1/chat/completions", json={**body, **GREEDY, "logprobs": True, "top_logprobs": 3})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 5
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert isinstance(item["bytes"], list) and all(isinstance(b, int) for b in item["bytes"])
        tops = [t["logprob"] for t in item["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item["logprob"] <= tops[0] + 1e-6  # greedy picks the best: it is the top entry
        assert item["logprob"] == pytest.approx(tops[0], abs=1e-5)


def test_n2_and_seed_reproducibility(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "n": 2, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    first = complete(server, **body, return_token_ids=True)
    second = complete(server, **body, return_token_ids=True)
    assert [c["index"] for c in first["choices"]] == [0, 1]
    assert all(len(c["token_ids"]) == 12 and c["finish_reason"] == "length" for c in first["choices"])
    assert [c["token_ids"] for c in first["choices"]] == [c["token_ids"] for c in second["choices"]]
    assert first["usage"]["completion_tokens"] == 24


def test_batch_and_token_id_prompts(server: Server) -> None:
    out = complete(server, prompt=[PROMPT, "a second prompt"], max_tokens=6, n=2, return_token_ids=True, **GREEDY)
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["prompt_token_ids"] == choices[1]["prompt_token_ids"] != choices[2]["prompt_token_ids"]
    assert all(len(c["token_ids"]) == 6 for c in choices) and out["usage"]["completion_tokens"] == 24
    ids = choices[0]["prompt_token_ids"]
    assert out["usage"]["prompt_tokens"] == len(ids) + len(choices[2]["prompt_token_ids"])
    # Same prompt, greedy: the string and the token-id forms give the same tokens.
    for prompt in (ids, [ids]):
        by_ids = complete(server, prompt=prompt, max_tokens=6, return_token_ids=True, **GREEDY)["choices"]
        assert [c["token_ids"] for c in by_ids] == [choices[0]["token_ids"]]


def test_stop_strings_and_stop_token_ids(server: Server) -> None:
    base = complete(server, prompt=PROMPT, max_tokens=24, return_token_ids=True, **GREEDY)["choices"][0]
    text, token_ids = base["text"], base["token_ids"]
    stop = next(c for c in text[1:] if c.isascii() and c.isprintable())
    cut = text.index(stop)
    out = complete(server, prompt=PROMPT, max_tokens=24, stop=[stop], **GREEDY)["choices"][0]
    assert (out["text"], out["finish_reason"], out["stop_reason"]) == (text[:cut], "stop", stop)
    out = complete(server, prompt=PROMPT, max_tokens=24, stop=stop, include_stop_str_in_output=True, **GREEDY)
    assert out["choices"][0]["text"] == text[: cut + 1]

    stop_id = token_ids[3]
    out = complete(server, prompt=PROMPT, max_tokens=24, stop_token_ids=[stop_id], return_token_ids=True, **GREEDY)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert choice["token_ids"] == token_ids[: token_ids.index(stop_id) + 1]


def test_prompt_logprobs_and_token_ids_as_tokens(server: Server) -> None:
    out = complete(server, prompt=PROMPT, max_tokens=4, logprobs=2, prompt_logprobs=2, return_token_ids=True, **GREEDY)
    choice = out["choices"][0]
    prompt_ids, plp = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(plp) == len(prompt_ids) == out["usage"]["prompt_tokens"] and plp[0] is None
    for token_id, entry in zip(prompt_ids[1:], plp[1:], strict=True):
        assert str(token_id) in entry and 1 <= len(entry) <= 3
        actual = entry[str(token_id)]
        assert actual["logprob"] <= 0 and actual["rank"] >= 1 and isinstance(actual["decoded_token"], str)

    as_ids = complete(
        server,
        prompt=PROMPT,
        max_tokens=4,
        logprobs=2,
        prompt_logprobs=1,
        return_token_ids=True,
        return_tokens_as_token_ids=True,
        **GREEDY,
    )["choices"][0]
    assert as_ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in as_ids["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in as_ids["logprobs"]["top_logprobs"] for k in top)
    assert all(v["decoded_token"].startswith("token_id:") for e in as_ids["prompt_logprobs"][1:] for v in e.values())


def test_stream_prompt_logprobs_and_usage(server: Server) -> None:
    async def go() -> Stream:
        async with server.async_client() as http:
            body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5, "prompt_logprobs": 1, **GREEDY}
            return await read_stream(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})

    stream = asyncio.run(go())
    assert stream.done_markers == 1 and not stream.errors
    assert stream.only.num_tokens == 5 and stream.only.finish_reasons == ["length"]
    assert stream.usage["completion_tokens"] == 5 and "cached_tokens" in stream.usage["prompt_tokens_details"]


def test_models_health_version_metrics(server: Server) -> None:
    with server.client() as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        models = http.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
        complete(server, prompt="metrics", max_tokens=3, **GREEDY)
        text = http.get("/metrics").text
    # Every series is checked in test_metrics.py; here, that the request was counted as it finished.
    assert re.search(
        r'vllm:request_success_total\{engine="0",finished_reason="length",model_name="toy"\} [1-9]', text
    ), text


def _running(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    running = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    waiting = re.search(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M)
    return float(running.group(1)) + float(waiting.group(1))


def test_client_disconnect_aborts_its_request(server: Server) -> None:
    with server.client() as http:
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 900, "stream": True, **GREEDY}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data: "))
            assert _running(http) == 1
        # The connection is closed with ~900 tokens to go: the engine must drop the request.
        deadline = time.monotonic() + 10
        while _running(http) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(http) == 0


def test_abort_requests_route(server: Server, rl: RLServeClient) -> None:
    async def go() -> tuple[Stream, int]:
        stream = Stream()
        async with server.async_client() as http:
            body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 900, **GREEDY}
            task = asyncio.create_task(read_stream(http, "/v1/completions", body, into=stream))
            deadline = time.monotonic() + 30
            while stream.tokens_so_far < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            aborted = await asyncio.to_thread(rl.abort_requests)
            await asyncio.wait_for(task, 10)
        return stream, aborted

    stream, aborted = asyncio.run(go())
    assert aborted == 1
    assert stream.only.finish_reasons == ["abort"] and 2 <= stream.only.num_tokens < 900
