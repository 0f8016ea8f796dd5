"""Penalties, logit bias, allowed tokens and bad words through the engine: their effect on what is sampled, on the
processed logprobs (and not the raw ones), and no effect on the other requests of a batch."""

from __future__ import annotations

import pytest
import torch
from test_logprobs import check_completion, hf_rows

from rlserve import SamplingParams

PROMPT = "hello world"
MAX_TOKENS = 32


def greedy(**params) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)


def tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def llm(qwen3_dir, make_llm):
    # The core in its own process, as by default: the new fields (and bad words' token ids) cross the wire.
    return make_llm(qwen3_dir)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_repetition_penalty_stops_greedy_repeats(qwen3_dir, make_llm, generate, async_scheduling) -> None:
    """Under async scheduling the newest token is still on the device when the next step is prepared: the penalty
    must count it all the same (both settings give the same tokens)."""
    llm = make_llm(qwen3_dir, in_process=True, async_scheduling=async_scheduling)
    (plain,) = tokens(generate(llm, PROMPT, greedy()))
    assert len(set(plain)) < len(plain), "the plain greedy run repeats tokens"
    (penalised,) = tokens(generate(llm, PROMPT, greedy(repetition_penalty=5.0)))
    assert len(set(penalised)) == len(penalised), penalised
    (counted,) = tokens(generate(llm, PROMPT, greedy(frequency_penalty=2.0, presence_penalty=2.0)))
    assert counted != plain
    if async_scheduling:
        sync = make_llm(qwen3_dir, in_process=True, async_scheduling=False)
        assert tokens(generate(sync, PROMPT, greedy(repetition_penalty=5.0))) == [penalised]


def test_allowed_token_ids_are_all_that_is_sampled(llm, generate) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=MAX_TOKENS, allowed_token_ids=[40, 97])
    samples = tokens(generate(llm, PROMPT, params))
    assert {t for s in samples for t in s} == {40, 97}  # both sampled, nothing else


def test_logit_bias_of_100_forces_the_token(llm, generate) -> None:
    params = SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={123: 100.0})
    assert tokens(generate(llm, PROMPT, params)) == [[123] * MAX_TOKENS] * 2


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bad_word_never_appears(qwen3_dir, make_llm, generate, async_scheduling) -> None:
    llm = make_llm(qwen3_dir, in_process=True, async_scheduling=async_scheduling)
    tokenizer = llm.get_tokenizer()
    (plain,) = tokens(generate(llm, PROMPT, greedy()))
    # A two-token word of the plain output (the byte-level toy tokenizer: one that tokenizes back to those tokens).
    word = next(
        plain[i : i + 2]
        for i in range(len(plain) - 1)
        if tokenizer.encode(tokenizer.decode(plain[i : i + 2]), add_special_tokens=False) == plain[i : i + 2]
    )
    (banned,) = tokens(generate(llm, PROMPT, greedy(bad_words=[tokenizer.decode(word)])))
    assert banned != plain
    assert word not in [banned[i : i + 2] for i in range(len(banned) - 1)]
    assert word[0] in banned, "the word's first token alone is not banned"


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_logprobs_of_a_biased_run(qwen3_dir, make_llm, generate, hf, mode) -> None:
    """Processed logprobs are of what was sampled from, bias and penalties included; raw ones of the model alone."""
    temperature, bias = 0.8, {7: 4.0, 60: -3.0, 200: 6.0}
    llm = make_llm(qwen3_dir, logprobs_mode=mode)
    params = SamplingParams(
        temperature=temperature, seed=5, max_tokens=12, ignore_eos=True, logprobs=4, logit_bias=bias
    )
    (out,) = generate(llm, PROMPT, params)
    (completion,) = out.outputs
    logits = hf_rows(hf, qwen3_dir, out.prompt_token_ids, completion.token_ids)
    if mode == "processed_logprobs":
        ids = torch.tensor(list(bias))
        logits = logits.index_add(1, ids, torch.tensor(list(bias.values())).expand(len(logits), -1))
        logits = logits / temperature
    check_completion(completion, logits.log_softmax(-1), 4)


def test_a_mixed_batch_leaves_the_plain_requests_as_they_are_alone(llm, generate) -> None:
    prompts = [PROMPT, "The quick brown fox", "abc abc abc", "a plain one"]
    plain = greedy()
    adjusted = [
        greedy(repetition_penalty=1.5),
        greedy(logit_bias={5: 3.0}, frequency_penalty=0.7),
        greedy(allowed_token_ids=list(range(50)), bad_words=["ab"]),
    ]
    alone_plain = tokens(generate(llm, prompts, plain))
    alone_adjusted = [tokens(generate(llm, prompts[i], p))[0] for i, p in enumerate(adjusted)]
    mixed = tokens(generate(llm, prompts + prompts[:3], [plain] * 4 + adjusted))
    assert mixed[:4] == alone_plain
    assert mixed[4:] == alone_adjusted
    assert all(a != p for a, p in zip(alone_adjusted, alone_plain, strict=False))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3.0),
        ("logit_bias", {"7": 1.0}),
        ("logit_bias", {10**9: 1.0}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [10**9]),
        ("bad_words", [""]),
        ("bad_words", ["   "]),
    ],
)
def test_bad_values_are_refused_by_name(llm, field, value) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        llm.generate(PROMPT, SamplingParams(**{field: value}), use_tqdm=False)


def test_bad_words_are_tokenized_once_per_params_object(llm, monkeypatch) -> None:
    """LLM.generate validates every prompt first; prompts sharing one params object share its tokenized bad words."""
    from rlserve.engine.frontend import validation

    calls = []
    tokenize = validation.tokenize_bad_words
    monkeypatch.setattr(validation, "tokenize_bad_words", lambda tok, p: calls.append(p) or tokenize(tok, p))
    shared, other = greedy(bad_words=["ab"]), greedy(bad_words=["cd"])
    outputs = llm.generate(["a", "b", "c", "d"], [shared, shared, other, shared], use_tqdm=False)
    assert len(outputs) == 4 and len(calls) == 2
