"""Random sampling: per-request seeds, n samples, and truncation (top-k, top-p, min-p) checked against HF logits."""

from __future__ import annotations

import pytest
import torch

from rlserve import SamplingParams

SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)


def sampled(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_seeded_request_is_independent_of_its_batch(qwen3_dir, make_llm, generate, tracked) -> None:
    llm = make_llm(qwen3_dir)
    prompt = "seeded sampling"
    (alone,) = generate(llm, prompt, SEEDED)
    tokens = alone.outputs[0].token_ids
    assert len(tokens) == 16

    others = [
        SamplingParams(temperature=1.0, max_tokens=8 + i % 9, ignore_eos=True, seed=None if i % 2 else 100 + i)
        for i in range(32)
    ]
    prompts = [f"other request {i}" * (1 + i % 3) for i in range(32)]
    for position in (0, 17, 32):
        batch_prompts = prompts[:position] + [prompt] + prompts[position:]
        batch_params = others[:position] + [SEEDED] + others[position:]
        outputs = generate(llm, batch_prompts, batch_params)
        assert outputs[position].outputs[0].token_ids == tokens

    # And under chunked prefill plus preemption, which change every step's batch composition.
    # In process: the preemption count is read off the scheduler's requests.
    tight = make_llm(
        qwen3_dir, in_process=True, block_size=4, num_kv_blocks=40, max_model_len=64, max_num_batched_tokens=16
    )
    requests = tracked(tight)
    outputs = generate(tight, prompts[:16] + [prompt], others[:16] + [SEEDED])
    assert outputs[-1].outputs[0].token_ids == tokens
    assert sum(r.num_preemptions for r in requests) > 0


def test_seeded_requests_reproduce_across_engines(qwen3_dir, make_llm, generate) -> None:
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True) for s in range(6)]
    prompts = [f"prompt {i}" for i in range(6)]
    first = sampled(generate(make_llm(qwen3_dir), prompts, params))
    second = sampled(generate(make_llm(qwen3_dir, max_num_batched_tokens=8), prompts[::-1], params[::-1]))[::-1]
    assert first == second
    assert len({tuple(t) for t in first}) > 1


def test_n_samples_with_seed(qwen3_dir, make_llm, generate) -> None:
    llm = make_llm(qwen3_dir)
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    (first,) = generate(llm, "four samples", params)
    (second,) = generate(llm, "four samples", params)
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    samples = [c.token_ids for c in first.outputs]
    assert samples == [c.token_ids for c in second.outputs]
    assert all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) > 1, "n samples with a seed must not all be identical"
    assert all(c.finish_reason == "length" for c in first.outputs)


def test_n_samples_without_seed(qwen3_dir, make_llm, generate) -> None:
    llm = make_llm(qwen3_dir)
    outs = generate(llm, ["a", "b"], SamplingParams(n=5, temperature=1.0, max_tokens=8, ignore_eos=True))
    for out in outs:
        assert len(out.outputs) == 5
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_greedy_with_n_gives_identical_samples(qwen3_dir, make_llm, generate, hf) -> None:
    (out,) = generate(
        make_llm(qwen3_dir), "greedy n", SamplingParams(n=3, temperature=0.0, seed=9, max_tokens=8, ignore_eos=True)
    )
    expected = hf.greedy(qwen3_dir, out.prompt_token_ids, 8)
    assert [c.token_ids for c in out.outputs] == [expected] * 3


def test_greedy_rows_in_a_mixed_batch_match_hf(qwen3_dir, make_llm, generate, hf) -> None:
    llm = make_llm(qwen3_dir)
    prompts = [f"mixed {i}" for i in range(8)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 == 0 else 1.3, top_k=5 if i % 4 == 1 else -1, max_tokens=10, ignore_eos=True
        )
        for i in range(8)
    ]
    for i, out in enumerate(generate(llm, prompts, params)):
        if i % 2 == 0:
            assert out.outputs[0].token_ids == hf.greedy(qwen3_dir, out.prompt_token_ids, 10)


@pytest.mark.parametrize(
    "settings",
    [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}, {"temperature": 1e-6}, {"top_k": 1, "top_p": 0.99, "min_p": 0.5}],
    ids=["top_k=1", "min_p=1", "top_p~0", "temperature~0", "combined"],
)
def test_degenerate_truncation_is_greedy(qwen3_dir, settings, make_llm, generate, hf) -> None:
    """Settings that leave only the most likely token must reproduce greedy decoding, whatever the seed."""
    llm = make_llm(qwen3_dir)
    params = SamplingParams(**{"temperature": 1.0, **settings}, n=3, max_tokens=10, ignore_eos=True)
    for out in generate(llm, ["degenerate", "Hello, world!"], params):
        expected = hf.greedy(qwen3_dir, out.prompt_token_ids, 10)
        assert [c.token_ids for c in out.outputs] == [expected] * 3


def test_top_k_above_vocab_size_is_no_truncation(qwen3_dir, make_llm, generate) -> None:
    llm = make_llm(qwen3_dir)
    plain, wide = (
        generate(llm, "wide", SamplingParams(temperature=1.0, seed=21, top_k=k, max_tokens=12, ignore_eos=True))[0]
        for k in (-1, 10_000)
    )
    assert plain.outputs[0].token_ids == wide.outputs[0].token_ids


def allowed_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Boolean mask of tokens the settings may emit (temperature, min-p, top-k, top-p, in vLLM's order).

    The engine's logits match these (Hugging Face's) only within the logprob tests' 1e-4, so each bound is loosened
    by what that difference can move it: a logit by 2e-4 (both sides of a comparison), a probability by about 2e-4
    of itself, a mass by 2e-4 of the mass (a slack of 1e-5 on the top-p mass failed CI once, on a token at the edge).
    """
    slack = 1e-3
    x = logits.double() / temperature
    allowed = torch.ones_like(x, dtype=torch.bool)
    if min_p > 0:
        probs = x.softmax(-1)
        allowed &= probs >= probs.max() * min_p * (1 - slack)
    if top_k > 0:
        allowed &= x >= x.masked_fill(~allowed, float("-inf")).topk(top_k).values[-1] - slack
    if top_p < 1:
        probs = x.masked_fill(~allowed, float("-inf")).softmax(-1)
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        allowed &= torch.zeros_like(allowed).scatter(-1, order, mass_before < top_p * (1 + slack))
    return allowed


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 5, 1.0, 0.0), (1.0, -1, 0.5, 0.0), (1.0, -1, 1.0, 0.3), (0.8, 10, 0.9, 0.05), (1.5, 3, 0.6, 0.1)],
    ids=["top_k", "top_p", "min_p", "combined", "combined-hot"],
)
def test_truncation_never_emits_disallowed_tokens(
    qwen3_dir, temperature, top_k, top_p, min_p, make_llm, generate, hf
) -> None:
    llm = make_llm(qwen3_dir)
    params = SamplingParams(
        n=8, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=12, ignore_eos=True
    )
    outputs = generate(llm, ["truncate", "Hello, world!", "z"], params)
    checked = 0
    sizes = []
    for out in outputs:
        for completion in out.outputs:
            ids = out.prompt_token_ids + completion.token_ids
            logits = hf.logits(qwen3_dir, ids)
            for j, token in enumerate(completion.token_ids):
                allowed = allowed_tokens(logits[len(out.prompt_token_ids) - 1 + j], temperature, top_k, top_p, min_p)
                assert allowed[token], f"token {token} at output position {j} is outside the allowed set"
                sizes.append(int(allowed.sum()))
                checked += 1
    assert checked == 3 * 8 * 12
    # The settings must actually cut the vocabulary (else this test checks nothing).
    assert sum(sizes) / len(sizes) < 100
    assert len({t for o in outputs for c in o.outputs for t in c.token_ids}) > 3
