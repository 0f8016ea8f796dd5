"""Every request field of the OpenAI routes and /inference/v1/generate against a real server: each one either changes
the output in a way a test here (or in the file named) checks, or is refused by name (`REFUSED_FIELDS`, `_ONLY_OFF`).
`test_every_field_has_an_effect_or_is_refused` walks the request models, so a field added without either fails.

The server's tokenizer adds a BOS (so add_special_tokens shows), and it serves tools as PipelineRL runs vLLM:
`--return-tokens-as-token-ids --enable-auto-tool-choice --tool-call-parser hermes`, with the toy ChatML template's
Hermes-style tools.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import _serve
from server_helpers import API_KEY, BLOCK_SIZE, MODEL_NAME, Server, Stream, read_stream

from rlserve.server.chat_requests import ChatCompletionRequest
from rlserve.server.generate_protocol import GenerateRequest
from rlserve.server.openai_requests import CompletionRequest
from rlserve.server.refused_fields import _ONLY_OFF, REFUSED_FIELDS
from rlserve.server.tool_parsers import StreamingToolCalls, parse_hermes
from rlserve.toy import make_model_dir, make_tokenizer

TESTS = Path(__file__).parent
GREEDY = {"temperature": 0.0, "ignore_eos": True}
BOS = make_tokenizer(add_bos=True).bos_token_id
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def fields_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = make_model_dir(tmp_path_factory.mktemp("fields-model") / "toy", initializer_range=0.2)
    make_tokenizer(add_bos=True).save_pretrained(model_dir)
    log = tmp_path_factory.mktemp("server-logs") / "fields.log"
    # --trust-request-chat-template: the chat_template field's tests send templates of their own.
    args = (
        "--enable-rl-api",
        "--return-tokens-as-token-ids",
        "--enable-auto-tool-choice",
        "--trust-request-chat-template",
    )
    yield from _serve(model_dir, log, *args, "--tool-call-parser", "hermes", api_key=API_KEY)


@pytest.fixture
def http(fields_server: Server) -> Iterator[httpx.Client]:
    with fields_server.client() as client:
        yield client


@pytest.fixture
def oai(fields_server: Server) -> openai.OpenAI:
    return fields_server.openai()


def post(http: httpx.Client, path: str, **body: Any) -> dict:
    response = http.post(path, json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


def complete(http: httpx.Client, **body: Any) -> dict:
    return post(http, "/v1/completions", **{"max_tokens": 4, **GREEDY, **body})


def chat(http: httpx.Client, messages: list[dict], **body: Any) -> dict:
    return post(http, "/v1/chat/completions", messages=messages, **{"max_tokens": 4, **GREEDY, **body})


def render(http: httpx.Client, messages: list[dict], **body: Any) -> dict:
    return post(http, "/v1/chat/completions/render", messages=messages, **body)


USER = [{"role": "user", "content": "Tell me a story"}]


# ---- fields with an effect ----


def test_truncate_prompt_tokens_keeps_the_last_tokens(http: httpx.Client) -> None:
    full = complete(http, prompt="abcdefghij", return_token_ids=True)["choices"][0]["prompt_token_ids"]
    assert full[0] == BOS and len(full) == 11
    kept = complete(http, prompt="abcdefghij", truncate_prompt_tokens=4, return_token_ids=True)
    assert kept["usage"]["prompt_tokens"] == 4 and kept["choices"][0]["prompt_token_ids"] == full[-4:]
    first = complete(
        http, prompt="abcdefghij", truncate_prompt_tokens=4, truncation_side="right", return_token_ids=True
    )
    assert first["choices"][0]["prompt_token_ids"] == full[:4]
    assert complete(http, prompt="abcdefghij", truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == 11
    assert complete(http, prompt=full, truncate_prompt_tokens=3)["usage"]["prompt_tokens"] == 3  # token prompts too
    rendered = render(http, USER, truncate_prompt_tokens=5)
    assert len(rendered["token_ids"]) == 5 and chat(http, USER, truncate_prompt_tokens=5)["usage"]["prompt_tokens"] == 5
    too_long = http.post("/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": 10**6})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "truncate_prompt_tokens"


def test_add_special_tokens(http: httpx.Client) -> None:
    # Completions add the tokenizer's BOS by default (vLLM's), chat does not (its template places special tokens).
    with_bos = complete(http, prompt="abc", return_token_ids=True)["choices"][0]["prompt_token_ids"]
    without = complete(http, prompt="abc", add_special_tokens=False, return_token_ids=True)
    assert with_bos[0] == BOS and with_bos[1:] == without["choices"][0]["prompt_token_ids"]
    assert without["usage"]["prompt_tokens"] == 3
    chat_ids = render(http, USER)["token_ids"]
    assert chat_ids[0] != BOS and render(http, USER, add_special_tokens=True)["token_ids"] == [BOS, *chat_ids]
    assert chat(http, USER, add_special_tokens=True)["usage"]["prompt_tokens"] == len(chat_ids) + 1


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_request_id_names_the_request_for_abort(fields_server: Server, route: str) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 900, "request_id": f"mine{route}", **GREEDY}
    body |= {"prompt": "Once"} if route == "/v1/completions" else {"messages": USER}

    async def go() -> tuple[Stream, httpx.Response, dict]:
        stream = Stream()
        async with fields_server.async_client() as http:
            task = asyncio.create_task(read_stream(http, route, body, into=stream))
            deadline = time.monotonic() + 30
            while stream.tokens_so_far < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            duplicate = await http.post(route, json=body)
            aborted = (await http.post("/abort_requests", json={"request_ids": [body["request_id"]]})).json()
            await asyncio.wait_for(task, 10)
        return stream, duplicate, aborted

    stream, duplicate, aborted = asyncio.run(go())
    assert duplicate.status_code == 409 and duplicate.json()["error"]["param"] == "request_id"
    assert aborted["aborted"] == 1
    assert stream.only.finish_reasons == ["abort"] and 2 <= stream.only.num_tokens < 900


def test_request_id_is_the_response_id(http: httpx.Client) -> None:
    assert complete(http, prompt="x", request_id="abc")["id"] == "cmpl-abc"  # vLLM's
    assert chat(http, USER, request_id="abc")["id"] == "chatcmpl-abc"


def test_continue_final_message_and_echo(http: httpx.Client) -> None:
    prefill = [*USER, {"role": "assistant", "content": "Once upon"}]
    rendered = render(http, prefill, continue_final_message=True, add_generation_prompt=False)
    assert rendered["prompt"].endswith("<|im_start|>assistant\nOnce upon")
    # Continuing implies no generation prompt; asking for both is vLLM's error.
    assert render(http, prefill, continue_final_message=True)["prompt"] == rendered["prompt"]
    both = http.post(
        "/v1/chat/completions",
        json={"messages": prefill, "continue_final_message": True, "add_generation_prompt": True},
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"

    continued = chat(http, prefill, continue_final_message=True, max_tokens=6)
    assert continued["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    reply = continued["choices"][0]["message"]["content"]
    echoed = chat(http, prefill, continue_final_message=True, max_tokens=6, echo=True)
    assert echoed["choices"][0]["message"]["content"] == "Once upon" + reply
    # The last message is the user's, the reply the assistant's: nothing to echo (vLLM's rule).
    plain = chat(http, USER)["choices"][0]["message"]["content"]
    assert chat(http, USER, echo=True)["choices"][0]["message"]["content"] == plain

    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": prefill, "continue_final_message": True, "max_tokens": 6, "echo": True, "stream": True}
        | GREEDY,
    ) as response:
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in response.iter_lines()
            if line.startswith("data: {")
        ]
    assert deltas[1] == "Once upon" and "".join(deltas) == "Once upon" + reply


def test_chat_template_kwargs_and_documents(http: httpx.Client) -> None:
    template = (
        "{{ greeting }} {{ messages[-1]['content'] }}{% for d in documents or [] %} [{{ d['title'] }}]{% endfor %}"
    )
    body = {"chat_template": template, "chat_template_kwargs": {"greeting": "Hi"}}
    assert render(http, USER, **body)["prompt"] == "Hi Tell me a story"
    documents = [{"title": "Doc", "text": "..."}]
    assert render(http, USER, **body, documents=documents)["prompt"] == "Hi Tell me a story [Doc]"
    assert chat(http, USER, **body)["usage"]["prompt_tokens"] == len("Hi Tell me a story")
    clash = http.post("/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": {"tools": []}})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "chat_template_kwargs"
    broken = http.post("/v1/chat/completions", json={"messages": USER, "chat_template": "{% if %}"})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_cache_salt_separates_prefix_cache_hits(http: httpx.Client, route: str) -> None:
    text = f"A prompt long enough to fill several cache blocks, for {route}, and then some more."
    body = {"prompt": text} if route == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}

    def cached(salt: str) -> int:
        out = post(http, route, **body, cache_salt=salt, max_tokens=1, **GREEDY)
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached("salt-a")
    assert cached("salt-a") >= 2 * BLOCK_SIZE
    assert cached("salt-b") == 0
    empty = http.post(route, json={**body, "cache_salt": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"


def test_weight_versions_only_on_request(http: httpx.Client) -> None:
    """vLLM's spans with return_weight_versions, rlserve's per-token list with return_token_weight_versions, and
    neither unasked (vLLM 0.33's default: its schema has no per-token strings)."""
    unasked = complete(http, prompt="x", max_tokens=5)["choices"][0]
    assert unasked["weight_versions"] is None and unasked["token_weight_versions"] is None
    per_token = complete(http, prompt="x", max_tokens=5, return_token_weight_versions=True)["choices"][0]
    assert per_token["weight_versions"] is None and len(per_token["token_weight_versions"]) == 5
    version = per_token["token_weight_versions"][0]
    spans = complete(http, prompt="x", max_tokens=5, return_weight_versions=True)["choices"][0]
    assert spans["weight_versions"] == [{"version": version, "start": 0, "end": 5}]  # vLLM's
    assert spans["token_weight_versions"] is None
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 5, "return_weight_versions": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body | GREEDY) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    carrying = [c["choices"][0] for c in chunks if c["choices"][0].get("weight_versions")]
    assert len(carrying) == 1 and carrying[0]["finish_reason"] == "length"
    assert carrying[0]["weight_versions"] == [{"version": version, "start": 0, "end": 5}]


def test_sampling_fields_reach_the_engine(http: httpx.Client) -> None:
    """Fields whose effect on sampling the engine tests check: here, that each reaches the engine's SamplingParams
    (what /render shows is what /inference/v1/generate would run)."""
    fields = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.1,
        "seed": 3,
        "n": 2,
        "min_tokens": 2,
        "stop": ["zz"],
        "stop_token_ids": [5],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "prompt_logprobs": 1,
    }
    (rendered,) = post(http, "/v1/completions/render", prompt="x", max_tokens=3, logprobs=2, **fields)
    assert {k: rendered["sampling_params"][k] for k in fields} == fields
    assert rendered["sampling_params"]["max_tokens"] == 3 and rendered["sampling_params"]["logprobs"] == 2
    rendered = render(http, USER, max_completion_tokens=4, logprobs=True, top_logprobs=3, **fields)
    assert {k: rendered["sampling_params"][k] for k in fields} == fields
    assert rendered["sampling_params"]["max_tokens"] == 4 and rendered["sampling_params"]["logprobs"] == 3
    assert not render(http, USER, add_generation_prompt=False)["prompt"].endswith("<|im_start|>assistant\n")
    assert render(http, USER)["prompt"].endswith("<|im_start|>assistant\n")


# ---- tools ----


def test_hermes_parser() -> None:
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = parse_hermes(text + '<tool_call>{"name": "f", "arguments": {}}</tool_call> ok')
    assert parsed.content == "Let me check. ok"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("f", {}),
    ]
    assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in parsed.tool_calls)
    assert parse_hermes("no calls").tool_calls == []
    assert parse_hermes("<tool_call>{not json</tool_call>").content == "<tool_call>{not json</tool_call>"
    # Streamed in pieces that cut the tag: the text before it comes as it is generated, the call at the end.
    stream = StreamingToolCalls()
    sent = "".join(stream.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    end = stream.finish()
    assert sent == "Let me check." and end.content == "" and end.tool_calls[0].function.name == "get_weather"


def test_pipelinerl_chat_with_tools_and_token_ids(http: httpx.Client, oai: openai.OpenAI) -> None:
    """PipelineRL's call: chat with logprobs 1, tools, and tokens as `token_id:N` (set server-wide)."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    rendered = render(http, messages, tools=TOOLS)
    assert '"name": "get_weather"' in rendered["prompt"] and rendered["prompt"].startswith("<|im_start|>system")
    assert render(http, messages)["prompt"].startswith("<|im_start|>user")

    response = oai.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, logprobs=True, top_logprobs=1, max_tokens=6, temperature=0
    )
    choice = response.choices[0]
    tokens = [entry.token for entry in choice.logprobs.content]
    assert len(tokens) == 6 and all(re.fullmatch(r"token_id:\d+", t) for t in tokens)
    assert response.usage.prompt_tokens == len(rendered["token_ids"])
    # The random toy model calls no tool: its text is the content, and the turn ends as the engine ended it.
    assert choice.finish_reason == "length" and not choice.message.tool_calls

    # An assistant's call and the tool's answer go back through the template, arguments as an object.
    call = {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}]
    turns.append({"role": "tool", "content": "sunny", "tool_call_id": "call-1"})
    prompt = render(http, turns, tools=TOOLS)["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\nsunny" in prompt


def test_tool_choice(http: httpx.Client, oai: openai.OpenAI) -> None:
    def refused(**body: Any) -> str:
        response = http.post("/v1/chat/completions", json={"messages": USER, **body})
        assert response.status_code == 400, response.text
        return response.json()["error"]["param"]

    assert refused(tools=TOOLS, tool_choice="required") == "tool_choice"
    assert refused(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}) == "tool_choice"
    assert refused(tool_choice="auto") == "tool_choice"
    assert refused(tools=[]) == "tools"
    # tool_choice none: the template still gets the tools, the output is not parsed.
    out = chat(http, USER, tools=TOOLS, tool_choice="none")
    assert out["choices"][0]["message"]["tool_calls"] == []
    assert out["usage"]["prompt_tokens"] == len(render(http, USER, tools=TOOLS)["token_ids"])


def test_auto_tool_choice_needs_the_server_flag(plain_server: Server) -> None:
    with plain_server.client() as http:
        response = http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in response.json()["error"]["message"]


# ---- refused and unknown fields ----


def test_refused_and_unknown_fields_are_bad_requests(oai: openai.OpenAI, http: httpx.Client) -> None:
    for name in [*REFUSED_FIELDS, "frobnicate"]:
        for model, create, base in (
            (CompletionRequest, oai.completions.create, {"prompt": "x"}),
            (ChatCompletionRequest, oai.chat.completions.create, {"messages": USER}),
        ):
            if name in model.model_fields:
                continue  # implemented by this route (chat's echo)
            with pytest.raises(openai.BadRequestError) as error:
                create(model=MODEL_NAME, **base, extra_body={name: "on"})
            assert name in error.value.message and error.value.body["param"] == name
    # "Off" values ask for nothing: accepted.
    off = {"priority": 0, "response_format": {"type": "text"}, "parallel_tool_calls": True, "stream_interval": 1}
    assert complete(http, prompt="x", **{k: v for k, v in off.items() if k != "parallel_tool_calls"})["choices"]
    assert chat(http, USER, **off)["choices"]
    for name, value in (("response_format", {"type": "json_object"}), ("priority", 1), ("use_beam_search", True)):
        with pytest.raises(openai.BadRequestError, match=name):
            oai.chat.completions.create(model=MODEL_NAME, messages=USER, extra_body={name: value})
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.completions.create(model=MODEL_NAME, prompt="x", extra_body={"max_tokens": "many"})  # not a 422
    generate = http.post("/inference/v1/generate", json={"token_ids": [1], "priority": 1})
    assert generate.status_code == 400 and generate.json()["error"]["param"] == "priority"


# Each field with an effect -> the test that checks it ("file::test", or a test of this file).
FIELD_TESTS: dict[str, str] = {
    "routed_experts_prompt_start": "test_server_moe.py::test_routed_experts_over_http",
    "model": "test_server_errors.py::send_bad_inputs",
    "prompt": "test_server_openai.py::test_batch_and_token_id_prompts",
    "messages": "test_pipelinerl_chat_with_tools_and_token_ids",
    "max_tokens": "test_sampling_fields_reach_the_engine",
    "max_completion_tokens": "test_sampling_fields_reach_the_engine",
    "temperature": "test_sampling_fields_reach_the_engine",
    "top_p": "test_sampling_fields_reach_the_engine",
    "top_k": "test_sampling_fields_reach_the_engine",
    "min_p": "test_sampling_fields_reach_the_engine",
    "repetition_penalty": "test_server_sampling_fields.py::test_penalty_bias_and_allowed_tokens_change_the_samples",
    "presence_penalty": "test_server_sampling_fields.py::test_penalty_bias_and_allowed_tokens_change_the_samples",
    "frequency_penalty": "test_server_sampling_fields.py::test_penalty_bias_and_allowed_tokens_change_the_samples",
    "logit_bias": "test_server_sampling_fields.py::test_penalty_bias_and_allowed_tokens_change_the_samples",
    "allowed_token_ids": "test_server_sampling_fields.py::test_penalty_bias_and_allowed_tokens_change_the_samples",
    "bad_words": "test_server_sampling_fields.py::test_a_bad_word_never_appears",
    "n": "test_server_openai.py::test_n2_and_seed_reproducibility",
    "seed": "test_server_openai.py::test_n2_and_seed_reproducibility",
    "stop": "test_server_openai.py::test_stop_strings_and_stop_token_ids",
    "stop_token_ids": "test_server_openai.py::test_stop_strings_and_stop_token_ids",
    "include_stop_str_in_output": "test_server_openai.py::test_stop_strings_and_stop_token_ids",
    "ignore_eos": "test_sampling_fields_reach_the_engine",
    "min_tokens": "test_sampling_fields_reach_the_engine",
    "skip_special_tokens": "test_sampling_fields_reach_the_engine",
    "stream": "test_server_openai.py::test_openai_client_streams_chat",
    "stream_options": "test_server_openai.py::test_stream_prompt_logprobs_and_usage",
    "logprobs": "test_server_openai.py::test_openai_client_streams_completion_with_logprobs",
    "top_logprobs": "test_server_openai.py::test_chat_logprobs_shape",
    "prompt_logprobs": "test_server_openai.py::test_prompt_logprobs_and_token_ids_as_tokens",
    "return_tokens_as_token_ids": "test_server_openai.py::test_prompt_logprobs_and_token_ids_as_tokens",
    "return_token_ids": "test_server_openai.py::test_batch_and_token_id_prompts",
    "truncate_prompt_tokens": "test_truncate_prompt_tokens_keeps_the_last_tokens",
    "truncation_side": "test_truncate_prompt_tokens_keeps_the_last_tokens",
    "add_special_tokens": "test_add_special_tokens",
    "request_id": "test_request_id_names_the_request_for_abort",
    "cache_salt": "test_cache_salt_separates_prefix_cache_hits",
    "return_weight_versions": "test_weight_versions_only_on_request",
    "return_token_weight_versions": "test_weight_versions_only_on_request",
    "add_generation_prompt": "test_sampling_fields_reach_the_engine",
    "continue_final_message": "test_continue_final_message_and_echo",
    # chat's echo; completions' in test_server_vllm_routes.py::test_pipelinerl_scores_with_echo_and_max_tokens_0
    "echo": "test_continue_final_message_and_echo",
    "chat_template": "test_chat_template_kwargs_and_documents",
    "chat_template_kwargs": "test_chat_template_kwargs_and_documents",
    "documents": "test_chat_template_kwargs_and_documents",
    "tools": "test_pipelinerl_chat_with_tools_and_token_ids",
    "tool_choice": "test_tool_choice",
    "include_reasoning": "test_server_reasoning.py::test_include_reasoning_false_drops_the_reasoning_and_its_traces",
    "reasoning_effort": "test_server_reasoning.py::test_enable_thinking_and_reasoning_effort",
    # /inference/v1/generate
    "token_ids": "test_server_vllm_routes.py::test_generate_streams_and_refuses_bad_fields",
    "sampling_params": "test_server_vllm_routes.py::test_generate_streams_and_refuses_bad_fields",
}


def _is_single_literal(annotation: Any) -> bool:
    """A field typed to one value (generate's output_mode "tokens", priority 0): any other is a 400 by its type."""
    return typing.get_origin(annotation) is typing.Literal and len(typing.get_args(annotation)) == 1


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest, GenerateRequest])
def test_every_field_has_an_effect_or_is_refused(model: type) -> None:
    unaccounted = []
    for name, info in model.model_fields.items():
        if name in _ONLY_OFF or _is_single_literal(info.annotation):
            continue  # refused unless off
        test = FIELD_TESTS.get(name)
        if test is None:
            unaccounted.append(name)
            continue
        file, _, function = test.rpartition("::")
        source = (TESTS / (file or Path(__file__).name)).read_text()
        assert f"def {function}(" in source, f"{name}: {test} does not exist"
    assert not unaccounted, f"fields neither tested for an effect nor refused: {unaccounted}"
    # A declared field is implemented by its model (chat's reasoning fields), or typed to its one accepted
    # value: none of the refused ones is declared and then dropped.
    implemented = {n for n, info in model.model_fields.items() if not _is_single_literal(info.annotation)}
    assert set(REFUSED_FIELDS) & implemented <= {"include_reasoning", "reasoning_effort"}
