"""Streaming text that tags cut into parts: how much of a text's end to hold back, because it may be the start of a
tag that the next delta completes (so that no piece of a tag is ever sent as text)."""

from __future__ import annotations

from collections.abc import Iterable


def partial_tag_length(text: str, tags: Iterable[str]) -> int:
    """How many characters at the end of `text` could begin one of `tags` (0 when none could)."""
    held = 0
    for tag in tags:
        for length in range(min(len(tag) - 1, len(text)), held, -1):
            if text.endswith(tag[:length]):
                held = length
                break
    return held
