"""Tensor parallel over NCCL with CUDA graphs (skipped without two GPUs: NCCL refuses two ranks on one GPU). The same
flows over gloo run everywhere in tests/engine/test_tensor_parallel.py.

    python -m pytest -q tests/gpu/test_tensor_parallel_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.toy import make_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one rank per GPU)"),
]
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40, 129)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_model_dir(tmp_path_factory.mktemp("tp"), preset="small", seed=3, initializer_range=0.2))


def _outputs(llm: LLM, prompts=PROMPTS):
    return [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _logprobs(out) -> list[float]:
    return [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]


def test_two_gpus_equal_one_with_cuda_graphs(model_dir) -> None:
    """fp32, decode in CUDA graphs whose captures hold NCCL all-reduces; then sleep and wake (graphs re-captured)."""
    one = LLM(model_dir, dtype="float32", device="cuda", num_kv_blocks=512)
    expected = _outputs(one)
    one.shutdown()
    two = LLM(model_dir, dtype="float32", device="cuda", num_kv_blocks=512, tensor_parallel_size=2)
    try:
        assert two.get_world_size() == 2
        for _ in range(2):
            got = _outputs(two)
            for g, e in zip(got, expected, strict=True):
                assert g.token_ids == e.token_ids
                assert max(abs(a - b) for a, b in zip(_logprobs(g), _logprobs(e), strict=True)) < 1e-4
            two.sleep(level=1)
            two.wake_up()
    finally:
        two.shutdown()


def test_batch_invariant_two_gpus_same_bits_whatever_the_batch(model_dir) -> None:
    """bf16, batch-invariant: a request alone and inside a batch gives the same tokens and logprobs, run to run."""
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", tensor_parallel_size=2, batch_invariant=True)
    try:
        alone = _outputs(llm, PROMPTS[-1:])[0]
        batch = _outputs(llm, PROMPTS * 8)
        for out in batch[len(PROMPTS) - 1 :: len(PROMPTS)]:
            assert out.token_ids == alone.token_ids and _logprobs(out) == _logprobs(alone)
    finally:
        llm.shutdown()
