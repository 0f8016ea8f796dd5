"""grouped_prefix_attention at engine level on the CPU (the reference backend splits attention as the Triton path
does): GRPO groups form from the prefix cache's shared blocks, and tokens and logprobs equal the per-sequence path's."""

from __future__ import annotations

import pytest

from rlserve import SamplingParams
from rlserve.config import EngineConfig

# Two prompts of 100 and 90 tokens: 6 and 5 whole blocks of 16, both above the grouping minimum.
PROMPTS = [{"prompt_token_ids": list(range(5, 105))}, {"prompt_token_ids": list(range(100, 190))}]
PARAMS = SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=12, logprobs=2, ignore_eos=True)


def run(llm, generate) -> tuple[list, list]:
    """The samples of PROMPTS, and the groups each decode attention call was given (their number, their shared
    tokens, their members in all)."""
    backend = llm.engine_core.runner.backend
    seen, forward = [], backend.forward

    def recording(q, k, v, k_cache, v_cache, meta, scale):
        groups = meta.prefix_groups
        if groups is not None:
            items = groups.items.tolist()
            seen.append((groups.num_groups, sorted({shared for _, _, shared in items}), sum(n for _, n, _ in items)))
        return forward(q, k, v, k_cache, v_cache, meta, scale)

    backend.forward = recording
    outputs = generate(llm, PROMPTS, PARAMS)
    return [(c.token_ids, c.logprobs) for o in outputs for c in o.outputs], seen


def test_groups_of_samples_give_the_per_sequence_results(qwen3_dir, make_llm, generate):
    grouped, seen = run(make_llm(qwen3_dir, in_process=True, grouped_prefix_attention=True), generate)
    plain, seen_plain = run(make_llm(qwen3_dir, in_process=True), generate)
    assert seen_plain == []
    # Each prompt's samples are grouped over its prompt's whole blocks (all 8 while all decode; the sample that
    # computed the prompt runs a step ahead of the 7 that found it cached, so the last step has 7).
    assert seen and all(num_groups == 2 and shared == [80, 96] for num_groups, shared, _ in seen)
    assert max(members for _, _, members in seen) == 16
    assert len(grouped) == len(plain) == 16
    for (tokens, logprobs), (plain_tokens, plain_logprobs) in zip(grouped, plain, strict=True):
        assert tokens == plain_tokens
        for a, b in zip(logprobs, plain_logprobs, strict=True):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)


@pytest.mark.parametrize(
    ("other", "named"),
    [({"batch_invariant": True}, "batch_invariant"), ({"tensor_parallel_size": 2}, "tensor_parallel")],
)
def test_refused_where_not_implemented(model_names_as_dirs, other, named):
    with pytest.raises(ValueError, match=f"grouped_prefix_attention: not with {named}"):
        EngineConfig(model="m", device="cpu", grouped_prefix_attention=True, **other)
