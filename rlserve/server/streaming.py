"""Server-Sent Events: a streamed response's chunks, one per choice per engine delta, then its usage and [DONE]. An
error after the response began can only be told in the stream: it ends as an error event, then [DONE].

Each engine delta's events go out in one body write, and the last delta's with the usage, [DONE] and the end of the
chunked body: a socket write costs the streaming API server more than any other step of a chunk."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from json.encoder import encode_basestring
from typing import Any, Literal

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

from rlserve.engine.frontend.core_client import EngineDeadError, RequestRefusedError
from rlserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from rlserve.server.errors import APIError
from rlserve.server.openai_responses import UsageInfo
from rlserve.server.response_fields import Usage

logger = logging.getLogger(__name__)

PositionLogprobsList = list[PositionLogprobs | None]
# A choice's event: make_chunk(index, output, sample, first, prompt_logprobs) (see stream_events), a model or an
# event a ChunkTemplate rendered.
ChunkMaker = Callable[[int, RequestOutput, CompletionOutput, bool, PositionLogprobsList | None], BaseModel | bytes]


# JSON may hold U+0085, U+2028 and U+2029 raw, and clients that split lines as str.splitlines does (httpx's
# aiter_lines) would cut an event there: escaped, every event is one line.
_LINE_BREAKS = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))
DONE_EVENT = b"data: [DONE]\n\n"


def _one_line(data: str) -> str:
    if not data.isascii():  # rare characters, sought with `in` (a C scan) rather than a per-character translate
        for raw, escaped in _LINE_BREAKS:
            if raw in data:
                data = data.replace(raw, escaped)
    return data


def sse_event(payload: BaseModel | bytes) -> bytes:
    """`payload`'s SSE event, UTF-8 (a string the codec refuses, a lone surrogate, raises here, in the stream's
    error handling, as pydantic's serializer would)."""
    if isinstance(payload, bytes):
        return payload
    return b"data: %s\n\n" % _one_line(payload.model_dump_json()).encode()


SlotKind = Literal["str", "strs", "ints"]
# A slot's value while the template is rendered: text no engine output, version or id holds, and an integer no
# chunk holds, whose JSON occurs nowhere else in the chunk.
_MARKER_TEXT = "\x00rlserve-slot-{}\x00"
_MARKER_INT = 7_105_934_218_300_000_000


def _marker(kind: SlotKind, i: int) -> Any:
    text = _MARKER_TEXT.format(i)
    return {"str": text, "strs": [text], "ints": [_MARKER_INT + i]}[kind]


def _str_json(value: str | None) -> str:
    return "null" if value is None else encode_basestring(value)


def _strs_json(values: list[str] | None) -> str:
    return "null" if values is None else "[" + ",".join(map(encode_basestring, values)) + "]"


def _ints_json(values: list[int] | None) -> str:
    return "null" if values is None else "[" + ",".join(map(str, values)) + "]"


# How pydantic writes each slot's value (None as null): json's encode_basestring escapes a string exactly as
# pydantic's serializer does (tests/server/test_stream_chunks.py compares them over every code point).
_SLOT_JSON: dict[SlotKind, Callable[[Any], str]] = {"str": _str_json, "strs": _strs_json, "ints": _ints_json}


class ChunkTemplate:
    """The events of a stream's chunks that differ only in a few fields (`slots`: a choice's new text, its tokens'
    ids or versions): pydantic renders the chunk once, with a marker in each slot, and each later event is the pieces
    around the markers joined with the slots' new values as pydantic writes them. The same bytes as the model's
    event, for a few string joins instead of two models' validation and serialization each chunk."""

    def __init__(self, chunk: Callable[..., BaseModel], kinds: Sequence[SlotKind]) -> None:
        markers = [_SLOT_JSON[kind](_marker(kind, i)) for i, kind in enumerate(kinds)]
        rendered = _one_line(chunk(*[_marker(kind, i) for i, kind in enumerate(kinds)]).model_dump_json())
        for marker in markers:
            if rendered.count(marker) != 1:
                raise ValueError(f"a template's slot must appear once in its chunk: {marker}")
        # The slots in the order the chunk holds them (a model writes its fields in its own order).
        self._order = sorted(range(len(kinds)), key=lambda i: rendered.index(markers[i]))
        pieces, rest = [], rendered
        for i in self._order:
            head, _, rest = rest.partition(markers[i])
            pieces.append(head)
        self._head = "data: " + (pieces[0] if pieces else rest + "\n\n")
        tails = [*pieces[1:], rest + "\n\n"]
        self._slots = [(i, _SLOT_JSON[kinds[i]], tail) for i, tail in zip(self._order, tails, strict=True)]

    def render(self, *values: Any) -> bytes:
        parts = [self._head]
        for i, to_json, tail in self._slots:
            parts += (to_json(values[i]), tail)
        return _one_line("".join(parts)).encode()


class SSEResponse(StreamingResponse):
    """A streamed response of stream_events' writes, each one body message; the last (it ends with [DONE]) also
    ends the chunked body, in the same socket write."""

    media_type = "text/event-stream"

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        more_body = True
        async for data in self.body_iterator:
            more_body = not data.endswith(DONE_EVENT)
            await send({"type": "http.response.body", "body": data, "more_body": more_body})
        if more_body:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def stream_events(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    num_choices: int,
    include_usage: bool,
    make_chunk: ChunkMaker,
    make_usage_chunk: Callable[[UsageInfo], BaseModel],
    preamble: list[BaseModel],
) -> AsyncIterator[bytes]:
    """SSE writes: each engine delta's chunks (one per choice with news, `finish_reason` on each choice's last),
    then usage and [DONE] in the write of the delta that ends the last of the `num_choices` choices.

    `make_chunk(index, output, sample, first, prompt_logprobs)`: `first` marks the choice's first chunk, which
    also gets the prompt's logprobs (if requested).
    """
    usage = Usage()
    # DELTA outputs carry prompt logprobs once, in the prompt's first output, which may hold no token yet.
    prompt_lps: dict[int, PositionLogprobsList] = {}
    started: set[int] = set()
    finished: set[int] = set()
    events: list[bytes] = []
    try:
        if preamble:
            yield b"".join(sse_event(chunk) for chunk in preamble)
        async with aclosing(outputs) as stream:
            async for i, out in stream:
                usage.add(i, out)
                if out.prompt_logprobs is not None:
                    prompt_lps.setdefault(i, out.prompt_logprobs)
                for sample in out.outputs:
                    index = i * n + sample.index
                    if index in finished or not (sample.token_ids or sample.text or sample.finish_reason):
                        continue
                    first = index not in started
                    started.add(index)
                    chunk = make_chunk(index, out, sample, first, prompt_lps.get(i) if first else None)
                    events.append(sse_event(chunk))
                    if sample.finish_reason is not None:
                        finished.add(index)
                if events and len(finished) < num_choices:
                    yield b"".join(events)
                    events.clear()
        if include_usage:
            events.append(sse_event(make_usage_chunk(usage.info())))
    except APIError as e:
        events.append(sse_event(e.response()))
    except EngineDeadError as e:
        events.append(sse_event(APIError(503, f"the engine is gone: {e}").response()))
    except RequestRefusedError as e:
        events.append(sse_event(APIError(503, str(e)).response()))
    except Exception as e:
        logger.exception("stream failed")
        events.append(sse_event(APIError(500, f"generation failed: {e}").response()))
    events.append(DONE_EVENT)
    yield b"".join(events)
