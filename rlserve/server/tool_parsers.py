"""Tool calls parsed out of generated text (`--enable-auto-tool-choice --tool-call-parser NAME`), as vLLM's parsers
of the same names do. Only `hermes` is implemented: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the
format of Hermes, Qwen 2.5/3 and most RL-tuned chat models.

Streaming sends the text outside the tags as it comes (holding back what may be the start of a tag) and each tool
call whole, with the choice's last chunk: simpler than vLLM's incremental argument deltas, and the same calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from rlserve.server.chat_requests import FunctionCall, ToolCall
from rlserve.server.partial_tags import partial_tag_length

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def _new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


@dataclass(frozen=True)
class ParsedOutput:
    content: str  # the text outside the tool-call tags, in order
    tool_calls: list[ToolCall]


def parse_hermes(text: str) -> ParsedOutput:
    """The tool calls in `text` and the text around them. Any call that is not a JSON object with a string `name`
    (a cut-off or malformed call) leaves the whole text as content with no calls, as vLLM's parser does."""
    outside: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(TOOL_CALL_START, pos)) != -1:
        outside.append(text[pos:start])
        body_start = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body_start)
        body = text[body_start:] if end == -1 else text[body_start:end]
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return ParsedOutput(text, [])
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedOutput(text, [])
        arguments = call.get("arguments", {})
        function = FunctionCall(name=call["name"], arguments=json.dumps(arguments, ensure_ascii=False))
        calls.append(ToolCall(id=_new_call_id(), function=function))
        pos = len(text) if end == -1 else end + len(TOOL_CALL_END)
    outside.append(text[pos:])
    return ParsedOutput("".join(outside), calls)


TOOL_CALL_PARSERS = ("hermes",)  # --tool-call-parser values rlserve implements


class StreamingToolCalls:
    """One streamed choice: `feed` each text delta and send what it returns as content; `finish` gives the rest of
    the content and the tool calls, for the choice's last chunk."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # characters of `text` sent as content: all before the first tool call's tag

    def feed(self, delta: str) -> str:
        self.text += delta
        start = self.text.find(TOOL_CALL_START)
        sendable = start if start != -1 else len(self.text) - partial_tag_length(self.text, [TOOL_CALL_START])
        if sendable <= self.sent:
            return ""
        content = self.text[self.sent : sendable]
        self.sent = sendable
        return content

    def finish(self) -> ParsedOutput:
        parsed = parse_hermes(self.text)
        # The content parsed begins with the text sent (everything before the first tag): only the rest is new.
        return ParsedOutput(parsed.content[self.sent :], parsed.tool_calls)
