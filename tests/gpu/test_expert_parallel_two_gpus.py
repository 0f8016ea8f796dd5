"""Expert parallel on two GPUs (skipped without two): each rank holds half of a small Qwen3-MoE's experts and the
sparse layers exchange tokens over NCCL; greedy tokens equal one GPU's with every expert (fp32, so the fused kernel's
and the reference experts' roundings stay far below a token flip) and fp32 logprobs stay close; a request on one rank
completes while the other runs dummy forwards. The CPU (gloo) flow is tests/engine/test_expert_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.toy import make_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (one per data-parallel rank)"),
]
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 33, 90, 12)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
COMMON = dict(dtype="float32", device="cuda", num_kv_blocks=256)


def test_expert_parallel_equals_one_gpu(tmp_path) -> None:
    model_dir = str(make_model_dir(tmp_path / "small-moe", preset="small-moe", seed=0))
    single = LLM(model_dir, **COMMON)
    try:
        expected = [o.outputs[0] for o in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        single.shutdown()
    llm = LLM(model_dir, **COMMON, data_parallel_size=2, enable_expert_parallel=True)
    try:
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        (alone,) = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # the other rank runs dummy forwards
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert alone.outputs[0].token_ids == expected[0].token_ids
    for out, ref in zip(outputs, expected, strict=True):
        for position, ref_position, token in zip(out.logprobs, ref.logprobs, out.token_ids, strict=True):
            assert abs(position[token].logprob - ref_position[token].logprob) < 1e-3
