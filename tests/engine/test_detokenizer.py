"""Streaming detokenization: the text streamed token by token (then flushed) is what decoding all tokens gives."""

from __future__ import annotations

import pytest

from rlserve.engine.frontend.detokenizer import StreamDetokenizer, WindowDetokenizer, make_detokenizer
from rlserve.toy import make_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld — 日本語のテキスト 🎉 done",  # characters of 2, 3 and 4 bytes: several byte tokens each
    "  leading spaces and\nnew lines\t",
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def stream(detok, ids: list[int], chunk: int) -> str:
    text = "".join(detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk))
    return text + detok.flush()


@pytest.mark.parametrize("kind", [StreamDetokenizer, WindowDetokenizer])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_the_decoded_text(tokenizer, kind, text, chunk) -> None:
    ids = tokenizer(text).input_ids
    assert stream(kind(tokenizer, True), ids, chunk) == tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("kind", [StreamDetokenizer, WindowDetokenizer])
def test_an_incomplete_character_is_held_back_then_flushed(tokenizer, kind) -> None:
    ids = tokenizer("ok 🎉").input_ids
    assert len(tokenizer("🎉", add_special_tokens=False).input_ids) > 1  # the test needs a multi-token character
    detok = kind(tokenizer, True)
    shown = "".join(detok.add([i]) for i in ids[:-1])  # the emoji's last byte is missing
    assert shown == "ok "
    held = detok.flush()
    assert "\ufffd" in held and shown + held == tokenizer.decode(ids[:-1])  # U+FFFD, as decode shows it


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip) -> None:
    ids = [*tokenizer("a b").input_ids, tokenizer.eos_token_id, *tokenizer("c").input_ids]
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert stream(make_detokenizer(tokenizer, skip), ids, 1) == expected
    assert stream(WindowDetokenizer(tokenizer, skip), ids, 1) == expected


def test_fast_tokenizers_stream_through_decode_stream(tokenizer) -> None:
    assert isinstance(make_detokenizer(tokenizer, True), StreamDetokenizer)
