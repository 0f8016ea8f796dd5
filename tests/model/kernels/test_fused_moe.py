"""CPU checks of the fused MoE kernel (rlserve.model.kernels.fused_moe) under TRITON_INTERPRET=1: it computes what the
PyTorch experts (rlserve.model.moe.experts_reference) compute, its token sort pads each expert's rows to whole blocks,
and in batch-invariant mode a token's bits do not depend on the other tokens of the batch.

interpret_helpers.py sets the interpreter up (or re-runs these checks in a fresh process where triton was imported
before it could).
"""

from __future__ import annotations

import interpret_helpers  # first: sets TRITON_INTERPRET before anything imports triton
import pytest
import torch

interpret_helpers.require_triton()

from rlserve.model.fp8 import ExpertScales, Fp8Scheme  # noqa: E402
from rlserve.model.kernels.fused_moe import (  # noqa: E402
    INVARIANT_TILES,
    SHARED_MEMORY_BUDGET,
    align_by_expert,
    fused_moe,
    stage_bytes,
    tile_config,
)
from rlserve.model.moe import experts_reference, route  # noqa: E402

interpreted = interpret_helpers.interpreted

if not interpret_helpers.IN_PROCESS:

    def test_in_fresh_process():
        interpret_helpers.run_in_fresh_process(__file__)


# Tails everywhere: H and I not multiples of the tile sizes, tokens not a multiple of BLOCK_M, unused experts.
E, K, H, I = 6, 2, 72, 40  # noqa: E741


def problem(num_tokens: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype)
    logits = torch.randn(num_tokens, E, generator=gen)
    logits[:, E - 1] = -30.0  # one expert no token picks
    weights, ids = route(logits, K, norm_topk_prob=True)
    return x, w13, w2, weights, ids


@interpreted
def test_align_pads_each_expert_to_whole_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 3]])
    block = 4
    aligned = align_by_expert(ids, num_experts=5, block_m=block)
    sorted_pairs, block_experts = aligned.sorted_pairs, aligned.block_experts
    # expert 0: pairs 1, 4; 1: 3; 2: 0, 2, 5, 6; 3: 7 -> one block each, padded with the sentinel 8.
    assert int(aligned.num_padded) == 16 and aligned.num_pairs == 8
    rows = sorted_pairs[:16].view(4, block).tolist()
    assert rows == [[1, 4, 8, 8], [3, 8, 8, 8], [0, 2, 5, 6], [7, 8, 8, 8]]
    assert block_experts[:4].tolist() == [0, 1, 2, 3]
    assert (sorted_pairs[16:] == 8).all()


def sorted_rows_reference(ids: torch.Tensor, num_experts: int, block_m: int):
    """align_by_expert's rows from a stable sort (the torch ops the kernels replaced): sorted_pairs, block_experts,
    num_padded."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    max_rows = min(num_pairs + num_experts * (block_m - 1), num_pairs * block_m)
    max_rows = -(-max_rows // block_m) * block_m
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(num_pairs) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32)
    sorted_pairs[(ends - padded)[flat[order]] + rank] = order.to(torch.int32)
    blocks = torch.searchsorted(ends, torch.arange(0, max_rows, block_m), right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, blocks.to(torch.int32), int(ends[-1])


@interpreted
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m"),
    [(1, 8, 128, 16), (3, 2, 6, 16), (70, 8, 128, 64), (700, 8, 128, 64), (613, 4, 60, 128), (9, 1, 1, 32)],
)
def test_align_equals_a_stable_sort(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> None:
    """Several chunks of pairs (128 a chunk) and of the offsets kernel's rows (32 chunks a step), experts no pair
    picks, an expert count that is not a power of two (and one that is, leaving no spare bin below the padding's)."""
    gen = torch.Generator().manual_seed(num_tokens)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    scores[:, : num_experts // 3] *= 0.2  # uneven loads: some experts with many pairs, some with none
    ids = scores.topk(top_k, dim=1).indices
    aligned = align_by_expert(ids, num_experts, block_m)
    want_pairs, want_blocks, want_rows = sorted_rows_reference(ids, num_experts, block_m)
    assert aligned.num_pairs == ids.numel() and int(aligned.num_padded) == want_rows
    assert torch.equal(aligned.sorted_pairs, want_pairs)
    assert torch.equal(aligned.block_experts, want_blocks)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_fused_moe_matches_the_reference(dtype, num_tokens) -> None:
    x, w13, w2, weights, ids = problem(num_tokens, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    expected = experts_reference(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (num_tokens, H)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@interpreted
def test_batch_invariant_tokens_do_not_depend_on_the_batch() -> None:
    num_tokens = 2 * INVARIANT_TILES.block_m + 3
    x, w13, w2, weights, ids = problem(num_tokens, torch.float32, seed=1)
    full = fused_moe(x, w13, w2, weights, ids, batch_invariant=True)
    for rows in (slice(0, 1), slice(3, 9), slice(num_tokens - 5, num_tokens)):
        part = fused_moe(x[rows], w13, w2, weights[rows], ids[rows], batch_invariant=True)
        assert torch.equal(part, full[rows]), rows


@interpreted
def test_bad_shapes_are_refused() -> None:
    x, w13, w2, weights, ids = problem(3, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x[:, :-1], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="must be"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, H)


@pytest.fixture
def gpu_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    if interpret_helpers.IN_PROCESS:
        interpret_helpers.round_casts_like_the_gpu(monkeypatch)


def fp8_problem(num_tokens: int, scheme: Fp8Scheme, dtype: torch.dtype):
    """`problem`'s experts quantized per expert; whole 128x128 blocks for block-wise, `problem`'s ragged shape (tails
    in every tile) per channel."""
    hidden, inter = (256, 128) if scheme.block_wise else (H, I)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    experts = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        # Rows of different magnitudes, as trained weights have: the scales must follow them.
        weight = torch.randn(E, rows, cols, generator=gen) * torch.logspace(-2, 0, rows).unsqueeze(1) / cols**0.5
        q, scales = zip(*(scheme.quantize(w) for w in weight), strict=True)
        stacked = torch.stack(scales)
        experts.append((torch.stack(q), stacked if scheme.block_wise else stacked.squeeze(-1)))
    (w13, s13), (w2, s2) = experts
    logits = torch.randn(num_tokens, E, generator=gen)
    logits[:, E - 1] = -30.0
    weights, ids = route(logits, K, norm_topk_prob=True)
    return x, w13, w2, weights, ids, ExpertScales(scheme, s13, s2)


@interpreted
@pytest.mark.usefixtures("gpu_rounding")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", [Fp8Scheme("fp8"), Fp8Scheme("fbgemm_fp8")], ids=lambda s: s.method)
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_fp8_experts_match_the_reference(scheme: Fp8Scheme, dtype: torch.dtype, num_tokens: int) -> None:
    """The FP8 experts (fp8 weights with per-expert scales, activations quantized per token / 128-group) compute
    what experts_reference computes with FP8 projections: the same quantized operands, another fp32 summation order
    (scales applied per K step rather than to the dequantized operands), so within fp32 rounding before the output's
    rounding (fp32), or one bf16 ulp after it."""
    x, w13, w2, weights, ids, scales = fp8_problem(num_tokens, scheme, dtype)
    out = fused_moe(x, w13, w2, weights, ids, fp8=scales)
    expected = experts_reference(x, w13, w2, weights, ids, fp8=scales)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item())


@interpreted
def test_fp8_experts_with_wrong_scales_are_refused() -> None:
    x, w13, w2, weights, ids, scales = fp8_problem(3, Fp8Scheme("fp8"), torch.bfloat16)
    with pytest.raises(ValueError, match=r"w2's fp8 scales are \(6, 1, 2\) torch.float32; .* needs \(6, 2, 1\)"):
        fused_moe(x, w13, w2, weights, ids, fp8=ExpertScales(scales.scheme, scales.w13, scales.w2.transpose(1, 2)))
    with pytest.raises(ValueError, match="without fp8 scales"):
        fused_moe(x, w13, w2, weights, ids)


@pytest.mark.parametrize("element_size", [2, 4])
def test_tiles_fit_in_shared_memory(element_size: int) -> None:
    """Every token count's tile, in bf16 and fp32, pipelines within the shared-memory budget (an fp32 engine's
    4-stage tile once asked an H200 for 240 KiB and failed to start)."""
    for num_pairs in (1, 8 * 64, 32 * 64, 96 * 64, 1 << 16):
        for invariant in (False, True):
            cfg = tile_config(num_pairs, 64, invariant, element_size)
            assert (cfg.num_stages - 1) * stage_bytes(cfg, element_size) <= SHARED_MEMORY_BUDGET, cfg
    assert tile_config(96 * 64, 64, False, 2).num_stages == 4  # bf16 keeps the tuned stages
