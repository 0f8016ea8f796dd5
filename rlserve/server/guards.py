"""What one request may ask of the server, and the ASGI middleware that holds the line before any route runs.

A single request must not stall the event loop (every client, `/health` included, waits on it) nor take the server
down: bodies are bounded as they arrive, prompts are bounded before they are tokenized, and an unexpected exception
is a 500 answer on a connection that stays open (Starlette's own handler re-raises it to uvicorn, which then drops
the connection: keep-alive clients saw their next request fail). What a sampling request multiplies (samples, stop
strings) is bounded with the rest of the request's checks, in engine/frontend/validation.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlserve.server.chat_requests import ChatMessage
from rlserve.server.errors import APIError, error_response

logger = logging.getLogger(__name__)

# --max-request-body-bytes' default: a batch of dozens of 128k-token prompts as token ids (~7 bytes per id in JSON)
# fits; what is larger than this costs the event loop a noticeable time just to parse (json.loads runs on it).
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# A text prompt (or a rendered chat) longer than this many characters per token of the context cannot fit once
# tokenized (real tokenizers average under 10 characters per token): refused before the tokenizer spends time on it.
# `truncate_prompt_tokens` cuts after tokenizing, so its prompts are bounded the same way.
MAX_PROMPT_CHARS_PER_TOKEN = 32


def check_prompt_chars(text: str, max_model_len: int, param: str) -> None:
    """400 naming `param` if `text` is too long to be a prompt of this model (see MAX_PROMPT_CHARS_PER_TOKEN)."""
    limit = max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
    if len(text) > limit:
        raise APIError(
            400,
            f"{param}: the prompt is {len(text)} characters, more than {limit} ({MAX_PROMPT_CHARS_PER_TOKEN} per token "
            f"of max_model_len={max_model_len}) could ever fit",
            param,
        )


def check_chat_size(messages: Sequence[ChatMessage], max_model_len: int) -> None:
    """400 naming `messages` for a chat that could never fit, before its template is rendered (rendering 200,000
    messages held the prompt thread, which every request shares, for seconds): a turn renders at least one token (its
    role marker), and its text at least one token per MAX_PROMPT_CHARS_PER_TOKEN characters."""
    if len(messages) > max_model_len:
        raise APIError(
            400,
            f"messages: {len(messages)} messages, more than max_model_len={max_model_len} tokens could ever hold",
            "messages",
        )
    chars = sum(_message_chars(message) for message in messages)
    limit = max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
    if chars > limit:
        raise APIError(
            400,
            f"messages: the messages' text is {chars} characters, more than {limit} ({MAX_PROMPT_CHARS_PER_TOKEN} per "
            f"token of max_model_len={max_model_len}) could ever fit",
            "messages",
        )


def _message_chars(message: ChatMessage) -> int:
    """The characters of a message that its rendering holds: its text, its reasoning and its calls' arguments."""
    reasoning = message.reasoning or message.reasoning_content or ""
    calls = sum(len(call.function.arguments) for call in message.tool_calls or ())
    return len(message.text()) + len(reasoning) + calls


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` as the body grows past the limit; an HTTPException so that FastAPI's body reading passes
    it on (it turns other errors into a 400) to the server's handler, which answers 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body: larger than {limit} bytes (--max-request-body-bytes)")


class RequestGuard:
    """ASGI middleware: a body over `max_body_bytes` is a 413 (at once when Content-Length says so, else as soon as
    the bytes received pass it, so a slow 50 MB upload is never buffered whole), and an exception no handler took is
    a 500 with OpenAI's error JSON, the connection kept open (re-raised only once the response has started, when
    closing the connection is the only way left to tell the client)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await error_response(APIError(413, BodyTooLarge(limit).detail))(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except Exception as e:
            if started:
                raise
            logger.exception("request failed: %s %s", scope.get("method"), scope.get("path"))
            await error_response(APIError(500, f"internal error: {e!r}"))(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # uvicorn's parser refuses such a request before it gets here
    return None
