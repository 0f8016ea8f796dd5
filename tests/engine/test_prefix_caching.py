"""Prefix caching changes nothing in the outputs and does hit: shared prefixes, multi-turn prompts, resets."""

from __future__ import annotations

import pytest

from rlserve import SamplingParams

BLOCK = 4
SYSTEM = "You are a helpful assistant. Answer briefly. "  # 45 byte tokens: 11 full blocks of 4
QUESTIONS = ["What is 2+2?", "Name a colour.", "Why?"]


def greedy(max_tokens: int = 10, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_outputs_identical_with_and_without_prefix_caching(qwen3_dir, make_llm, generate, hf) -> None:
    results = {}
    for enabled in (True, False):
        llm = make_llm(qwen3_dir, block_size=BLOCK, enable_prefix_caching=enabled)
        rounds = []
        for _ in range(2):  # the second round is where the cache serves the shared prefix
            outs = generate(llm, [SYSTEM + q for q in QUESTIONS], greedy(logprobs=2))
            rounds.append([(o.outputs[0].token_ids, o.outputs[0].logprobs, o.num_cached_tokens) for o in outs])
        results[enabled] = rounds
        if not enabled:
            assert llm.stats()["prefix_cache_hits"] == 0
            assert all(cached == 0 for r in rounds for _, _, cached in r)

    for cached_round, plain_round in zip(results[True], results[False], strict=True):
        for (tokens, logprobs, _), (plain_tokens, plain_logprobs, _) in zip(cached_round, plain_round, strict=True):
            assert tokens == plain_tokens
            for a, b in zip(logprobs, plain_logprobs, strict=True):
                assert a.keys() == b.keys()
                for t in a:
                    assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)
    tokenizer = make_llm(qwen3_dir).get_tokenizer()
    for q, (tokens, _, _) in zip(QUESTIONS, results[True][1], strict=True):
        assert tokens == hf.greedy(qwen3_dir, tokenizer(SYSTEM + q).input_ids, 10)


def test_shared_prefix_hits_in_a_later_call(qwen3_dir, make_llm, generate, hf) -> None:
    llm = make_llm(qwen3_dir, block_size=BLOCK)
    (first,) = generate(llm, SYSTEM + QUESTIONS[0], greedy())
    assert first.num_cached_tokens == 0
    hits_before = llm.stats()["prefix_cache_hits"]

    (second,) = generate(llm, SYSTEM + QUESTIONS[1], greedy())
    shared = len(llm.get_tokenizer()(SYSTEM).input_ids)
    # SYSTEM's full blocks; the block that straddles into the question differs between the two prompts.
    assert second.num_cached_tokens == shared // BLOCK * BLOCK
    assert llm.stats()["prefix_cache_hits"] - hits_before == second.num_cached_tokens
    assert second.outputs[0].token_ids == hf.greedy(qwen3_dir, second.prompt_token_ids, 10)


def test_identical_request_hits_all_but_the_last_token(qwen3_dir, make_llm, generate, hf) -> None:
    llm = make_llm(qwen3_dir, block_size=BLOCK)
    prompt = SYSTEM + QUESTIONS[2]
    (first,) = generate(llm, prompt, greedy())
    (second,) = generate(llm, prompt, greedy())
    n = len(first.prompt_token_ids)
    # The last prompt token is always recomputed so there is a position to sample from.
    assert second.num_cached_tokens == (n - 1) // BLOCK * BLOCK
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_multi_turn_prompt_hits_generated_tokens(qwen3_dir, make_llm, generate, hf) -> None:
    """Blocks filled by generated tokens are cached too, so the next turn reuses the whole conversation."""
    llm = make_llm(qwen3_dir, block_size=BLOCK)
    (turn1,) = generate(llm, SYSTEM + QUESTIONS[0], greedy(max_tokens=17))
    history = turn1.prompt_token_ids + turn1.outputs[0].token_ids
    (turn2,) = generate(llm, {"prompt_token_ids": history + [10, 11, 12]}, greedy())
    # Every position of turn 1 except its last sampled token (never fed back) had its KV computed.
    assert turn2.num_cached_tokens == (len(history) - 1) // BLOCK * BLOCK
    assert turn2.num_cached_tokens > len(turn1.prompt_token_ids)
    assert turn2.outputs[0].token_ids == hf.greedy(qwen3_dir, turn2.prompt_token_ids, 10)


def test_reset_prefix_cache(qwen3_dir, make_llm, generate) -> None:
    llm = make_llm(qwen3_dir, block_size=BLOCK)
    prompt = SYSTEM + QUESTIONS[0]
    (first,) = generate(llm, prompt, greedy())
    (hit,) = generate(llm, prompt, greedy())
    assert hit.num_cached_tokens > 0
    llm.reset_prefix_cache()
    (after_reset,) = generate(llm, prompt, greedy())
    assert after_reset.num_cached_tokens == 0
    assert after_reset.outputs[0].token_ids == first.outputs[0].token_ids
    # The recomputed blocks are cached again.
    (again,) = generate(llm, prompt, greedy())
    assert again.num_cached_tokens == hit.num_cached_tokens


def test_concurrent_requests_with_a_shared_prefix(qwen3_dir, make_llm, generate, hf) -> None:
    """Requests in one call that share a prefix with a finished one take the same cached blocks together."""
    llm = make_llm(qwen3_dir, block_size=BLOCK)
    generate(llm, SYSTEM, greedy(max_tokens=2))
    outs = generate(llm, [SYSTEM + q for q in QUESTIONS] * 2, greedy())
    for out in outs:
        assert out.num_cached_tokens > 0
        assert out.outputs[0].token_ids == hf.greedy(qwen3_dir, out.prompt_token_ids, 10)


def test_equal_blocks_after_different_prefixes_do_not_hit(qwen3_dir, make_llm, generate, hf) -> None:
    """A cached block is reusable only with its whole prefix: same tokens at the same position after a different
    first block must be recomputed."""
    llm = make_llm(qwen3_dir, block_size=BLOCK)
    shared_tail = [7, 8, 9, 10] * 4  # four equal full blocks
    (first,) = generate(llm, {"prompt_token_ids": [1, 2, 3, 4] + shared_tail + [5]}, greedy())
    (second,) = generate(llm, {"prompt_token_ids": [1, 2, 3, 99] + shared_tail + [5]}, greedy())
    assert second.num_cached_tokens == 0
    for out in (first, second):
        assert out.outputs[0].token_ids == hf.greedy(qwen3_dir, out.prompt_token_ids, 10)
    # Repeated blocks inside one prompt hit only as a prefix of the cached prompt.
    (third,) = generate(llm, {"prompt_token_ids": shared_tail + [5]}, greedy())
    assert third.num_cached_tokens == 0
    assert third.outputs[0].token_ids == hf.greedy(qwen3_dir, third.prompt_token_ids, 10)


def test_tight_cache_evicts_and_still_matches_hf(qwen3_dir, make_llm, generate, hf) -> None:
    """With few blocks, cached prefixes are evicted and their blocks reused for other content across rounds."""
    llm = make_llm(qwen3_dir, block_size=BLOCK, num_kv_blocks=16, max_model_len=64)
    prefixes = [list(range(10, 30)), list(range(100, 120))]
    hits = 0
    for round_ in range(3):
        prompts = [{"prompt_token_ids": p + [200 + round_, 201 + i]} for i, p in enumerate(prefixes * 2)]
        for out in generate(llm, prompts, greedy(max_tokens=12)):
            hits += out.num_cached_tokens
            assert out.outputs[0].token_ids == hf.greedy(qwen3_dir, out.prompt_token_ids, 12)
    assert hits > 0


@pytest.mark.parametrize(
    "kwargs",
    [{"async_scheduling": False}, {}, {"max_num_seqs": 2}],
    ids=["sync", "async", "max-num-seqs-2"],
)
def test_samples_of_one_prompt_compute_it_once(qwen3_dir, make_llm, generate, tracked, kwargs) -> None:
    """GRPO's n samples of a prompt arrive together: one computes the prompt, the others wait a step and take its
    blocks from the cache (all full blocks but the one holding the last token), with unchanged outputs."""
    prompt = {"prompt_token_ids": list(range(3, 3 + 64))}
    params = SamplingParams(n=8, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=0)
    reference = generate(make_llm(qwen3_dir, enable_prefix_caching=False), [prompt], params)[0]

    llm = make_llm(qwen3_dir, in_process=True, **kwargs)  # in process: each sample's cached tokens are read off
    requests = tracked(llm)
    out = generate(llm, [prompt], params)[0]

    assert sorted(r.num_cached_tokens for r in requests) == [0] + [48] * 7
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in reference.outputs]
    assert out.num_cached_tokens == 48
