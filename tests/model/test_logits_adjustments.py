"""Penalties, logit bias, allowed tokens and bad words on a batch of logits, against direct references: Hugging Face's
RepetitionPenaltyLogitsProcessor, OpenAI's frequency/presence formula, and token-by-token rules for the masks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from rlserve.engine.sched.request import PLACEHOLDER, Request
from rlserve.engine.worker.logits_inputs import build_logits_adjustments
from rlserve.model.logits_adjustments import apply_logits_adjustments
from rlserve.sampling_params import SamplingParams

VOCAB = 50


def upload(values: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def request(prompt: list[int], output: list[int], **params) -> Request:
    r = Request(str(id(prompt)), prompt, SamplingParams(**params), frozenset(), max_model_len=1000)
    r.output_token_ids = list(output)
    r.all_token_ids = prompt + list(output)
    return r


def adjusted(logits: torch.Tensor, requests: list[Request], **prev) -> torch.Tensor:
    rows = [i for i, r in enumerate(requests) if r.sampling_params.adjusts_logits]
    adjust = build_logits_adjustments(requests, rows, upload, prev.get("sampled"), prev.get("index", {}))
    return apply_logits_adjustments(logits.clone(), adjust)


@pytest.fixture
def logits() -> torch.Tensor:
    # Both signs, so that repetition's divide-positive / multiply-negative rule is exercised.
    return torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_repetition_penalty_matches_hugging_face_over_prompt_and_output(logits: torch.Tensor) -> None:
    prompt, output = [1, 2, 3, 3, 40], [7, 2, 9, 9, 9]
    out = adjusted(logits, [request([5], []), request(prompt, output, repetition_penalty=1.7)])
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[1:2].clone())
    torch.testing.assert_close(out[1], hf[0], rtol=0, atol=0)
    assert torch.equal(out[0], logits[0])  # a row without penalties is left as it was
    assert not torch.equal(out[1], logits[1])


def test_frequency_and_presence_penalties_count_output_tokens_only(logits: torch.Tensor) -> None:
    prompt, output = [4, 4, 8], [8, 11, 11, 11, 30]
    out = adjusted(logits, [request(prompt, output, frequency_penalty=0.5, presence_penalty=-1.5)])
    expected = logits[0].clone()
    for token, count in Counter(output).items():
        expected[token] -= 0.5 * count + -1.5
    torch.testing.assert_close(out[0], expected)
    assert out[0, 4] == logits[0, 4]  # prompt-only token: untouched


def test_all_penalties_together_apply_repetition_first(logits: torch.Tensor) -> None:
    prompt, output = [3], [3, 6, 6]
    r = request(prompt, output, repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.25)
    out = adjusted(logits, [r])
    expected = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([prompt + output]), logits[0:1].clone())[0]
    expected[3] -= 1.0 * 1 + 0.25
    expected[6] -= 1.0 * 2 + 0.25
    torch.testing.assert_close(out[0], expected)


def test_placeholder_output_token_is_read_from_the_previous_step(logits: torch.Tensor) -> None:
    """Async scheduling: the newest output token may still be on the device; its value comes from `prev`."""
    pending = request([1], [2, PLACEHOLDER], frequency_penalty=2.0, repetition_penalty=1.5)
    pending.num_placeholders = 1
    sampled = torch.tensor([0, 0, 13])  # the previous step's samples; this request's is row 2
    out = adjusted(logits, [pending], sampled=sampled, index={pending.request_id: 2})
    reference = adjusted(logits, [request([1], [2, 13], frequency_penalty=2.0, repetition_penalty=1.5)])
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


def test_logit_bias_is_added_and_clamped(logits: torch.Tensor) -> None:
    out = adjusted(logits, [request([1], [], logit_bias={3: 2.5, 7: -1000.0}), request([1], [])])
    expected = logits[0].clone()
    expected[3] += 2.5
    expected[7] -= 100.0  # vLLM clamps biases to [-100, 100]
    torch.testing.assert_close(out[0], expected)
    assert torch.equal(out[1], logits[1])


def test_allowed_token_ids_mask_everything_else(logits: torch.Tensor) -> None:
    out = adjusted(logits, [request([1], []), request([1], [], allowed_token_ids=[4, 9, 4])])
    finite = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert finite == [4, 9]
    assert torch.equal(out[1, [4, 9]], logits[1, [4, 9]])
    assert torch.equal(out[0], logits[0])


def test_bad_words_ban_the_last_token_only_after_the_rest_of_the_word(logits: torch.Tensor) -> None:
    words = [[5], [20, 21], [30, 31, 32]]
    rows = [
        request(
            [20], [], bad_words=["w"], _bad_words_token_ids=words
        ),  # prefix in the prompt only: vLLM matches output tokens
        request([1], [20], bad_words=["w"], _bad_words_token_ids=words),
        request([1], [30, 31], bad_words=["w"], _bad_words_token_ids=words),
        request([1], [31, 31], bad_words=["w"], _bad_words_token_ids=words),
    ]
    out = adjusted(logits, rows)
    banned = {i: set(torch.isinf(out[i]).nonzero().flatten().tolist()) for i in range(4)}
    assert banned == {0: {5}, 1: {5, 21}, 2: {5, 32}, 3: {5}}
    others = torch.isfinite(out)
    assert torch.equal(out[others], logits[others])


def test_masks_survive_the_penalties_and_bias(logits: torch.Tensor) -> None:
    r = request(
        [1],
        [4, 4],
        allowed_token_ids=[4, 6],
        logit_bias={8: 50.0},
        presence_penalty=-2.0,
        frequency_penalty=-2.0,
        repetition_penalty=0.5,
    )
    out = adjusted(logits, [r])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [4, 6]
