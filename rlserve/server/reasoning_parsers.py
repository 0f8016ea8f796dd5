"""Reasoning parsed out of chat output (`--reasoning-parser NAME`), as vLLM 0.33's parsers of the same names parse it:
what the model thinks, up to `</think>`, is the message's `reasoning`; the rest is its `content`, as generated (not
stripped: Qwen3's usually starts with "\\n\\n").

- `deepseek_r1` (and `step5`, vLLM's other name for the same parser): everything is reasoning up to the first
  `</think>`, with or without a `<think>` before it (DeepSeek-R1's template ends the prompt with `<think>`); without
  a `</think>` the whole output is reasoning (the model was cut off while thinking). As vLLM partitions the text, the
  first `<think>` and everything before it are dropped, wherever it is.
- `qwen3`: the same split, read left to right: `<think>` tags while thinking and `</think>` tags after it are
  dropped, and a `<tool_call>` while thinking ends the thinking too, the call being content (Qwen3.5 calls tools from
  inside its thinking). A prompt whose last turn has already closed the thinking (an empty `<think></think>` block,
  a continued final message) makes the whole output content; so does `enable_thinking: false` among the request's
  chat template kwargs, the output then being content exactly as generated.

Streaming sends reasoning and content as they come, holding back what may be the start of a tag, so no piece of a
tag reaches either. A stream cannot take back what it sent: for `deepseek_r1` an output with a `<think>` anywhere but
at its start streams the text before that tag (vLLM's streams do too), which the whole response drops. Every other
output streams exactly the reasoning and content that it parses to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlserve.server.partial_tags import partial_tag_length
from rlserve.server.tool_parsers import TOOL_CALL_START

THINK_START = "<think>"
THINK_END = "</think>"
# Where a chat turn begins or ends (ChatML's, Qwen's): a prompt's last turn is what follows the last of these.
TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")

REASONING_PARSERS = ("deepseek_r1", "qwen3", "step5")  # --reasoning-parser values rlserve implements
# Parsers whose tags may be special tokens, which the output's text must then keep (vLLM's qwen3 parser turns
# skip_special_tokens off).
READS_SPECIAL_TOKENS = frozenset({"qwen3"})


def check_reasoning_parser(name: str) -> None:
    if name not in REASONING_PARSERS:
        implemented = ", ".join(REASONING_PARSERS)
        raise ValueError(f"--reasoning-parser {name}: not implemented (rlserve implements: {implemented})")


@dataclass(frozen=True)
class Reasoned:
    """A whole output split: None for a part the output has none of."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class _Tag:
    ends_thinking: bool = False
    kept: bool = False  # the tag stays in the text, as the first thing of the content


_DROP = _Tag()
_END = _Tag(ends_thinking=True)


@dataclass(frozen=True)
class _Grammar:
    """What each tag does while thinking, and after: the tags not named are text."""

    thinking: Mapping[str, _Tag] = field(default_factory=dict)
    answering: Mapping[str, _Tag] = field(default_factory=dict)


_DEEPSEEK_R1 = _Grammar(thinking={THINK_START: _DROP, THINK_END: _END})
_QWEN3 = _Grammar(
    thinking={THINK_START: _DROP, THINK_END: _END, TOOL_CALL_START: _Tag(ends_thinking=True, kept=True)},
    answering={THINK_END: _DROP},
)


class ReasoningStream:
    """One streamed choice: `feed` each text delta and send the (reasoning, content) it returns; `finish` gives what
    was held back, for the choice's last chunk."""

    def __init__(self, grammar: _Grammar, thinking: bool) -> None:
        self._grammar = grammar
        self.thinking = thinking
        self._pending = ""  # text not sent yet: at most the start of a tag

    def _tags(self) -> Mapping[str, _Tag]:
        return self._grammar.thinking if self.thinking else self._grammar.answering

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._pending + delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            tags = self._tags()
            found = min(((i, tag) for tag in tags if (i := text.find(tag)) != -1), default=None)
            if found is None:
                break
            start, tag = found
            (reasoning if self.thinking else content).append(text[:start])
            rule = tags[tag]
            if rule.ends_thinking:
                self.thinking = False
            if rule.kept:
                content.append(tag)
            text = text[start + len(tag) :]
        sendable = len(text) - partial_tag_length(text, self._tags())
        (reasoning if self.thinking else content).append(text[:sendable])
        self._pending = text[sendable:]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._pending = self._pending, ""
        return (rest, "") if self.thinking else ("", rest)


def _closes_thinking(prompt: str) -> bool:
    """Whether the prompt's last turn closes the thinking: a `</think>` (or a tool call) after its last `<think>`."""
    turn = prompt[max(0, *(prompt.rfind(b) for b in TURN_BOUNDARIES)) :]
    return max(turn.rfind(THINK_END), turn.rfind(TOOL_CALL_START)) > turn.rfind(THINK_START)


@dataclass(frozen=True)
class ReasoningParser:
    """One request's parser: `parse` a whole output, or `stream` one streamed choice."""

    grammar: _Grammar
    thinking: bool  # whether the output starts in the thinking

    def parse(self, text: str) -> Reasoned:
        stream = self.stream()
        reasoning, content = stream.feed(text)
        rest_reasoning, rest_content = stream.finish()
        return Reasoned(reasoning + rest_reasoning or None, content + rest_content or None)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.grammar, self.thinking)


class _DeepSeekR1Parser(ReasoningParser):
    def parse(self, text: str) -> Reasoned:
        """vLLM's partitions: after the first `<think>` (if any), up to the first `</think>`. The reasoning is a string
        even when empty, as vLLM's."""
        before, start, after = text.partition(THINK_START)
        reasoning, _, content = (after if start else before).partition(THINK_END)
        return Reasoned(reasoning, content or None)


class _VerbatimParser(ReasoningParser):
    def parse(self, text: str) -> Reasoned:
        return Reasoned(None, text)


def reasoning_parser(name: str, chat_template_kwargs: Mapping[str, Any] | None, prompt: str) -> ReasoningParser:
    """The parser `--reasoning-parser name` makes for a request with these chat template kwargs and prompt text."""
    check_reasoning_parser(name)
    if name in ("deepseek_r1", "step5"):
        return _DeepSeekR1Parser(_DEEPSEEK_R1, thinking=True)
    if not (chat_template_kwargs or {}).get("enable_thinking", True):
        return _VerbatimParser(_Grammar(), thinking=False)
    return ReasoningParser(_QWEN3, thinking=not _closes_thinking(prompt))
