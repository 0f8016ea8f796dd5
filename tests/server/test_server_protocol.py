"""Engine logprobs -> OpenAI shapes, where a live server cannot be steered: -inf values and rank order."""

from __future__ import annotations

import json
import math

from rlserve.outputs import CompletionOutput, Logprob
from rlserve.server.openai_responses import CompletionResponseChoice, CompletionStreamResponse
from rlserve.server.response_fields import NEG_INF_LOGPROB, TokenFormatter, chat_logprobs, completion_logprobs
from rlserve.server.streaming import sse_event


def sample_with_masked_tokens() -> CompletionOutput:
    # Position 0: token 7 sampled at rank 3, outside the top 2; position 1: a token masked to -inf (top-k cut).
    positions = [
        {1: Logprob(-0.5, 1, "a"), 2: Logprob(-1.0, 2, "b"), 7: Logprob(-3.0, 3, "c")},
        {2: Logprob(0.0, 1, "b"), 9: Logprob(-math.inf, 250, "zz")},
    ]
    return CompletionOutput(0, "cb", [7, 9], None, positions, weight_versions=["v0", "v1"])


def test_neg_inf_becomes_minus_9999_and_json_is_valid() -> None:
    sample = sample_with_masked_tokens()
    logprobs, end = completion_logprobs(sample.token_ids, sample.logprobs, TokenFormatter(False), 10, str)
    assert logprobs.token_logprobs == [-3.0, NEG_INF_LOGPROB]
    assert logprobs.top_logprobs[1] == {"b": 0.0, "zz": NEG_INF_LOGPROB}
    assert logprobs.text_offset == [10, 11] and end == 13
    json.loads(logprobs.model_dump_json())  # no Infinity / NaN literals

    chat = chat_logprobs(sample_with_masked_tokens(), TokenFormatter(True), top_k=2)
    first, second = chat.content
    assert (first.token, first.logprob) == ("token_id:7", -3.0)
    assert [t.token for t in first.top_logprobs] == ["token_id:1", "token_id:2"]  # the top 2 by rank, not the sampled
    assert second.logprob == NEG_INF_LOGPROB and second.bytes == list(b"token_id:9")


def test_an_sse_event_is_one_line_whatever_the_text() -> None:
    # U+0085, U+2028 and U+2029 are line breaks to str.splitlines (and so to httpx's aiter_lines); JSON may leave
    # them raw, and the event would arrive cut in two.
    text = "a\x85b\u2028c\u2029d\x1cé"
    chunk = CompletionStreamResponse(id="x", model="m", choices=[CompletionResponseChoice(index=0, text=text)])
    event = sse_event(chunk).decode()
    assert event.endswith("\n\n") and event.startswith("data: ")
    (line,) = event[:-2].splitlines()
    assert json.loads(line[len("data: ") :])["choices"][0]["text"] == text
