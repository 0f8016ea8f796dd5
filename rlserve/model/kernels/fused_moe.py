"""The fused MoE experts on CUDA: tokens sorted by expert, two grouped GEMMs over the stacked experts, a combine.

1. `align_by_expert`: every (token, k) pair goes to its expert's run of rows; each expert's run is padded to a multiple
   of BLOCK_M, so a block of BLOCK_M sorted rows belongs to one expert (vLLM's moe_align_block_size). Three small
   kernels on the device, sized by the worst case: no host sync, the same shapes for a given number of tokens, so a
   decode step is CUDA-graph capturable.
2. `expert_gemm` (`_expert_gemm_kernel`), gated: per block of sorted rows and block of the intermediate dimension,
   the gate and the up projection of the block's expert (w13 [E, 2I, H]) in two accumulators, then SiLU(gate) * up,
   per (token, k).
3. `expert_gemm` again: per block of sorted rows, the block's expert's down projection (w2 [E, H, I]).
4. `combine_pairs` (`_combine_kernel`): each token's sum over k of weight * output, in fp32 and in top-k order.

No split over K anywhere: an output element's reduction order depends only on the tile shape, never on how many
tokens there are or which expert block a row shares. In batch-invariant mode one tile shape serves every batch size,
so a token's result does not depend on the batch (the router's matmul is the batch-invariant one of
rlserve.model.batch_invariant); otherwise the tile shape follows the number of tokens per expert.

FP8 experts (rlserve.model.fp8.ExpertScales): w13 and w2 in float8_e4m3fn, each GEMM's input quantized per token (and
128-group, block-wise) by rlserve.model.kernels.fp8_quant before it; the products run on fp8 operands (the tensor
cores' FP8 MMA on Hopper) with the scales applied in fp32, per K step of 128 for 128x128 blocks, once for per-row.

Checked against rlserve.model.moe.experts_reference (with FP8 projections: rlserve.model.fp8.fp8_linear's reference
arithmetic) under TRITON_INTERPRET=1 (tests/model/kernels/test_fused_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from rlserve.model.fp8 import BLOCK, FP8_DTYPE, ExpertScales
from rlserve.model.kernels.dot import dot, dot_precision, dot_upcast
from rlserve.model.kernels.fp8_quant import quantize_activation

# The expert GEMM's operands (its SCALES): in the model dtype, or fp8 with per-row or 128x128-block scales.
NO_SCALES = tl.constexpr(0)
PER_ROW = tl.constexpr(1)
PER_BLOCK = tl.constexpr(2)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Batch-invariant mode's single tile shape.
INVARIANT_TILES = TileConfig(16, 64, 64, 4, 3)


# Of an H100/H200 SM's 227 KiB of shared memory, what the pipelined tiles may take (the rest: the epilogue's).
SHARED_MEMORY_BUDGET = 192 * 1024


def tile_config(num_pairs: int, num_experts: int, batch_invariant: bool, element_size: int = 2) -> TileConfig:
    """Tile shape from the mean number of rows per expert (num_pairs = tokens x top_k): the fastest of ten shapes at
    Qwen3-30B-A3B's experts on an H200 in bf16 (BENCHMARKS.md, 2026-12-01) for 1 to 16,384 tokens, with fewer
    pipeline stages where `element_size`-byte elements would overflow shared memory (fp32: a 4-stage 64x128 tile
    asked for 240 KiB). The stages never change the reduction order, so batch invariance does not depend on them."""
    if batch_invariant:
        cfg = INVARIANT_TILES
    else:
        rows_per_expert = num_pairs / num_experts
        if rows_per_expert <= 8:
            cfg = TileConfig(16, 64, 128, 4, 3)
        elif rows_per_expert <= 32:
            cfg = TileConfig(32, 128, 64, 4, 4)
        elif rows_per_expert <= 96:
            cfg = TileConfig(64, 128, 64, 8, 4)
        else:
            cfg = TileConfig(128, 128, 64, 8, 3)
    stages = cfg.num_stages
    while stages > 2 and (stages - 1) * stage_bytes(cfg, element_size) > SHARED_MEMORY_BUDGET:
        stages -= 1
    return replace(cfg, num_stages=stages)


def stage_bytes(cfg: TileConfig, element_size: int) -> int:
    """Shared memory of one pipeline stage of the gated expert GEMM: a tile of tokens and the gate and up tiles."""
    return (cfg.block_m * cfg.block_k + 2 * cfg.block_k * cfg.block_n) * element_size


@dataclass(frozen=True)
class SortedRows:
    """The (token, k) pairs sorted by expert (align_by_expert). sorted_pairs [max_rows] int32: the flat (token * K +
    k) index of each sorted row, grouped by expert, each expert's run padded to a multiple of block_m with T * K (out
    of range: masked). block_experts [max_rows // block_m]: the expert of each block of rows (garbage past
    num_padded). num_padded [1]: the rows in use. num_pairs: T * K."""

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    num_pairs: int


# Pairs per program of the counting and scattering kernels: a chunk's ranks come from a CHUNK x CHUNK comparison.
_ALIGN_CHUNK = 128
# Rows of a [rows, experts] tile, and entries of a fill, per step of the offsets kernel's loops.
_ALIGN_ROWS = 32
_ALIGN_FILL = 1024


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> SortedRows:
    """The sorted rows of expert ids [T, K] for blocks of block_m rows, in three kernels on the device (each chunk of
    pairs counted per expert; each expert's padded run and each chunk's first row in it; each pair written to its
    row), in place of the thirty-odd small torch ops of a sort: a MoE layer's decode step launches this 48 times.
    Within an expert the pairs keep their flat order, as a stable sort leaves them."""
    num_pairs = ids.numel()
    device = ids.device
    # At most min(E, T*K) experts are used, each wasting at most block_m - 1 rows.
    max_rows = min(num_pairs + num_experts * (block_m - 1), num_pairs * block_m)
    max_rows = triton.cdiv(max_rows, block_m) * block_m
    num_blocks = max_rows // block_m
    sorted_pairs = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return SortedRows(sorted_pairs, block_experts, num_padded, 0)
    flat = ids.reshape(-1)
    bins = triton.next_power_of_2(num_experts + 1)  # one bin more than the experts: past the end lands there
    num_chunks = triton.cdiv(num_pairs, _ALIGN_CHUNK)
    counts = torch.empty((num_chunks, bins), dtype=torch.int32, device=device)
    first_rows = torch.empty((num_chunks, bins), dtype=torch.int32, device=device)
    _count_chunk_kernel[(num_chunks,)](flat, counts, num_pairs, BINS=bins, CHUNK=_ALIGN_CHUNK)
    _expert_runs_kernel[(1,)](
        counts, first_rows, sorted_pairs, block_experts, num_padded, num_chunks, num_experts, num_pairs, max_rows,
        num_blocks, BLOCK_M=block_m, BINS=bins, ROWS=_ALIGN_ROWS, FILL=_ALIGN_FILL,
    )  # fmt: skip
    _scatter_pairs_kernel[(num_chunks,)](
        flat, first_rows, sorted_pairs, num_pairs, BINS=bins, CHUNK=_ALIGN_CHUNK, num_warps=8
    )
    return SortedRows(sorted_pairs, block_experts, num_padded, num_pairs)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_chunk_kernel(ids_ptr, counts_ptr, num_pairs, BINS: tl.constexpr, CHUNK: tl.constexpr):
    """counts[c, e]: the pairs of chunk c routed to expert e (bin BINS - 1 also counts the chunk's overhang)."""
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=BINS - 1).to(tl.int32)
    tl.store(counts_ptr + chunk * BINS + tl.arange(0, BINS), tl.histogram(experts, BINS).to(tl.int32))


@triton.jit(do_not_specialize=["num_chunks", "num_pairs", "max_rows", "num_blocks"])
def _expert_runs_kernel(
    counts_ptr,
    first_rows_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_chunks,
    num_experts,
    num_pairs,
    max_rows,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,
    ROWS: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program: each expert's run of rows padded to whole blocks (back to back, in expert order), each chunk's
    first row within its experts' runs (first_rows [chunks, BINS]), each block's expert, the rows in use, and every
    row set to the padding pair (num_pairs) for _scatter_pairs_kernel to overwrite."""
    experts = tl.arange(0, BINS)
    is_expert = experts < num_experts
    totals = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(0, num_chunks, ROWS):
        rows = c0 + tl.arange(0, ROWS)
        tile = tl.load(counts_ptr + rows[:, None] * BINS + experts[None, :], mask=(rows < num_chunks)[:, None], other=0)
        totals += tl.sum(tile, axis=0)
    padded = tl.where(is_expert, (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    carry = ends - padded  # each expert's next free row
    for c0 in range(0, num_chunks, ROWS):
        rows = c0 + tl.arange(0, ROWS)
        ok = (rows < num_chunks)[:, None]
        tile = tl.load(counts_ptr + rows[:, None] * BINS + experts[None, :], mask=ok, other=0)
        tl.store(
            first_rows_ptr + rows[:, None] * BINS + experts[None, :], carry[None, :] + tl.cumsum(tile, 0) - tile, ok
        )
        carry += tl.sum(tile, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for b0 in range(0, num_blocks, ROWS):  # a block's expert: the first whose run ends after the block's first row
        blocks = b0 + tl.arange(0, ROWS)
        ended = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & is_expert[None, :]
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_experts - 1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)
    for r0 in range(0, max_rows, FILL):
        offs = r0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs, tl.full([FILL], 0, tl.int32) + num_pairs, mask=offs < max_rows)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_pairs_kernel(ids_ptr, first_rows_ptr, sorted_ptr, num_pairs, BINS: tl.constexpr, CHUNK: tl.constexpr):
    """Each pair of chunk c to its row: its expert's first row for the chunk plus the chunk's earlier pairs of that
    expert (so that an expert's pairs keep their flat order)."""
    chunk = tl.program_id(0)
    local = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + local
    valid = offs < num_pairs
    experts = tl.load(ids_ptr + offs, mask=valid, other=BINS - 1).to(tl.int32)
    earlier = (experts[:, None] == experts[None, :]) & (local[None, :] < local[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    first = tl.load(first_rows_ptr + chunk * BINS + experts, mask=valid, other=0)
    tl.store(sorted_ptr + first + rank, offs.to(tl.int32), mask=valid)


# The number of pairs changes every step: specialising on it (== 1, divisible by 16) would compile variants mid-run.
@triton.jit(do_not_specialize=["num_pairs"])
def _expert_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    a_scale_ptr,
    w_scale_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    PAIRS_PER_A_ROW: tl.constexpr,
    GATED: tl.constexpr,
    SCALES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """For the (token, k) pairs of one block of sorted rows, all routed to the block's expert e:
    GATED:     out[pair, n] = silu(a[token] . w[e, n]) * (a[token] . w[e, N + n])   (gate/up, a = x, N = I)
    otherwise: out[pair, n] = a[pair] . w[e, n]                                      (down, a = the above, N = H)
    a's row of a pair is pair // PAIRS_PER_A_ROW (top_k for x, 1 for the per-pair intermediate).

    SCALES: the operands' kind. NO_SCALES: both in the model dtype. PER_ROW: fp8 a with a scale per row
    (a_scale[row * stride_asm]) and fp8 w with one per output row (w_scale[e, n]), applied to the whole sum.
    PER_BLOCK: fp8 a with a scale per row and 128-group of K, fp8 w with one per 128x128 block
    (w_scale[e, n // 128, k // 128]); BLOCK_K is 128 and BLOCK_N divides it, so each K step's partial product takes
    one scale per row and column before it joins the fp32 sum."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pairs < num_pairs
    a_rows = pairs // PAIRS_PER_A_ROW
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # the weight's [K, N] view
    if SCALES != NO_SCALES:
        a_scale_ptrs = a_scale_ptr + a_rows * stride_asm
        w_rows = offs_n // BLOCK_K if SCALES == PER_BLOCK else offs_n
        w_scale_ptrs = w_scale_ptr + expert * stride_wse + w_rows * stride_wsn
        up_scale_ptrs = w_scale_ptrs + (N // BLOCK_K if SCALES == PER_BLOCK else N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        if SCALES == PER_BLOCK:
            group = k0 // BLOCK_K
            a_scale = tl.load(a_scale_ptrs + group * stride_ask, mask=row_ok, other=0.0)[:, None]
            zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            part = dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), zero, DOT_PRECISION, DOT_UPCAST)
            w_scale = tl.load(w_scale_ptrs + group * stride_wsk, mask=col_ok, other=0.0)[None, :]
            acc += part * a_scale * w_scale
            if GATED:
                part = dot(a, tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0), zero, DOT_PRECISION, DOT_UPCAST)
                up += part * a_scale * tl.load(up_scale_ptrs + group * stride_wsk, mask=col_ok, other=0.0)[None, :]
        else:
            acc = dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, DOT_PRECISION, DOT_UPCAST)
            if GATED:
                up = dot(a, tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0), up, DOT_PRECISION, DOT_UPCAST)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALES == PER_ROW:
        a_scale = tl.load(a_scale_ptrs, mask=row_ok, other=0.0)[:, None]
        acc *= a_scale * tl.load(w_scale_ptrs, mask=col_ok, other=0.0)[None, :]
        if GATED:
            up *= a_scale * tl.load(up_scale_ptrs, mask=col_ok, other=0.0)[None, :]
    out_ty = out_ptr.dtype.element_ty
    if GATED:
        # Rounded where the PyTorch reference rounds: each projection's output, then SiLU, then the product.
        gate = acc.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        acc = act * up.to(out_ty).to(tl.float32)
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, weight_ptr, out_ptr, N, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t] = sum over k, in order, of weight[t, k] * y[t * TOP_K + k], in fp32."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        w = tl.load(weight_ptr + token * TOP_K + k)
        y = tl.load(y_ptr + (token * TOP_K + k) * N + offs, mask=mask, other=0.0).to(tl.float32)
        acc += w * y
    tl.store(out_ptr + token * N + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    batch_invariant: bool = False,
    fp8: ExpertScales | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], routing weights [T, K] (fp32) and expert ids [T, K] -> [T, H].
    With `fp8`, w13 and w2 are float8_e4m3fn with those scales, and each GEMM's input is quantized dynamically (per
    token, or per token and 128-group) by rlserve.model.kernels.fp8_quant. The four phases of the module doc, each
    a function of its own (benchmarks/moe_layer_profile.py times them apart)."""
    _check_operands(x, w13, w2, weights, ids, fp8)
    if ids.shape[0] == 0:
        return torch.empty_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    cfg = moe_tiles(ids, w13, batch_invariant, fp8)
    rows = align_by_expert(ids, w13.shape[0], cfg.block_m)
    h = expert_gemm(x, w13, rows, cfg, ids.shape[1], gated=True, fp8=fp8)
    y = expert_gemm(h, w2, rows, cfg, 1, gated=False, fp8=fp8)
    return combine_pairs(y, weights)


def _check_operands(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fp8: ExpertScales | None,
) -> None:
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if x.dim() != 2 or x.shape[1] != hidden or w2.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
            "[T, H], [E, 2I, H], [E, H, I]"
        )
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_moe: w13 and w2 need unit stride along their last dimension")
    weight_dtype = x.dtype if fp8 is None else FP8_DTYPE
    if w13.dtype != weight_dtype or w2.dtype != weight_dtype:
        given = "with" if fp8 is not None else "without"
        raise ValueError(f"fused_moe: x is {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}, {given} fp8 scales")
    if weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must be [T, K]")
    if fp8 is not None:
        fp8.check(w13, w2)


def moe_tiles(ids: torch.Tensor, w13: torch.Tensor, batch_invariant: bool, fp8: ExpertScales | None) -> TileConfig:
    """Both expert GEMMs' tile shape for expert ids [T, K] (tile_config), narrowed for 128x128-block FP8 weights."""
    cfg = tile_config(ids.numel(), w13.shape[0], batch_invariant, w13.element_size())
    if fp8 is not None and fp8.block_wise:  # one K step per 128-group, a column block within one 128-row block
        cfg = replace(cfg, block_k=BLOCK, block_n=min(cfg.block_n, BLOCK))
    return cfg


def expert_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    rows: SortedRows,
    cfg: TileConfig,
    pairs_per_a_row: int,
    gated: bool,
    fp8: ExpertScales | None,
) -> torch.Tensor:
    """One grouped GEMM over the sorted (token, k) pairs -> [pairs, N]: gated (w13: SiLU(gate) * up, N = I) with `a`
    = x [T, H] and one row per token (pairs_per_a_row = K), or the down projection (w2, N = H) with `a` the gated
    output, one row per pair. With `fp8`, `a` is quantized first and the weight's scales applied."""
    num_pairs = rows.num_pairs
    n = w.shape[1] // 2 if gated else w.shape[1]
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    w_scale = None if fp8 is None else fp8.w13 if gated else fp8.w2
    if fp8 is not None:
        a, a_scale = quantize_activation(a, BLOCK if fp8.block_wise else None)
    else:
        a_scale = w_scale = a  # unread
    scales = NO_SCALES if fp8 is None else PER_BLOCK if fp8.block_wise else PER_ROW
    scale_strides = (0,) * 5 if fp8 is None else (*a_scale.stride(), *_three_strides(w_scale))
    precision, upcast = dot_precision(w.dtype), dot_upcast(w.dtype)
    _expert_gemm_kernel[(rows.block_experts.shape[0], triton.cdiv(n, cfg.block_n))](
        a, w, out, rows.sorted_pairs, rows.block_experts, rows.num_padded, a_scale, w_scale, num_pairs, n, a.shape[1],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), *scale_strides,
        PAIRS_PER_A_ROW=pairs_per_a_row, GATED=gated, SCALES=scales, DOT_PRECISION=precision, DOT_UPCAST=upcast,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def combine_pairs(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T * K, H] outputs of the pairs and routing weights [T, K] -> [T, H]: each token's weighted sum over k."""
    num_tokens, top_k = weights.shape
    hidden = y.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=y.dtype, device=y.device)
    block = min(triton.next_power_of_2(hidden), 1024)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, weights.float().contiguous(), out, hidden, TOP_K=top_k, BLOCK_N=block,
        enable_fp_fusion=False,  # the reference rounds each product before its add
    )  # fmt: skip
    return out


def _three_strides(scale: torch.Tensor) -> tuple[int, int, int]:
    """(expert, row, column) strides of an expert weight's scales: [E, rows, cols] block-wise, [E, rows] per row."""
    return (*scale.stride(), 0) if scale.dim() == 2 else scale.stride()
