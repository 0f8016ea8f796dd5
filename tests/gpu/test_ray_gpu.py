"""`data_parallel_backend="ray"` on GPUs: each core actor on a bundle of one GPU, which Ray shows it as its cuda:0
(skipped without two CUDA devices or without the `ray` extra). The CPU flow is in tests/on_ray/test_ray.py."""

from __future__ import annotations

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.toy import make_model_dir

ray = pytest.importorskip("ray")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (one per data-parallel rank)"),
]
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 33, 90, 12)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_two_gpu_ranks_on_ray_answer_as_one_core(tmp_path) -> None:
    model = str(make_model_dir(tmp_path / "m", "Qwen3ForCausalLM", seed=0, initializer_range=0.2))
    single = LLM(model, device="cuda", num_kv_blocks=256)
    try:
        expected = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        single.shutdown()
    ray.init(address="local", num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(model, device="cuda", data_parallel_size=2, data_parallel_backend="ray", num_kv_blocks=256)
        try:
            bundles = ray.util.placement_group_table(llm.client.launcher.placement_group)["bundles"]
            assert [bundles[i] for i in range(2)] == [{"GPU": 1.0}, {"GPU": 1.0}]
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
            assert [r["num_requests_routed"] for r in llm.stats()["data_parallel"]] == [2, 2]
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()
