"""rlserve's responses validate under the response models of every vLLM release an RL framework pins: 0.23.0 (`skyrl`
0.3.0), 0.24.0 (`verl` 0.9.1), 0.31.0 (the top of `trl` 1.16.0's range) and 0.33.0 (the API rlserve follows).

The models are vLLM's own pydantic classes, built from each release's wheel on the package index by
tests/server/vllm_release_protocol.py: only the protocol files, read by HTTP range requests out of the wheel and kept
in ~/.cache/rlserve/vllm-wheel, and from them only the response classes and what they reference, run as vLLM wrote
them. Why that and not `pip install vllm==X`: the package needs torch's CUDA build and vLLM's compiled extension to
import, and the four wheels are 1.2 GB; why not import shims: a stand-in for what the classes reference would be our
code, not vLLM's. Without the index (and no cache) the tests skip, saying so.

Every response is validated from its JSON text as a client of that release parses it (`model_validate_json`, pydantic's
lax mode: strict mode would refuse vLLM's own answers, whose integer-keyed dicts are JSON strings): a required field
rlserve drops, or a field it sends with another type than that release declares (null for a list, a string for a
span), fails the test; rlserve's additions pass where vLLM's models allow extra fields.
"""

from __future__ import annotations

import json
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter, ValidationError
from server_helpers import MODEL_NAME, Server
from vllm_release_protocol import ReleaseFiles, ReleaseProtocol

RELEASES = ("0.23.0", "0.24.0", "0.31.0", "0.33.0")
COMPLETION = "vllm.entrypoints.openai.completion.protocol"
CHAT = "vllm.entrypoints.openai.chat_completion.protocol"
TOKENIZE = "vllm.entrypoints.serve.tokenize.protocol"
# Where ErrorResponse / ModelList and the token-in generate route's models live: moved in 0.31.
ENGINE = {"0.23.0": "vllm.entrypoints.openai.engine.protocol", "0.24.0": "vllm.entrypoints.openai.engine.protocol"}
GENERATE = {"0.23.0": "vllm.entrypoints.serve.disagg.protocol", "0.24.0": "vllm.entrypoints.serve.disagg.protocol"}
ENGINE_SINCE_0_31 = "vllm.entrypoints.serve.engine.protocol"
GENERATE_SINCE_0_31 = "vllm.entrypoints.scale_out.token_in_token_out.protocol"


def response_models(release: str) -> dict[str, tuple[str, str]]:
    """Each response kind -> (vLLM module, model name) in `release`."""
    engine, generate = ENGINE.get(release, ENGINE_SINCE_0_31), GENERATE.get(release, GENERATE_SINCE_0_31)
    return {
        "completion": (COMPLETION, "CompletionResponse"),
        "completion chunk": (COMPLETION, "CompletionStreamResponse"),
        "chat": (CHAT, "ChatCompletionResponse"),
        "chat chunk": (CHAT, "ChatCompletionStreamResponse"),
        "generate": (generate, "GenerateResponse"),
        "generate chunk": (generate, "GenerateStreamResponse"),
        "tokenize": (TOKENIZE, "TokenizeResponse"),
        "detokenize": (TOKENIZE, "DetokenizeResponse"),
        "models": (engine, "ModelList"),
        "error": (engine, "ErrorResponse"),
    }


def release_schemas(protocol: ReleaseProtocol) -> dict[str, TypeAdapter]:
    release = protocol.files.version
    return {kind: TypeAdapter(protocol.get(module, name)) for kind, (module, name) in response_models(release).items()}


@pytest.fixture(scope="module")
def schemas() -> Iterator[dict[str, dict[str, TypeAdapter]]]:
    """release -> response kind -> a validator of vLLM's model, loaded once per test run (the files cached on disk).
    One release after another: CPython 3.11's ast.parse is not safe in threads side by side ("AST constructor
    recursion depth mismatch", seen in CI)."""
    protocols = [ReleaseProtocol(ReleaseFiles(release)) for release in RELEASES]
    try:
        try:
            loaded = dict(zip(RELEASES, map(release_schemas, protocols), strict=True))
        except (urllib.error.URLError, TimeoutError) as error:
            pytest.skip(f"vLLM's wheels are not reachable on the package index ({error}) and not in the cache")
        yield loaded
    finally:
        for protocol in protocols:
            protocol.close()


@dataclass
class Responses:
    """Real responses of the shared server, as JSON text, by kind."""

    bodies: dict[str, list[str]] = field(default_factory=dict)

    def add(self, kind: str, text: str) -> None:
        self.bodies.setdefault(kind, []).append(text)

    def add_stream(self, kind: str, response: httpx.Response) -> None:
        assert response.status_code == 200, response.text
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 2, events
        for event in events[:-1]:
            self.add(kind, event)


def _post(http: httpx.Client, path: str, body: dict[str, Any], status: int = 200) -> str:
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    return response.text


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def responses(server: Server, reasoning_server: Server) -> Responses:
    """Each route's answers with the fields the frameworks ask for: logprobs and their top candidates, prompt
    logprobs, token ids, vLLM's weight-version spans and rlserve's per-token versions, streamed and not; and chat's
    reasoning and tool calls (conftest's `reasoning_server`, whose model writes a thought and a call)."""
    collected = Responses()
    versions = {"return_weight_versions": True, "return_token_weight_versions": True}
    completion = {"model": MODEL_NAME, "prompt": "1+2=", "max_tokens": 4, "logprobs": 2, "echo": True}
    completion |= {"prompt_logprobs": 1, "return_token_ids": True, "ignore_eos": True, **versions}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat |= {"logprobs": True, "top_logprobs": 2, "return_token_ids": True, "ignore_eos": True, **versions}
    generate = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "logprobs": 2, "ignore_eos": True}}
    generate |= {"return_token_ids": True, "return_token_weight_versions": True}
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    with server.client() as http:
        collected.add("completion", _post(http, "/v1/completions", completion))
        collected.add("completion", _post(http, "/v1/completions", {**completion, "n": 2, "echo": False}))
        collected.add_stream("completion chunk", http.post("/v1/completions", json={**completion, **streamed}))
        collected.add("chat", _post(http, "/v1/chat/completions", chat))
        collected.add_stream("chat chunk", http.post("/v1/chat/completions", json={**chat, **streamed}))
        collected.add("generate", _post(http, "/inference/v1/generate", generate))
        collected.add_stream("generate chunk", http.post("/inference/v1/generate", json={**generate, **streamed}))
        collected.add("tokenize", _post(http, "/tokenize", {"model": MODEL_NAME, "prompt": "1+2="}))
        collected.add("tokenize", _post(http, "/tokenize", {"model": MODEL_NAME, "messages": chat["messages"]}))
        collected.add("detokenize", _post(http, "/detokenize", {"model": MODEL_NAME, "tokens": [49, 43, 50]}))
        models = http.get("/v1/models")
        assert models.status_code == 200
        collected.add("models", models.text)
        collected.add("error", _post(http, "/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404))
        collected.add("error", _post(http, "/v1/completions", {**completion, "max_tokens": -1}, 400))
        collected.add("error", _post(http, "/inference/v1/generate", {"token_ids": []}, 400))
    tool_chat = {"model": MODEL_NAME, "messages": chat["messages"], "tools": TOOLS, "max_tokens": 40}
    with reasoning_server.client() as http:
        answer = _post(http, "/v1/chat/completions", tool_chat)
        assert json.loads(answer)["choices"][0]["message"]["tool_calls"], answer  # the shapes under test are there
        collected.add("chat", answer)
        stream = http.post("/v1/chat/completions", json={**tool_chat, "stream": True})
        assert '"tool_calls":[{' in stream.text and '"reasoning":"' in stream.text, stream.text
        collected.add_stream("chat chunk", stream)
    return collected


def validation_failures(schema: TypeAdapter, bodies: list[str]) -> list[str]:
    failures = []
    for body in bodies:
        try:
            schema.validate_json(body)
        except ValidationError as error:
            failures.append(f"{error}\n  in {body[:400]}")
    return failures


@pytest.mark.parametrize("release", RELEASES)
def test_every_response_validates_under_the_releases_models(
    release: str, schemas: dict[str, dict[str, TypeAdapter]], responses: Responses
) -> None:
    assert set(responses.bodies) == set(response_models(release))
    failures = {
        kind: found
        for kind, bodies in responses.bodies.items()
        if (found := validation_failures(schemas[release][kind], bodies))
    }
    assert not failures, f"vLLM {release}'s models refuse rlserve's responses:\n" + "\n".join(
        f"[{kind}] {message}" for kind, messages in failures.items() for message in messages
    )


@pytest.mark.parametrize("release", RELEASES)
def test_a_dropped_or_mistyped_field_fails_the_releases_models(
    release: str, schemas: dict[str, dict[str, TypeAdapter]], responses: Responses
) -> None:
    """The check can fail: rlserve's real completion, less a field every release requires, or with a field's type
    changed, is refused."""
    completion = json.loads(responses.bodies["completion"][0])
    dropped = {**completion, "choices": [{k: v for k, v in completion["choices"][0].items() if k != "index"}]}
    assert validation_failures(schemas[release]["completion"], [json.dumps(dropped)])
    mistyped = {**completion, "usage": {**completion["usage"], "prompt_tokens": "four"}}
    assert validation_failures(schemas[release]["completion"], [json.dumps(mistyped)])
    # weight_versions as per-token strings (rlserve's old form): refused where the release has vLLM's spans.
    choice = completion["choices"][0]
    per_token = {**completion, "choices": [{**choice, "weight_versions": ["v1"] * len(choice["token_ids"])}]}
    assert bool(validation_failures(schemas[release]["completion"], [json.dumps(per_token)])) == (release == "0.33.0")
    chat_chunk = json.loads(responses.bodies["chat chunk"][0])
    assert validation_failures(schemas[release]["chat chunk"], [json.dumps({**chat_chunk, "choices": None})])
