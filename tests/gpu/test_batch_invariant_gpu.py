"""Batch-invariant mode on CUDA (bf16, CUDA graphs on): a request's tokens and logprobs do not depend on its batch
or on how its prompt is split into steps, and equal rlserve's batch-invariant trainer-side forward bit for bit."""

from __future__ import annotations

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.rl.train_forward import load_training_model
from rlserve.rl.trainer_logprobs import trainer_logprobs
from rlserve.toy import make_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEMPERATURE = 0.7
TARGET = list(range(30, 30 + 200))  # a full 128-key attention tile (the batch-invariant one) and a partial one
# 80 other requests of many lengths: linear layers see several 64-row tiles, decode batches shrink as they finish.
OTHERS = [[(200 + i + j) % 250 for j in range(1 + (i * 37) % 150)] for i in range(80)]  # the vocabulary has 259


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model_dir(tmp_path_factory.mktemp("bi"), preset="small", seed=11))


def run(llm: LLM, prompts, seeds, max_tokens: int = 40):  # a seed of None: unseeded
    params = [
        SamplingParams(temperature=TEMPERATURE, seed=s, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
        for s in seeds
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for out in outputs:
        sample = out.outputs[0]
        results.append(
            (list(sample.token_ids), [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)])
        )
    return results


def engine(model_dir: str, **kwargs) -> LLM:
    return LLM(
        model_dir, dtype="bfloat16", device="cuda", num_kv_blocks=4096, batch_invariant=True,
        logprobs_mode="processed_logprobs", **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("lm_head_dtype", [None, "float32"])
def test_batch_invariant_on_cuda(model_dir, lm_head_dtype) -> None:
    llm = engine(model_dir, lm_head_dtype=lm_head_dtype)
    alone = run(llm, [TARGET], [7])[0]
    batch = run(llm, OTHERS[:40] + [TARGET] + OTHERS[40:], [*range(100, 140), 7, *range(140, 180)])
    assert batch[40] == alone
    assert run(llm, [TARGET], [7])[0] == alone  # prefix-cache hit for its full blocks
    chunked = engine(model_dir, lm_head_dtype=lm_head_dtype, max_num_batched_tokens=48, enable_prefix_caching=False)
    assert run(chunked, OTHERS[:6] + [TARGET], [*range(6), 7])[6] == alone

    if lm_head_dtype is None:  # the trainer-side forward computes the head in the model's dtype
        assert_trainer_agrees(model_dir, [TARGET, *OTHERS[:40]], [alone, *batch[:40]])


def assert_trainer_agrees(model_dir: str, prompts: list[list[int]], results: list) -> None:
    trainer = load_training_model(model_dir, torch.bfloat16, "cuda", batch_invariant=True)
    mine = trainer_logprobs(trainer, prompts, [t for t, _ in results], temperature=TEMPERATURE, processed=True)
    for (_, engine_logprobs), values in zip(results, mine, strict=True):
        assert engine_logprobs == values.tolist()


def test_unseeded_requests_logprobs_equal_the_trainers_on_cuda(model_dir) -> None:
    """Unseeded temperature-only requests take their tokens from the fused sampling kernel
    (Sampler._sample_fused_tokens); their logprobs still come from the PyTorch passes, the trainer's bit for bit."""
    prompts = [TARGET, *OTHERS[:40]]
    results = run(engine(model_dir), prompts, [None] * len(prompts))
    assert_trainer_agrees(model_dir, prompts, results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_trainer_gradients_on_cuda(model_dir, dtype) -> None:
    """The batch-invariant trainer forward under autograd (Triton matmul, fused kernels and varlen attention, each
    with its PyTorch backward): the bits of the same forward without autograd, and the regular forward's gradients."""
    prompts, completions = [TARGET, *OTHERS[:20]], [OTHERS[30 + i][:24] for i in range(21)]
    exact_model = load_training_model(model_dir, dtype, "cuda", batch_invariant=True)
    exact = trainer_logprobs(exact_model, prompts, completions, temperature=TEMPERATURE, processed=True)
    with torch.no_grad():
        no_grad = trainer_logprobs(exact_model, prompts, completions, temperature=TEMPERATURE, processed=True)
    assert all(torch.equal(e.detach(), n) for e, n in zip(exact, no_grad, strict=True))
    regular_model = load_training_model(model_dir, dtype, "cuda")
    regular = trainer_logprobs(regular_model, prompts, completions, temperature=TEMPERATURE, processed=True)
    for values in (exact, regular):
        torch.stack([v.sum() for v in values]).sum().backward()
    # fp32: the same function at values ~1e-6 apart; bf16: values a few bf16 ulps apart, so the gradients agree in
    # direction and size, not in their bits.
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    for (name, p), q in zip(exact_model.named_parameters(), regular_model.parameters(), strict=True):
        difference = (p.grad.float() - q.grad.float()).norm() / q.grad.float().norm()
        assert q.grad.norm() > 0 and difference <= tolerance, (name, float(difference))


@pytest.mark.parametrize(("n", "k"), [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)])
def test_matmul_rows_do_not_depend_on_the_batch_at_qwen3_shapes(n, k) -> None:
    """Each weight of Qwen3-0.6B with the tile `tile_for` gives it (wide for qkv, gate_up and the LM head, narrow for
    o_proj and down_proj): a row's bits alone, in any batch and at any place in a tile."""
    from rlserve.model.kernels.batch_invariant_matmul import matmul

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1100, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    full = matmul(x, w)
    torch.testing.assert_close(full.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
    for rows in (1, 7, 64, 65, 127, 129, 300, 1024):
        assert torch.equal(matmul(x[:rows], w), full[:rows]), rows
        assert torch.equal(matmul(x[-rows:], w), full[-rows:]), rows
