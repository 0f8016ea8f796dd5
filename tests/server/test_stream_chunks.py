"""Streamed chunks without pydantic per chunk: a ChunkTemplate's events are the bytes pydantic writes for the same
values (every code point, lists, nulls), the completions and chat chunk makers' plain chunks equal their pydantic
path's, and a real server writes each engine delta's events in one HTTP chunk, the last with the usage and [DONE]."""

from __future__ import annotations

import json
import random
import socket
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
from server_helpers import MODEL_NAME, Server

from rlserve.outputs import CompletionOutput, RequestOutput
from rlserve.server.chat_requests import ChatCompletionRequest
from rlserve.server.openai_requests import CompletionRequest
from rlserve.server.openai_responses import CompletionResponseChoice, CompletionStreamResponse
from rlserve.server.serving_chat import _ChatChoices
from rlserve.server.serving_completions import _CompletionChoices
from rlserve.server.streaming import DONE_EVENT, ChunkTemplate, sse_event
from rlserve.toy import make_tokenizer

SLOTS = ("str", "strs", "ints")


def completion_chunk(text: str, versions: list[str] | None, ids: list[int] | None) -> CompletionStreamResponse:
    choice = CompletionResponseChoice(index=3, text=text, token_weight_versions=versions, token_ids=ids)
    return CompletionStreamResponse(id="cmpl-1", created=7, model="m", choices=[choice])


def test_a_template_writes_what_pydantic_writes_for_every_code_point() -> None:
    template = ChunkTemplate(completion_chunk, SLOTS)
    code_points = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]  # surrogates: not text
    for start in range(0, len(code_points), 4096):
        text = "".join(map(chr, code_points[start : start + 4096])) + '"\\/'
        assert template.render(text, None, None) == sse_event(completion_chunk(text, None, None)), start


def test_a_template_writes_lists_and_nulls_as_pydantic_does() -> None:
    template = ChunkTemplate(completion_chunk, SLOTS)
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(
            chr(rng.choice([10, 34, 92, 0x85, 0x2028, 0xE9, 0x1F389, rng.randrange(32, 127)])) for _ in range(5)
        )
        versions = rng.choice([None, [], [str(rng.randrange(10**6)) for _ in range(rng.randrange(1, 4))], ['a"\n']])
        ids = rng.choice([None, [], [rng.randrange(2**31) for _ in range(rng.randrange(1, 5))]])
        event = template.render(text, versions, ids)
        assert event == sse_event(completion_chunk(text, versions, ids))
        (line,) = event.decode()[:-2].splitlines()  # one line, whatever the text
        assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text


def test_a_template_refuses_what_pydantic_refuses() -> None:
    template = ChunkTemplate(completion_chunk, SLOTS)
    with pytest.raises(UnicodeEncodeError):
        template.render("a\ud800", None, None)
    with pytest.raises(ValueError, match="surrogates"):
        sse_event(completion_chunk("a\ud800", None, None))
    with pytest.raises(ValueError, match="once"):
        ChunkTemplate(lambda text, v, ids: completion_chunk("x", v, ids), SLOTS)  # a slot the chunk leaves out


def serving() -> SimpleNamespace:
    engine = SimpleNamespace(tokenizer=make_tokenizer())
    defaults = SimpleNamespace(
        tokens_as_token_ids=lambda req: False, reasoning_parser=None, enable_auto_tool_choice=False
    )
    return SimpleNamespace(engine=engine, defaults=defaults)


def output(text: str, ids: list[int], finish_reason: str | None = None) -> RequestOutput:
    sample = CompletionOutput(0, text, ids, None, None, finish_reason=finish_reason, weight_versions=["v1"] * len(ids))
    return RequestOutput("r", None, [5, 6], None, [sample], finish_reason is not None)


@pytest.mark.parametrize("fields", [{}, {"return_token_ids": True, "return_token_weight_versions": True}])
def test_completion_chunks_from_the_template_equal_the_models(fields: dict) -> None:
    req = CompletionRequest(model="m", prompt=[5, 6], stream=True, **fields)
    choices = _CompletionChoices(serving(), req, "cmpl-1", "m", 1)
    for text, ids in [("é\u2028", [1, 2]), ('"', [3]), ("", [4])]:
        out = output(text, ids)
        plain = choices.chunk(0, out, out.outputs[0], False, None)
        assert isinstance(plain, bytes)
        versions = {"token_weight_versions": ["v1"] * len(ids)} if fields else {}
        model = choices._stream_chunk([choices._choice(0, out.outputs[0], text, None, None, None, versions)])
        assert plain == sse_event(model)
    last = output("end", [9], "length")
    assert not isinstance(choices.chunk(0, last, last.outputs[0], False, None), bytes)  # a last chunk: the model's


@pytest.mark.parametrize("fields", [{}, {"return_token_ids": True, "return_token_weight_versions": True}])
def test_chat_chunks_from_the_template_equal_the_models(fields: dict) -> None:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True, **fields)
    params = SimpleNamespace(n=1, logprobs=None)
    fast = _ChatChoices(serving(), req, "chatcmpl-1", "m", params, None, False)
    slow = _ChatChoices(serving(), req, "chatcmpl-1", "m", params, None, False)
    slow.text_deltas, slow.created = False, fast.created  # the same chunks through the models
    for text, ids in [("é\u2028", [1, 2]), ('"', [3]), ("", [4])]:
        out = output(text, ids)
        plain = fast.chunk(0, out, out.outputs[0], False, None)
        assert isinstance(plain, bytes) and plain == sse_event(slow.chunk(0, out, out.outputs[0], False, None))


def raw_http_chunks(server: Server, path: str, body: dict) -> list[bytes]:
    """POST `body` to `path` over a plain socket and return the response's HTTP chunks as the server framed them
    (one per body write), without the final empty one."""
    url = urlsplit(server.url)
    payload = json.dumps(body).encode()
    headers = "".join(f"{k}: {v}\r\n" for k, v in server.headers.items())
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode() + payload
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(request)
        data = b""
        while block := sock.recv(65536):
            data += block
    head, _, rest = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"transfer-encoding: chunked" in head.lower(), head
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n"
            return chunks
        chunks.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]


def test_each_delta_is_one_write_and_the_last_carries_usage_and_done(server: Server) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": "write merging",
        "max_tokens": 6,
        "n": 3,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = raw_http_chunks(server, "/v1/completions", body)
    events = [e for c in chunks for e in c.split(b"\n\n") if e]
    assert all(c.endswith(b"\n\n") for c in chunks)  # no event is split across writes
    parsed = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    choices = [c for p in parsed for c in p["choices"]]
    assert {c["index"] for c in choices} == {0, 1, 2} and parsed[-1]["usage"]["completion_tokens"] == 18
    assert len({p["created"] for p in parsed}) == 1  # one time for the whole stream
    # The three samples step together: their events share writes (fewer writes than token chunks).
    assert len(chunks) < len(choices)
    last = chunks[-1]
    assert last.endswith(DONE_EVENT) and b'"usage":{' in last and last.count(b'"finish_reason":"length"') >= 1
    finishes = [c for c in choices if c["finish_reason"] == "length"]
    assert len(finishes) == 3
