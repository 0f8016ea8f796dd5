"""Server-Sent Events: a streamed response's chunks, one per choice per engine delta, then its usage and [DONE]. An
error after the response began can only be told in the stream: it ends as an error event, then [DONE]."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from pydantic import BaseModel

from rlserve.engine.frontend.core_client import EngineDeadError, RequestRefusedError
from rlserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from rlserve.server.errors import APIError
from rlserve.server.openai_responses import UsageInfo
from rlserve.server.response_fields import Usage

logger = logging.getLogger(__name__)

PositionLogprobsList = list[PositionLogprobs | None]
# A choice's chunk: make_chunk(index, output, sample, first, prompt_logprobs) (see stream_events).
ChunkMaker = Callable[[int, RequestOutput, CompletionOutput, bool, PositionLogprobsList | None], BaseModel]


# JSON may hold U+0085, U+2028 and U+2029 raw, and clients that split lines as str.splitlines does (httpx's
# aiter_lines) would cut an event there: escaped, every event is one line.
_LINE_BREAKS = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def _sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    if not data.isascii():  # rare characters, sought with `in` (a C scan) rather than a per-character translate
        for raw, escaped in _LINE_BREAKS:
            if raw in data:
                data = data.replace(raw, escaped)
    return f"data: {data}\n\n"


async def stream_events(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    include_usage: bool,
    make_chunk: ChunkMaker,
    make_usage_chunk: Callable[[UsageInfo], BaseModel],
    preamble: list[BaseModel],
) -> AsyncIterator[str]:
    """SSE: one chunk per choice per engine delta, `finish_reason` on each choice's last, then usage and [DONE].

    `make_chunk(index, output, sample, first, prompt_logprobs)`: `first` marks the choice's first chunk, which
    also gets the prompt's logprobs (if requested).
    """
    usage = Usage()
    # DELTA outputs carry prompt logprobs once, in the prompt's first output, which may hold no token yet.
    prompt_lps: dict[int, PositionLogprobsList] = {}
    started: set[int] = set()
    finished: set[int] = set()
    try:
        for chunk in preamble:
            yield _sse(chunk)
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
                    yield _sse(make_chunk(index, out, sample, first, prompt_lps.get(i) if first else None))
                    if sample.finish_reason is not None:
                        finished.add(index)
        if include_usage:
            yield _sse(make_usage_chunk(usage.info()))
    except APIError as e:
        yield _sse(e.response())
    except EngineDeadError as e:
        yield _sse(APIError(503, f"the engine is gone: {e}").response())
    except RequestRefusedError as e:
        yield _sse(APIError(503, str(e)).response())
    except Exception as e:
        logger.exception("stream failed")
        yield _sse(APIError(500, f"generation failed: {e}").response())
    yield _sse("[DONE]")
