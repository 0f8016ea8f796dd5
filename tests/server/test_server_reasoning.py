"""`--reasoning-parser`: the parsers on outputs whose split vLLM 0.33's parsers of the same names gave (streamed with
the tags cut at every place), and a real server (`reasoning_server`: qwen3 with hermes tool calls) whose scripted
model writes SCRIPT_TEXT: thinking, `</think>` one character a token, an answer and a tool call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import ANSWER, REASONING, SCRIPT_TEXT, TOOL_CALL
from server_helpers import MODEL_NAME, Server

from rlserve.server.reasoning_parsers import ReasoningParser, reasoning_parser

# ---- the parsers ----

# (output, reasoning, content) as vLLM 0.33's parsers split them (read off its deepseek_r1 and qwen3 parsers' parse).
R1_CASES = [
    ("<think>abc</think>\n\nXYZ", "abc", "\n\nXYZ"),
    ("abc</think>\n\nXYZ", "abc", "\n\nXYZ"),  # R1's prompt ends with <think>: the output has only the end
    ("abc</think>", "abc", None),
    ("abc", "abc", None),  # cut off while thinking
    ("<think>abc", "abc", None),
    ("  abc </think> X ", "  abc ", " X "),  # nothing is stripped
    ("</think>X", "", "X"),
    ("a</think>b</think>c", "a", "b</think>c"),
    ("", "", None),
    ('x</think><tool_call>{"name": "f"}</tool_call>', "x", '<tool_call>{"name": "f"}</tool_call>'),
]
# Only the whole response drops what comes before a first <think> that is not at the start (vLLM's partition).
R1_WHOLE_ONLY = [
    ("a<think>b</think>c", "b", "c"),
    ("<think>a</think>b<think>c</think>d", "a", "b<think>c</think>d"),
    ("a</think>b<think>c", "c", None),
]
QWEN3_CASES = [
    ("<think>abc</think>\n\nXYZ", "abc", "\n\nXYZ"),
    ("abc</think>\n\nXYZ", "abc", "\n\nXYZ"),
    ("abc</think>", "abc", None),
    ("abc", "abc", None),
    ("</think>X", None, "X"),
    ("a</think>b</think>c", "a", "bc"),
    ("", None, None),
    ("a<think>b</think>c", "ab", "c"),
    ("<think>a</think>b<think>c</think>d", "a", "b<think>cd"),
    # A tool call ends the thinking too, and is content.
    ('r <tool_call>{"name": "f"}</tool_call> more</think>c', "r ", '<tool_call>{"name": "f"}</tool_call> morec'),
    ("<tool_call>a</think>b", None, "<tool_call>ab"),
    ("r</think>c<tool_call>x<think>y</tool_call>", "r", "c<tool_call>x<think>y</tool_call>"),
]
GENERATION_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def stream(parser: ReasoningParser, pieces: list[str]) -> tuple[list[str], list[str]]:
    """What a stream of these text deltas sends: each delta's (reasoning, content), the held-back rest last."""
    thinking = parser.stream()
    sent = [thinking.feed(piece) for piece in pieces] + [thinking.finish()]
    return [r for r, _ in sent], [c for _, c in sent]


def cuts(text: str) -> Iterator[list[str]]:
    """`text` as every stream of two and three deltas, and one character a delta."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]
    yield list(text)


WHOLE = [("deepseek_r1", R1_CASES + R1_WHOLE_ONLY), ("step5", R1_CASES + R1_WHOLE_ONLY), ("qwen3", QWEN3_CASES)]


@pytest.mark.parametrize(("name", "cases"), WHOLE)
def test_outputs_split_as_vllm_splits_them(name: str, cases: list) -> None:
    for text, reasoning, content in cases:
        parsed = reasoning_parser(name, None, GENERATION_PROMPT).parse(text)
        assert (parsed.reasoning, parsed.content) == (reasoning, content), text


@pytest.mark.parametrize(("name", "cases"), [("deepseek_r1", R1_CASES), ("qwen3", QWEN3_CASES)])
def test_streams_send_what_the_whole_output_parses_to_wherever_deltas_cut_the_tags(name: str, cases: list) -> None:
    parser = reasoning_parser(name, None, GENERATION_PROMPT)
    for text, reasoning, content in cases:
        for pieces in cuts(text):
            sent_reasoning, sent_content = stream(parser, pieces)
            assert ("".join(sent_reasoning), "".join(sent_content)) == (reasoning or "", content or ""), pieces


def test_a_stream_holds_back_only_what_may_start_a_tag() -> None:
    thinking = reasoning_parser("qwen3", None, GENERATION_PROMPT).stream()
    assert thinking.feed("ab<") == ("ab", "")  # "<" may start </think>
    assert thinking.feed("/thi") == ("", "")
    assert thinking.feed("nk>C<") == ("", "C")  # after the thinking, a </think> is dropped: "<" waits
    assert thinking.feed("b") == ("", "<b")
    assert thinking.feed("</th") == ("", "")
    assert thinking.finish() == ("", "</th")  # the end comes: what was held back is text
    r1 = reasoning_parser("deepseek_r1", None, "").stream()
    assert r1.feed("a</think>b<") == ("a", "b<")  # R1 drops no tag after the thinking: nothing to hold


def test_r1_streams_the_text_before_a_late_think_tag() -> None:
    """The one difference: a stream cannot take back reasoning it sent (vLLM's streams send it too)."""
    reasoning, content = stream(reasoning_parser("deepseek_r1", None, ""), list("a<think>b</think>c"))
    assert ("".join(reasoning), "".join(content)) == ("ab", "c")


def test_qwen3_thinking_off_or_closed_in_the_prompt_is_all_content() -> None:
    text = "a</think>b<tool_call>"
    off = reasoning_parser("qwen3", {"enable_thinking": False}, GENERATION_PROMPT)
    assert (off.parse(text).reasoning, off.parse(text).content) == (None, text)  # as generated, tags and all
    assert off.parse("").content == ""
    assert stream(off, ["a</th", "ink>b<tool", "_call>"])[1] == ["a</th", "ink>b<tool", "_call>", ""]
    assert reasoning_parser("qwen3", {"enable_thinking": True}, GENERATION_PROMPT).parse(text).reasoning == "a"
    closed = GENERATION_PROMPT + "<think>\n\n</think>\n\n"  # Qwen3's template with enable_thinking false
    assert reasoning_parser("qwen3", None, closed).parse(text).content == "ab<tool_call>"
    assert reasoning_parser("qwen3", None, GENERATION_PROMPT + "<think>x</think>y<think>").parse(text).reasoning == "a"
    # Only the last turn counts: an earlier turn's thinking was closed long ago.
    earlier = "<|im_start|>assistant\n<think>x</think>y<|im_end|>\n" + GENERATION_PROMPT
    assert reasoning_parser("qwen3", None, earlier).parse(text).reasoning == "a"


def test_unknown_parsers_are_refused() -> None:
    with pytest.raises(ValueError, match="rlserve implements: deepseek_r1, qwen3, step5"):
        reasoning_parser("granite", None, "")


# ---- a real server ----

TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
    }
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT_THEN_ANSWER = ANSWER + "<tool_call>" + TOOL_CALL + "</tool_call>"  # the content when no tools are offered


@pytest.fixture
def http(reasoning_server: Server) -> Iterator[httpx.Client]:
    with reasoning_server.client() as client:
        yield client


@pytest.fixture
def oai(reasoning_server: Server) -> openai.OpenAI:
    return reasoning_server.openai()


def chat(http: httpx.Client, messages: list[dict] = USER, **body: Any) -> dict:
    response = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def chat_stream(http: httpx.Client, messages: list[dict] = USER, **body: Any) -> list[dict]:
    """Every chunk's choice of a streamed chat, in order."""
    body = {"model": MODEL_NAME, "messages": messages, "stream": True, **body}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [choice for payload in payloads[:-1] for choice in json.loads(payload)["choices"]]


def test_the_model_writes_its_script_and_chat_parses_the_thinking_out(http: httpx.Client, oai: openai.OpenAI) -> None:
    raw = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "\n", "max_tokens": 40}).json()
    assert raw["choices"][0]["text"] == SCRIPT_TEXT  # completions are not parsed
    response = oai.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=40)
    message = response.choices[0].message
    assert (message.reasoning, message.content) == (REASONING, THOUGHT_THEN_ANSWER)
    assert not message.tool_calls  # no tools offered: the call is text
    assert "reasoning_content" not in message.model_dump()  # vLLM 0.33 sends only `reasoning`
    # Cut off while thinking: all reasoning, no content.
    cut = chat(http, max_tokens=3)
    assert (cut["message"]["reasoning"], cut["message"]["content"], cut["finish_reason"]) == ("Go<", None, "length")


def test_tool_calls_are_parsed_from_the_content(http: httpx.Client, oai: openai.OpenAI) -> None:
    response = oai.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, max_tokens=40)
    choice = response.choices[0]
    assert (choice.message.reasoning, choice.message.content, choice.finish_reason) == (REASONING, ANSWER, "tool_calls")
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_streams_send_reasoning_then_content_and_no_piece_of_a_tag(http: httpx.Client) -> None:
    chunks = chat_stream(http, tools=TOOLS, max_tokens=40, n=2)
    for index in (0, 1):
        deltas = [c["delta"] for c in chunks if c["index"] == index]
        # A chunk a token (or several, folded, when this reader lags): the thinking as it came, nothing of
        # </think> (8 tokens), then the answer; the call, whole, with the last chunk.
        sent = [(d.get("reasoning"), d.get("content")) for d in deltas if d.get("reasoning") or d.get("content")]
        assert all(reasoning is None or content is None for reasoning, content in sent)
        reasoning = [r for r, _ in sent if r is not None]
        assert "".join(reasoning) == REASONING and "".join(c for _, c in sent if c is not None) == ANSWER
        assert [r is not None for r, _ in sent] == [True] * len(reasoning) + [False] * (len(sent) - len(reasoning))
        (call,) = deltas[-1]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["index"] == 0
        assert [c["finish_reason"] for c in chunks if c["index"] == index][-1] == "tool_calls"
    # Cut off inside the tag: what was held back comes with the last chunk, as reasoning.
    cut = [c["delta"] for c in chat_stream(http, max_tokens=4)]
    assert "".join(d.get("reasoning") or "" for d in cut) == "Go</"
    assert not any(d.get("content") for d in cut)


def test_enable_thinking_and_reasoning_effort(http: httpx.Client) -> None:
    """Thinking switched off (chat_template_kwargs, or reasoning_effort "none", which vLLM turns into
    enable_thinking false unless the request sets it): the template closes an empty block and the output, as
    generated, is content."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert render(http, **off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for body in (off, {"reasoning_effort": "none"}):
        message = chat(http, max_tokens=40, **body)["message"]
        assert (message["reasoning"], message["content"]) == (None, SCRIPT_TEXT)
    streamed = chat_stream(http, max_tokens=40, **off)
    assert "".join(c["delta"].get("content") or "" for c in streamed) == SCRIPT_TEXT
    assert render(http, reasoning_effort="none").startswith("<|im_start|>system\neffort: none<|im_end|>")
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    for body in ({"reasoning_effort": "high"}, {"reasoning_effort": "none", **on}):  # the request's own wins
        assert chat(http, max_tokens=40, **body)["message"]["reasoning"] == REASONING
    assert "effort" not in render(http)
    refused = http.post("/v1/chat/completions", json={"messages": USER, "reasoning_effort": "extreme"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"


def render(http: httpx.Client, messages: list[dict] = USER, **body: Any) -> str:
    response = http.post("/v1/chat/completions/render", json={"model": MODEL_NAME, "messages": messages, **body})
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


def test_a_prompt_that_closed_the_thinking_makes_the_output_content(http: httpx.Client) -> None:
    prefilled = [*USER, {"role": "assistant", "content": "<think>x</think>"}]
    assert render(http, prefilled, continue_final_message=True, add_generation_prompt=False).endswith("</think>")
    message = chat(http, prefilled, continue_final_message=True, add_generation_prompt=False, max_tokens=40)["message"]
    # The model goes on after the prefilled "</think>": its answer, with no thinking.
    assert (message["reasoning"], message["content"]) == (None, THOUGHT_THEN_ANSWER)
    # Prefilled up to the call: only whitespace is left beside it, which vLLM leaves out of the content.
    prefilled = [*USER, {"role": "assistant", "content": "<think>x</think>" + ANSWER.rstrip()}]
    body = {"continue_final_message": True, "add_generation_prompt": False, "tools": TOOLS, "max_tokens": 40}
    choice = chat(http, prefilled, **body)
    assert (choice["message"]["reasoning"], choice["message"]["content"]) == (None, None)
    assert len(choice["message"]["tool_calls"]) == 1 and choice["finish_reason"] == "tool_calls"


def test_include_reasoning_false_drops_the_reasoning_and_its_traces(http: httpx.Client) -> None:
    traces = {"logprobs": True, "return_token_ids": True, "max_tokens": 40}
    shown = chat(http, **traces)
    assert shown["message"]["reasoning"] == REASONING and shown["logprobs"] and shown["token_ids"]
    hidden = chat(http, include_reasoning=False, **traces)
    assert hidden["message"]["reasoning"] is None and hidden["message"]["content"] == THOUGHT_THEN_ANSWER
    assert hidden["logprobs"] is None and hidden["token_ids"] is None  # vLLM's: they would show the reasoning
    streamed = chat_stream(http, include_reasoning=False, **traces)
    assert not any(c["delta"].get("reasoning") or c["logprobs"] or c["token_ids"] for c in streamed)
    assert "".join(c["delta"].get("content") or "" for c in streamed) == THOUGHT_THEN_ANSWER
    completion = http.post("/v1/completions", json={"prompt": "\n", "include_reasoning": False})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "include_reasoning"


def test_assistant_turns_send_their_reasoning_back_to_the_template(http: httpx.Client, oai: openai.OpenAI) -> None:
    for field in ("reasoning", "reasoning_content"):  # vLLM's name and its older one
        turns = [*USER, {"role": "assistant", "content": "Sunny.", field: "I looked."}, *USER]
        assert "<|im_start|>assistant\n<think>I looked.</think>Sunny.<|im_end|>" in render(http, turns)
        response = oai.chat.completions.create(model=MODEL_NAME, messages=turns, max_tokens=40)
        assert response.choices[0].message.reasoning == REASONING
    wrong = http.post("/v1/chat/completions", json={"messages": [{**USER[0], "reasoning": "x"}]})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "messages"
