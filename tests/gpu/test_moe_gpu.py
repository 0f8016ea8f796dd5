"""Qwen3-MoE on a GPU: the fused MoE kernel compiled at Qwen3-30B-A3B's expert shapes against its PyTorch reference,
in bf16 and with FP8 experts, its batch invariance, CUDA-graph capture, and the engine (CUDA graphs on) against the
CPU reference path and HF."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.model.fp8 import ExpertScales, Fp8Scheme
from rlserve.model.moe import experts_reference, route
from rlserve.toy import make_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E, K, H, I = 128, 8, 2048, 768  # noqa: E741  (Qwen3-30B-A3B's experts)


def _problem(num_tokens: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(num_tokens, H, generator=gen, device=dev).to(dt)
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device=dev) * H**-0.5).to(dt)
    w2 = (torch.randn(E, H, I, generator=gen, device=dev) * I**-0.5).to(dt)
    weights, ids = route(torch.randn(num_tokens, E, generator=gen, device=dev), K, norm_topk_prob=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 1000])
def test_fused_moe_matches_the_reference(num_tokens):
    from rlserve.model.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _problem(num_tokens)
    with torch.inference_mode():
        got = fused_moe(x, w13, w2, weights, ids)
        want = experts_reference(x, w13, w2, weights, ids)
    assert torch.allclose(got.float(), want.float(), rtol=2**-6, atol=2**-6), (got - want).abs().max()


@pytest.mark.parametrize("method", ["fp8", "fbgemm_fp8"])
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
def test_fused_moe_in_fp8_is_as_accurate_as_the_reference(num_tokens, method):
    """FP8 experts (each expert quantized, its scales stacked) through the fused kernel and through
    experts_reference's FP8 projections (the scaled GEMM on the same quantized operands), each against the exact
    experts on the dequantized weights in fp32. The two FP8 paths cannot agree bit for bit: each quantizes its
    activations (x, and the activation between the GEMMs) itself, from bf16 values whose roundings differ in summation
    order, so a value on a rounding edge lands one fp8 step apart (a relative 1-1.4% between the two paths by norm, seen
    on an H100, 2026-12-07). What must hold is that the fused kernel loses no more than the reference does; a wrong
    scale, expert or routing weight would be off by far more."""
    from rlserve.model.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _problem(num_tokens)
    scheme = Fp8Scheme(method)
    quantized, exact_weights = [], []
    for w in (w13, w2):
        q, scales = zip(*(scheme.quantize(expert) for expert in w), strict=True)
        exact_weights.append(torch.stack([scheme.dequantize(*pair) for pair in zip(q, scales, strict=True)]))
        stacked = torch.stack(scales)
        quantized.append((torch.stack(q), stacked if scheme.block_wise else stacked.squeeze(-1)))
    (q13, s13), (q2, s2) = quantized
    fp8 = ExpertScales(scheme, s13, s2)
    with torch.inference_mode():
        got = fused_moe(x, q13, q2, weights, ids, fp8=fp8).float()
        want = experts_reference(x, q13, q2, weights, ids, fp8=fp8).float()
        exact = experts_reference(x.float(), *exact_weights, weights, ids, out_dtype=torch.float32)

    def error(y: torch.Tensor) -> float:
        return ((y - exact).norm() / exact.norm()).item()

    assert error(want) < 2**-3, error(want)  # FP8 activations (3 mantissa bits), twice: about 4-5% by norm
    assert error(got) <= 1.25 * error(want) + 2**-10, (error(got), error(want))


def test_batch_invariant_kernel_rows_do_not_depend_on_the_batch():
    from rlserve.model.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _problem(300, seed=1)
    with torch.inference_mode():
        full = fused_moe(x, w13, w2, weights, ids, batch_invariant=True)
        for rows in (slice(0, 1), slice(5, 12), slice(100, 300)):
            assert torch.equal(fused_moe(x[rows], w13, w2, weights[rows], ids[rows], batch_invariant=True), full[rows])


def test_fused_moe_replays_in_a_cuda_graph():
    from rlserve.model.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _problem(16, seed=2)
    with torch.inference_mode():
        eager = fused_moe(x, w13, w2, weights, ids)
        graph = torch.cuda.CUDAGraph()
        fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
        with torch.cuda.graph(graph):
            out = fused_moe(x, w13, w2, weights, ids)
        x2, _, _, weights2, ids2 = _problem(16, seed=3)
        x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_moe(x, w13, w2, weights, ids))
        assert not torch.equal(out, eager)


def test_engine_with_cuda_graphs_equals_cpu_and_returns_the_same_routing(tmp_path):
    model_dir = make_model_dir(tmp_path / "moe", preset="small-moe", seed=3, initializer_range=0.2)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40, 129)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    common = dict(dtype="float32", enable_return_routed_experts=True, num_kv_blocks=256)
    cpu = [o.outputs[0] for o in LLM(str(model_dir), device="cpu", **common).generate(prompts, params)]
    gpu = [o.outputs[0] for o in LLM(str(model_dir), device="cuda", **common).generate(prompts, params)]
    for c, g in zip(cpu, gpu, strict=True):
        assert g.token_ids == c.token_ids
        np.testing.assert_array_equal(g.routed_experts, c.routed_experts)
