"""The batch-invariant matmul on CUDA (see rlserve.model.batch_invariant).

The tile is chosen from the weight alone (its shape and dtype, `tile_for`), never from the number of rows; there is no
split over K, and K is walked in the same order by every program: an output element's reduction depends only on its
row of x and its column of the weight, never on how many rows there are or where in a tile its row sits. Engine and
trainer multiply by the same weights, so they take the same tiles. fp32 inputs multiply in full fp32 ("ieee"), not
TF32. The launch is CUDA-graph capturable (the grid comes from shapes only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rlserve.model.kernels.dot import dot, dot_precision, dot_upcast


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# 64x64x64 for everything (until 2026-12-01) ran the Qwen3-0.6B shapes far below cuBLAS. Wider tiles give Hopper's
# warpgroup MMA a longer N per instruction; projections to few columns (o_proj, down_proj: N = hidden) keep 64-row
# tiles so that a decode step of 1,024 rows still fills the SMs. fp32 keeps the small tile (twice the shared memory
# per element). benchmarks/batch_invariant_profile.py --sweep times the alternatives at W1's shapes.
SMALL_TILE = Tile(64, 64, 64, 4, 3)
NARROW_TILE = Tile(64, 128, 64, 4, 3)  # bf16/fp16, N < 2048
WIDE_TILE = Tile(128, 128, 64, 8, 3)  # bf16/fp16, N >= 2048 (qkv, gate_up, the LM head)


def tile_for(n: int, k: int, element_size: int) -> Tile:
    """The tile for a weight [n, k] of `element_size`-byte elements: a function of the weight only."""
    if element_size >= 4:
        return SMALL_TILE
    return WIDE_TILE if n >= 2048 else NARROW_TILE


# M changes every step: specialising on it (== 1, divisible by 16) would compile variants mid-run.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    col_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # the weight's [K, N] view
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = dot(x, w, acc, DOT_PRECISION, DOT_UPCAST)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile: Tile | None = None
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype. tile: the weight's (`tile_for`) unless given
    (the benchmark sweeps tiles through it)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"matmul: x is {x.dtype} but weight is {weight.dtype}")
    (M, K), N = x.shape, weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    tile = tile or tile_for(N, K, weight.element_size())
    grid = (triton.cdiv(M, tile.block_m), triton.cdiv(N, tile.block_n))
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out, M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None,
        DOT_PRECISION=dot_precision(x.dtype), DOT_UPCAST=dot_upcast(x.dtype),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )  # fmt: skip
    return out
