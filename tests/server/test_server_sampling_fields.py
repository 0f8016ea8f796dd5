"""vLLM's sampling extras and OpenAI's logit_bias through a real server and the openai client: their effect on the
tokens, and a bad value answered as a 400 naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import MODEL_NAME, Server

PROMPT = "The quick brown fox jumps over"
MAX_TOKENS = 32


@pytest.fixture
def oai(server: Server) -> openai.OpenAI:
    return server.openai()


def test_a_bad_word_never_appears(oai: openai.OpenAI, server: Server) -> None:
    plain = completion_tokens(oai)
    word = max(set(plain), key=plain.count)  # the plain run's most repeated token
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        text = http.post("/detokenize", json={"tokens": [word]}).json()["prompt"]
    assert word not in completion_tokens(oai, extra_body={"bad_words": [text]})


def completion_tokens(oai: openai.OpenAI, temperature: float = 0.0, **kwargs) -> list[int]:
    extra_body = {"return_token_ids": True, "ignore_eos": True, **kwargs.pop("extra_body", {})}
    response = oai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=temperature, extra_body=extra_body, **kwargs
    )
    return response.choices[0].token_ids


def test_penalty_bias_and_allowed_tokens_change_the_samples(oai: openai.OpenAI) -> None:
    plain = completion_tokens(oai)
    assert len(set(plain)) < len(plain), "the plain greedy completion repeats tokens"
    penalised = completion_tokens(oai, extra_body={"repetition_penalty": 5.0})
    assert len(set(penalised)) == len(penalised)

    assert completion_tokens(oai, temperature=1.0, logit_bias={"42": 100}) == [42] * MAX_TOKENS

    allowed = completion_tokens(oai, temperature=1.0, seed=1, extra_body={"allowed_token_ids": [40, 97]})
    assert set(allowed) == {40, 97}

    # OpenAI's two penalties act on the tokens already generated: the greedy repeats of the plain run change.
    for field in ("presence_penalty", "frequency_penalty"):
        assert completion_tokens(oai, **{field: 2.0}) != plain, field

    chat = oai.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=1.0,
        logit_bias={"42": 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert chat.choices[0].token_ids == [42] * 8


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"forty-two": 1.0}),
        ("repetition_penalty", -1.0),
        ("allowed_token_ids", []),
        ("bad_words", [""]),
    ],
)
def test_a_bad_value_is_a_400_naming_the_field(oai: openai.OpenAI, field: str, value) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, extra_body={field: value}
        )
    assert raised.value.body["param"] == field
