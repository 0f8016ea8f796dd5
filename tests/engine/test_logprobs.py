"""Logprobs in the four modes, prompt logprobs and ranks, against values computed by hand from HF logits.

HF logits come from one forward over prompt + generated tokens, so row P - 1 + j is the distribution the engine
sampled output token j from.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlserve import SamplingParams
from rlserve.outputs import CompletionOutput, PositionLogprobs

ATOL = 1e-4
PROMPTS: list[Any] = ["Hello, world!", "a", {"prompt_token_ids": list(range(100, 137))}, "logprobs, please"]


def hf_rows(hf, path, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """HF logits at the positions that produced each output token: [len(output_ids), vocab]."""
    logits = hf.logits(path, prompt_ids + output_ids)
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(output_ids)]


def processed_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then keep the top_k largest, then the smallest set of those holding top_p of their mass."""
    x = logits.double() / temperature
    kth = x.topk(top_k, dim=-1).values[..., -1:]
    x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return x.masked_fill(~keep, float("-inf"))


def rank_of(values: torch.Tensor, token: int) -> int:
    """vLLM's rank: how many vocabulary entries score at least as high as the token (1 = the best)."""
    return int((values >= values[token]).sum())


def check_position(entry: PositionLogprobs, token: int, reference: torch.Tensor, k: int) -> None:
    """One output position against the reference values (logprobs or logits) of the whole vocabulary."""
    assert token in entry
    assert len(entry) in (k, k + 1)
    assert entry[token].logprob == pytest.approx(float(reference[token]), abs=ATOL)
    assert entry[token].rank == rank_of(reference, token)
    top_values, top_ids = reference.topk(k)
    listed = sorted((e for t, e in entry.items() if t != token or len(entry) == k), key=lambda e: e.rank)
    assert len(listed) == k
    for i in range(k):
        tid, expected = int(top_ids[i]), float(top_values[i])
        if expected == float("-inf"):  # masked tokens tie at -inf: only their value is defined
            assert any(e.logprob == float("-inf") for e in listed)
            continue
        assert tid in entry, f"top-{i + 1} token {tid} missing"
        assert entry[tid].logprob == pytest.approx(expected, abs=ATOL)
        assert entry[tid].rank == (i + 1 if tid != token else rank_of(reference, token))


def check_completion(completion: CompletionOutput, reference_rows: torch.Tensor, k: int) -> None:
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids)
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        check_position(entry, token, reference_rows[j], k)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_raw_logprobs_match_hf(toy_model, temperature, make_llm, generate, hf) -> None:
    _, path = toy_model
    llm = make_llm(path)
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=12, ignore_eos=True, logprobs=5)
    for out in generate(llm, PROMPTS, params):
        (completion,) = out.outputs
        rows = hf_rows(hf, path, out.prompt_token_ids, completion.token_ids).log_softmax(-1)
        check_completion(completion, rows, 5)
        for entry in completion.logprobs:
            assert all(e.decoded_token == llm.get_tokenizer().decode([t]) for t, e in entry.items())
        if temperature == 0.0:
            assert all(entry[t].rank == 1 for t, entry in zip(completion.token_ids, completion.logprobs, strict=True))
        expected_sum = float(rows.gather(-1, torch.tensor(completion.token_ids)[:, None]).sum())
        assert completion.cumulative_logprob == pytest.approx(expected_sum, abs=ATOL * len(completion.token_ids))


def test_logprobs_zero_returns_only_the_sampled_token(qwen3_dir, make_llm, generate, hf) -> None:
    llm = make_llm(qwen3_dir)
    (out,) = generate(llm, "zero", SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=0))
    (completion,) = out.outputs
    rows = hf_rows(hf, qwen3_dir, out.prompt_token_ids, completion.token_ids).log_softmax(-1)
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert list(entry) == [token]
        assert entry[token].logprob == pytest.approx(float(rows[j, token]), abs=ATOL)


def test_no_logprobs_requested(qwen3_dir, make_llm, generate) -> None:
    (out,) = generate(make_llm(qwen3_dir), "none", SamplingParams(max_tokens=4, ignore_eos=True))
    assert out.outputs[0].logprobs is None
    assert out.prompt_logprobs is None


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_modes_match_hand_computed(qwen3_dir, mode, make_llm, generate, hf) -> None:
    temperature, top_k, top_p = 0.7, 12, 0.8
    llm = make_llm(qwen3_dir, logprobs_mode=mode)
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=11, max_tokens=12, ignore_eos=True, logprobs=5
    )
    for out in generate(llm, PROMPTS, params):
        (completion,) = out.outputs
        logits = hf_rows(hf, qwen3_dir, out.prompt_token_ids, completion.token_ids)
        processed = processed_logits(logits, temperature, top_k, top_p)
        reference = processed.log_softmax(-1) if mode == "processed_logprobs" else processed
        for j, token in enumerate(completion.token_ids):
            assert torch.isfinite(reference[j, token]), "sampled a token outside the top-k/top-p set"
        check_completion(completion, reference.float(), 5)


def test_raw_logits_match_hf(toy_model, make_llm, generate, hf) -> None:
    _, path = toy_model
    llm = make_llm(path, logprobs_mode="raw_logits")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=4)
    for out in generate(llm, PROMPTS, params):
        (completion,) = out.outputs
        rows = hf_rows(hf, path, out.prompt_token_ids, completion.token_ids)
        check_completion(completion, rows, 4)
        assert all(entry[t].rank == 1 for t, entry in zip(completion.token_ids, completion.logprobs, strict=True))


def test_raw_logits_ignore_sampling_settings(qwen3_dir, make_llm, generate, hf) -> None:
    """Raw values are captured before temperature and truncation."""
    llm = make_llm(qwen3_dir, logprobs_mode="raw_logits")
    params = SamplingParams(temperature=0.5, top_k=3, seed=1, max_tokens=8, ignore_eos=True, logprobs=4)
    (out,) = generate(llm, "raw", params)
    rows = hf_rows(hf, qwen3_dir, out.prompt_token_ids, out.outputs[0].token_ids)
    check_completion(out.outputs[0], rows, 4)


@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, {"max_num_batched_tokens": 8}, {"block_size": 4, "num_kv_blocks": 16, "max_model_len": 64}],
    ids=["default", "chunked", "preempt"],
)
def test_prompt_logprobs_match_hf(toy_model, engine_kwargs, make_llm, generate, hf, tracked) -> None:
    _, path = toy_model
    preempting = "num_kv_blocks" in engine_kwargs
    # Only the preempting engine is inspected (its requests' preemptions): it alone runs in process.
    llm = make_llm(path, in_process=preempting, **engine_kwargs)
    requests = tracked(llm) if preempting else []
    prompts: list[Any] = ["Hello, world!", "a", {"prompt_token_ids": list(range(100, 137))}, "prompt logprobs"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=3, logprobs=1)
    # Twice: the second round must not be served from the prefix cache, which holds no prompt logprobs.
    for _ in range(2):
        for out in generate(llm, prompts, params):
            ids = out.prompt_token_ids
            assert out.prompt_logprobs is not None
            assert len(out.prompt_logprobs) == len(ids)
            assert out.prompt_logprobs[0] is None
            rows = hf.logits(path, ids).log_softmax(-1)
            for p in range(1, len(ids)):
                check_position(out.prompt_logprobs[p], ids[p], rows[p - 1], 3)
            assert out.outputs[0].token_ids == hf.greedy(path, ids, 16)
    if preempting:  # recomputed prompts must not emit their prompt logprobs twice
        assert sum(r.num_preemptions for r in requests) > 0


def test_prompt_logprobs_with_n_samples(qwen3_dir, make_llm, generate, hf) -> None:
    llm = make_llm(qwen3_dir)
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    (out,) = generate(llm, "three samples", params)
    assert len(out.outputs) == 3
    rows = hf.logits(qwen3_dir, out.prompt_token_ids).log_softmax(-1)
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for p in range(1, len(out.prompt_token_ids)):
        check_position(out.prompt_logprobs[p], out.prompt_token_ids[p], rows[p - 1], 2)


@pytest.mark.parametrize("model", ["qwen3", "qwen3-tied"])
def test_fp32_lm_head(model, model_dirs, make_llm, generate, hf) -> None:
    path = model_dirs[model]
    llm = make_llm(path, lm_head_dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    for out in generate(llm, PROMPTS, params):
        (completion,) = out.outputs
        assert completion.token_ids == hf.greedy(path, out.prompt_token_ids, 12)
        rows = hf_rows(hf, path, out.prompt_token_ids, completion.token_ids).log_softmax(-1)
        check_completion(completion, rows, 3)


def test_mixed_logprob_requests_in_one_batch(qwen3_dir, make_llm, generate, hf) -> None:
    """Rows asking for different k (or none) share one sampler call; each gets exactly what it asked for."""
    llm = make_llm(qwen3_dir)
    ks = [None, 0, 2, 7]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=k) for k in ks]
    outputs = generate(llm, ["k none", "k zero", "k two", "k seven"], params)
    for k, out in zip(ks, outputs, strict=True):
        (completion,) = out.outputs
        if k is None:
            assert completion.logprobs is None
            continue
        rows = hf_rows(hf, qwen3_dir, out.prompt_token_ids, completion.token_ids).log_softmax(-1)
        if k == 0:
            assert all(list(e) == [t] for t, e in zip(completion.token_ids, completion.logprobs, strict=True))
        else:
            check_completion(completion, rows, k)
