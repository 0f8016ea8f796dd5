"""Incremental detokenization and stop-string matching for one sample."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything each token.

    Decoding the last few tokens together (from prefix_offset) keeps multi-token characters and leading spaces
    right; a trailing U+FFFD means a character is still incomplete, so nothing is emitted until it completes.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int]) -> str:
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back (an incomplete character, shown as U+FFFD) once no more tokens will come."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]


def find_stop_string(text: str, num_new_chars: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """Look for a stop string that ends within the last num_new_chars characters.

    Returns (stop string, length to truncate the text to), or None.
    """
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1:
            return stop, index + len(stop) if include else index
    return None
