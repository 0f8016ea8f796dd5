"""CPU checks of the fused Triton kernels (rlserve.model.kernels.fused_ops) under TRITON_INTERPRET=1 against the PyTorch
code in rlserve.model.layers, which is their reference and the CPU path.

Each kernel must reproduce the reference's roundings, so bf16 results may differ by at most one ulp and the residual
sum not at all. Inputs are strided views where the engine feeds them (q/k inside a fused qkv output), and whatever
the kernels must not touch (v, padding columns) is checked to be unchanged. A last check runs a tiny decoder with the
fused kernels switched on against the PyTorch path, which covers the wiring in the model's forward.

interpret_helpers.py sets the interpreter up (or re-runs these checks in a fresh process where triton was imported
before it could).
"""

from __future__ import annotations

import interpret_helpers  # first: sets TRITON_INTERPRET before anything imports triton
import pytest
import torch

interpret_helpers.require_triton()


from rlserve.model import layers  # noqa: E402
from rlserve.model.attention.base import AttentionMetadata  # noqa: E402
from rlserve.model.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from rlserve.model.forward_context import ForwardContext  # noqa: E402
from rlserve.model.kernels import fused_ops  # noqa: E402
from rlserve.model.models.llama import DecoderForCausalLM, DecoderSpec  # noqa: E402

interpreted = interpret_helpers.interpreted

if not interpret_helpers.IN_PROCESS:

    def test_in_fresh_process():
        interpret_helpers.run_in_fresh_process(__file__)


# bf16: one ulp (|a - b| <= eps * |b| allows exactly that); fp32: a few ulp of fp32 sums' order and rsqrt/exp.
TOLERANCES = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-6, rtol=2**-7)}
# Share of bf16 elements that must be bit-identical: only an fp32 difference that straddles a bf16 rounding boundary
# may flip one, while a rounding step left out or added shifts many.
MIN_EXACT_BF16 = 0.95
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6
NUM_TOKENS = 5


@pytest.fixture(autouse=True)
def gpu_bf16_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    if interpret_helpers.IN_PROCESS:
        interpret_helpers.round_casts_like_the_gpu(monkeypatch)


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(out, expected, **TOLERANCES[out.dtype])
    if out.dtype == torch.bfloat16:
        exact = (out == expected).float().mean().item()
        assert exact >= MIN_EXACT_BF16, f"only {exact:.1%} of the bf16 elements are bit-identical"


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def strided_rows(width: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): a [T, width] view into a [T, width + 7] buffer, strided as a slice of a wider output is; the
    kernels must leave the 7 extra columns untouched."""
    buffer = randn(NUM_TOKENS, width + 7, dtype=dtype, gen=gen)
    return buffer, buffer[:, :width]


def norm_with_random_weight(size: int, dtype: torch.dtype, gen: torch.Generator) -> layers.RMSNorm:
    norm = layers.RMSNorm(size, EPS).to(dtype)
    norm.weight.data.copy_(1 + 0.5 * torch.randn(size, generator=gen))
    return norm


@interpreted
@torch.inference_mode()
@pytest.mark.parametrize("hidden", [64, 48])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, hidden):
    gen = torch.Generator().manual_seed(0)
    norm = norm_with_random_weight(hidden, dtype, gen)
    buffer, x = strided_rows(hidden, dtype, gen)
    before = buffer.clone()
    out = fused_ops.rms_norm(x, norm.weight, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    assert_matches(out, norm(x))
    assert torch.equal(buffer, before)
    # Any leading shape: [T, heads, dim] rows as the per-head q/k norms see them.
    heads = randn(NUM_TOKENS, 3, hidden, dtype=dtype, gen=gen)
    assert_matches(fused_ops.rms_norm(heads, norm.weight, EPS), norm(heads))


@interpreted
@torch.inference_mode()
@pytest.mark.parametrize("hidden", [64, 48])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype, hidden):
    gen = torch.Generator().manual_seed(1)
    norm = norm_with_random_weight(hidden, dtype, gen)
    _, x = strided_rows(hidden, dtype, gen)
    residual = randn(NUM_TOKENS, hidden, dtype=dtype, gen=gen)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_ops.fused_add_rms_norm(x, residual, norm.weight, EPS)
    expected_out, expected_residual = norm.add_and_norm(x, residual)
    assert torch.equal(new_residual, expected_residual)  # the sum is rounded once, exactly as `x + residual`
    assert_matches(out, expected_out)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@interpreted
@torch.inference_mode()
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 24)])
def test_qk_norm_rope(dtype, head_dim, qk_norm):
    """In place on strided q/k views of a fused qkv output (head_dim 24: halves of 12 exercise the masked tiles)."""
    gen = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, max_position = 4, 2, 64
    rotary = layers.RotaryEmbedding(head_dim, max_position, 10000.0, torch.device("cpu"))
    norms = (norm_with_random_weight(head_dim, dtype, gen), norm_with_random_weight(head_dim, dtype, gen))
    qkv = randn(NUM_TOKENS, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(NUM_TOKENS, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(NUM_TOKENS, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 37, max_position - 1, 5])
    expected_q, expected_k = layers.norm_and_rotate_qk(positions, q, k, rotary, norms if qk_norm else None)
    v_before = qkv[:, q_size + kv_size :].clone()
    q_weight, k_weight = (norms[0].weight, norms[1].weight) if qk_norm else (None, None)
    fused_ops.qk_norm_rope(q, k, positions, rotary.cos, rotary.sin, q_weight, k_weight, EPS)
    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)


@interpreted
@torch.inference_mode()
@pytest.mark.parametrize("block", [None, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, block, monkeypatch):
    """block 16 splits each 40-wide row over three programs, the last one masked."""
    if block is not None:
        monkeypatch.setattr(fused_ops, "_SILU_BLOCK", block)
    gen = torch.Generator().manual_seed(3)
    buffer, x = strided_rows(2 * 40, dtype, gen)
    before = buffer.clone()
    out = fused_ops.silu_and_mul(x)
    assert out.shape == (NUM_TOKENS, 40)
    assert_matches(out, layers.silu_and_mul(x))
    assert torch.equal(buffer, before)


def tiny_decoder(qk_norm: bool, dtype: torch.dtype) -> DecoderForCausalLM:
    spec = DecoderSpec(
        architecture="Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM",
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=EPS,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=qk_norm,
    )
    rotary = layers.RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, torch.device("cpu"))
    model = DecoderForCausalLM(spec, rotary)
    gen = torch.Generator().manual_seed(4)
    for name, param in model.named_parameters():
        torch.nn.init.normal_(param, mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.2, generator=gen)
    return model.to(dtype)


def run_decoder(model: DecoderForCausalLM) -> torch.Tensor:
    """One prefill of two sequences (3 and 2 tokens) through the paged-cache reference attention."""
    spec = model.spec
    shape, dtype = (2, 16, spec.num_kv_heads, spec.head_dim), model.lm_head.weight.dtype
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(spec.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0, 1, 2, 16, 17]),
        cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32),
        seq_lens=torch.tensor([3, 2], dtype=torch.int32),
        block_tables=torch.tensor([[0], [1]], dtype=torch.int32),
        max_seqlen_q=3,
        max_seq_len=3,
        query_lens_cpu=[3, 2],
        seq_lens_cpu=[3, 2],
    )
    ids, positions = torch.tensor([3, 14, 15, 9, 26]), torch.tensor([0, 1, 2, 0, 1])
    return model(ids, positions, ForwardContext(meta, caches, TorchReferenceBackend()))


@interpreted
@torch.inference_mode()
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decoder_forward_with_fused_kernels(dtype, qk_norm, monkeypatch):
    model = tiny_decoder(qk_norm, dtype)
    expected = run_decoder(model)
    assert layers.fused_kernels(expected) is None  # CPU tensors take the PyTorch path by themselves
    monkeypatch.setattr(layers, "fused_kernels", lambda x, exact=False: fused_ops)
    # Two layers of bf16 matmuls may turn a one-ulp difference in a norm into a few ulp of the output.
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run_decoder(model), expected, **tolerance)


@interpreted
@pytest.mark.parametrize("qk_norm", [True, False])
def test_batch_invariant_decoder_trains_on_the_fused_kernels_values(qk_norm, monkeypatch):
    """A model in batch-invariant mode runs the fused kernels under autograd too (the engine's bits, as a trainer
    needs them): the same values as without autograd, and the gradients of the PyTorch code."""
    model = tiny_decoder(qk_norm, torch.float32).requires_grad_()
    regular = model.compute_logits(run_decoder(model))
    regular.square().sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    # As on CUDA: the kernels for a batch-invariant model under autograd, for anyone without it.
    monkeypatch.setattr(
        layers, "fused_kernels", lambda x, exact=False: fused_ops if exact or not torch.is_grad_enabled() else None
    )
    model.set_batch_invariant(True)
    with torch.no_grad():
        engine = model.compute_logits(run_decoder(model))
    trained = model.compute_logits(run_decoder(model))
    assert torch.equal(trained.detach(), engine)
    trained.square().sum().backward()
    for name, p in model.named_parameters():
        # The losses' own fp32 roundings differ (values from the kernels, not from the PyTorch code): ~1e-6 relative.
        assert (p.grad - expected[name]).norm() <= 1e-5 * expected[name].norm(), name
