"""Greedy decoding equals Hugging Face generate(do_sample=False) token for token, however the engine batches.

Covered: Llama, Qwen2, Qwen3, tied embeddings and a sharded checkpoint; prompts of very different lengths given as
strings and as token ids, each with its own max_tokens; plain batching, chunked prefill, and a KV cache so small that
requests are preempted and recomputed (with and without prefix caching).
"""

from __future__ import annotations

from typing import Any

import pytest

from rlserve import SamplingParams

PROMPTS: list[Any] = [
    "Hello, world!",
    "a",
    "The quick brown fox jumps over the lazy dog.",
    {"prompt_token_ids": [5, 17, 200, 33, 90]},
    "rlserve batches requests of any length",
    {"prompt_token_ids": list(range(40, 70))},
    {"prompt": "a dict with text"},
]
MAX_TOKENS = [8, 24, 16, 12, 20, 10, 14]

PREEMPTING = {"block_size": 4, "num_kv_blocks": 16, "max_model_len": 64}
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "no-async-scheduling": {"async_scheduling": False},
    "chunked": {"max_num_batched_tokens": 8},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "max-num-seqs-2": {"max_num_seqs": 2},
    "no-chunked-prefill": {"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 64},
    "preempt": PREEMPTING,
    "preempt-chunked-no-prefix-cache": {**PREEMPTING, "max_num_batched_tokens": 8, "enable_prefix_caching": False},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_hf(toy_model, config, make_llm, generate, hf, tracked) -> None:
    _, path = toy_model
    kwargs = CONFIGS[config]
    llm = make_llm(path, in_process=True, **kwargs)  # in process: the preemptions are read off the requests
    requests = tracked(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outputs = generate(llm, PROMPTS, params)

    tokenizer = llm.get_tokenizer()
    max_model_len = kwargs.get("max_model_len", 1024)
    assert len(outputs) == len(PROMPTS)
    for prompt, max_tokens, out in zip(PROMPTS, MAX_TOKENS, outputs, strict=True):
        text = prompt if isinstance(prompt, str) else prompt.get("prompt")
        if text is not None:
            assert out.prompt == text
            assert out.prompt_token_ids == tokenizer(text).input_ids
        else:
            assert out.prompt is None
            assert out.prompt_token_ids == prompt["prompt_token_ids"]
        expected_len = min(max_tokens, max_model_len - len(out.prompt_token_ids))
        expected = hf.greedy(path, out.prompt_token_ids, expected_len)
        (completion,) = out.outputs
        assert completion.token_ids == expected, f"prompt {prompt!r}"
        assert completion.finish_reason == "length"

    preemptions = sum(r.num_preemptions for r in requests)
    assert len(requests) == len(PROMPTS)
    if "num_kv_blocks" in kwargs:
        assert preemptions > 0, "the tight KV cache was meant to force preemption"
    else:
        assert preemptions == 0


def test_greedy_repeated_calls_are_stable(qwen3_dir, make_llm, generate, hf) -> None:
    """The same engine serves later calls identically (prefix-cache hits, reused blocks)."""
    llm = make_llm(qwen3_dir, block_size=4, num_kv_blocks=64, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in generate(llm, PROMPTS, params)]
    second = [o.outputs[0].token_ids for o in generate(llm, PROMPTS[::-1], params)][::-1]
    assert first == second
    for prompt_out, tokens in zip(generate(llm, PROMPTS, params), first, strict=True):
        assert tokens == hf.greedy(qwen3_dir, prompt_out.prompt_token_ids, 12)
