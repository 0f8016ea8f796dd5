"""The fused Triton kernels compiled on a GPU, at the benchmark model's shapes, against their PyTorch code.

The CPU interpreter tests (tests/model) check the logic; these check what the compiler made of it (FMA contraction,
approximate rsqrt/exp/log) and the sampler's distribution over many draws.
"""

from __future__ import annotations

import pytest
import torch

from rlserve.model.layers import RMSNorm, RotaryEmbedding, norm_and_rotate_qk, silu_and_mul
from rlserve.model.sampler import Sampler, SamplingMetadata

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

T, HIDDEN, HQ, HK, D, INTER = 1024, 1024, 16, 8, 128, 3072


def _close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within a bf16 rounding of the operands (values are O(1); rotary's differences cancel), and nearly all
    bit-identical."""
    assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=2**-5)
    assert (got == want).float().mean() > 0.95


def _reference(fn):
    with torch.enable_grad():  # autograd on: layers.py runs its PyTorch code
        return fn()


def _fused(fn):
    with torch.no_grad():  # autograd off: layers.py runs the fused kernels
        return fn()


def test_norm_rotary_silu_match_pytorch() -> None:
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    norm = RMSNorm(HIDDEN, 1e-6).to(dev, dt)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(T, HIDDEN, device=dev, dtype=dt), torch.randn(T, HIDDEN, device=dev, dtype=dt)
    got = _fused(lambda: norm.add_and_norm(x, residual))
    want = _reference(lambda: norm.add_and_norm(x, residual))
    assert torch.equal(got[1], want[1])
    _close_in_bf16(got[0], want[0])

    rotary = RotaryEmbedding(D, 4096, 1e6, dev)
    q_norm, k_norm = RMSNorm(D, 1e-6).to(dev, dt), RMSNorm(D, 1e-6).to(dev, dt)
    qkv = torch.randn(T, (HQ + 2 * HK) * D, device=dev, dtype=dt)
    positions = torch.randint(0, 4096, (T,), device=dev)

    def split(t):
        return t[:, : HQ * D].view(T, HQ, D), t[:, HQ * D : (HQ + HK) * D].view(T, HK, D)

    want_q, want_k = _reference(lambda: norm_and_rotate_qk(positions, *split(qkv.clone()), rotary, (q_norm, k_norm)))
    got_q, got_k = _fused(lambda: norm_and_rotate_qk(positions, *split(qkv.clone()), rotary, (q_norm, k_norm)))
    _close_in_bf16(got_q, want_q)
    _close_in_bf16(got_k, want_k)

    gate_up = torch.randn(T, 2 * INTER, device=dev, dtype=dt)
    _close_in_bf16(_fused(lambda: silu_and_mul(gate_up)), _reference(lambda: silu_and_mul(gate_up)))


def _meta(temperature: torch.Tensor, greedy: torch.Tensor, num_logprobs: int) -> SamplingMetadata:
    n = temperature.shape[0]
    return SamplingMetadata(
        temperature=temperature,
        greedy=greedy,
        top_k=None,
        top_p=None,
        min_p=None,
        generators=[None] * n,
        min_tokens_mask=[],
        max_num_logprobs=num_logprobs,
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
    )


@torch.inference_mode()
def test_fused_sampler_matches_pytorch_path() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    n, vocab = 64, 151_936
    logits = (torch.randn(n, vocab, device=dev) * 4).to(torch.bfloat16)
    greedy = torch.arange(n, device=dev) % 2 == 0
    temperature = torch.where(greedy, 1.0, 0.7).float()
    for mode in ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"):
        sampler = Sampler(mode)
        fused = sampler(logits, _meta(temperature, greedy, 0))
        # The mode's values computed in PyTorch, scoring the fused path's tokens.
        values = logits.float()
        if mode.startswith("processed"):
            values = torch.where(greedy[:, None], values, values / temperature[:, None])
        if mode.endswith("logprobs"):
            values = values.log_softmax(-1)
        token_values = values.gather(-1, fused.token_ids[:, None])[:, 0]
        ranks = (values >= token_values[:, None]).sum(-1)
        assert torch.equal(fused.token_ids[greedy], logits.float().argmax(-1)[greedy])
        assert torch.allclose(fused.logprobs.token_values, token_values, atol=1e-4, rtol=1e-5)
        assert (fused.logprobs.token_ranks - ranks).abs().max() <= 1  # ties within rounding may differ


@torch.inference_mode()
def test_fused_sampler_distribution() -> None:
    dev = torch.device("cuda")
    rows, temperature = 1 << 17, 0.7
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, 1.5, -2.0], device=dev)
    logits = base.expand(rows, -1).contiguous()
    meta = _meta(torch.full((rows,), temperature, device=dev), torch.zeros(rows, dtype=torch.bool, device=dev), -1)
    tokens = Sampler("raw_logprobs")(logits, meta).token_ids
    freq = torch.bincount(tokens, minlength=8).float() / rows
    expected = (base / temperature).softmax(-1)
    assert (freq - expected).abs().max() < 0.01, (freq, expected)
