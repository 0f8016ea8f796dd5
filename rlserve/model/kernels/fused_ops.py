"""Triton kernels fusing the decoder's small elementwise ops: RMSNorm (with the residual add), Qwen3's per-head q/k
RMSNorm with the neox rotary embedding, and SiLU-and-mul.

Each kernel reproduces the roundings of the PyTorch code in rlserve.model.layers (the reference): every op PyTorch
runs in the input dtype is computed here in fp32 and rounded to that dtype at the same point, so results agree
bit-for-bit up to the order of the fp32 sums and the fp32 accuracy of rsqrt and exp (at most 1 ulp in bf16).

Every launch passes enable_fp_fusion=False: PyTorch runs each op as its own kernel, so it rounds every product before
the add that follows, and a product contracted into an FMA would skip that rounding (the rotary embedding's
`x1 * cos - x2 * sin` would). The kernels are memory-bound, so the separate multiply costs nothing.

The wrappers are CUDA-graph capturable: launch grids and block sizes come only from tensor shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------------------------------
# RMSNorm, optionally after the residual add
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # rounded like `x + residual`
        tl.store(residual_out_ptr + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    # Hugging Face's order: normalise in fp32, round to the input dtype, then scale by the weight.
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (weight * normed).to(x.dtype), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] with unit column stride: a view whenever the layout allows, else a contiguous copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
    eps: float,
) -> None:
    n = x.shape[-1]
    if weight.shape != (n,) or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not fit x {tuple(x.shape)} {x.dtype}")
    if x.numel() == 0:
        return
    rows = _rows(x)
    res_rows = rows if residual is None else _rows(residual)  # unread without a residual
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        res_rows,
        weight,
        out,
        out if residual_out is None else residual_out,
        rows.stride(0),
        res_rows.stride(0),
        eps,
        N=n,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 16),
        enable_fp_fusion=False,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape), as layers.RMSNorm computes it; weight has x's dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, None, weight, out, None, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one pass, both new tensors; the sum is rounded to x's dtype first."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}"
        )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    _launch_rms_norm(x, residual, weight, out, residual_out, eps)
    return out, residual_out


# ---------------------------------------------------------------------------------------------------------------------
# Per-head q/k RMSNorm (Qwen3) and the neox rotary embedding
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _norm_rope_heads(
    head_ptr,
    stride_h,
    weight_ptr,
    cos,
    sin,
    eps,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Normalise (when HAS_NORM) and rotate one token's heads in place; the two halves of each head are separate tiles,
    so rotate-half needs no gather. cos/sin are [BLOCK_HALF] fp32 holding values of the input dtype."""
    half: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < half)[None, :]
    first = head_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # layers.RMSNorm per head: normalise in fp32, round, scale by the weight, round
        inv_rms = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(weight_ptr + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + half + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # RotaryEmbedding rounds each product and then the sum to the input dtype.
    cos, sin = cos[None, :], sin[None, :]
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + half, out2.to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    half: tl.constexpr = HEAD_DIM // 2
    mask_d = offs_d < half
    # RotaryEmbedding casts the fp32 table to the input dtype before multiplying.
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + position * half + offs_d, mask=mask_d, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + position * half + offs_d, mask=mask_d, other=0.0).to(dtype).to(tl.float32)
    _norm_rope_heads(
        q_ptr + token * stride_qt, stride_qh, q_weight_ptr, cos, sin, eps, NUM_Q_HEADS, HEAD_DIM, BLOCK_Q, BLOCK_HALF,
        HAS_NORM,
    )  # fmt: skip
    _norm_rope_heads(
        k_ptr + token * stride_kt, stride_kh, k_weight_ptr, cos, sin, eps, NUM_KV_HEADS, HEAD_DIM, BLOCK_KV, BLOCK_HALF,
        HAS_NORM,
    )  # fmt: skip


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> None:
    """In place on q [T, Hq, D] and k [T, Hk, D] (any token/head strides, e.g. views into the fused qkv output):
    per-head RMSNorm with q_weight / k_weight when given (Qwen3), then the neox rotary embedding at positions [T]
    from the fp32 tables [max_position, D / 2]."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or k.dtype != q.dtype or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} do not fit together")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must have unit stride in head_dim (they are rotated in place)")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got {tuple(positions.shape)}")
    if sin_table.shape != cos_table.shape or cos_table.shape[1:] != (head_dim // 2,):
        raise ValueError(f"cos/sin tables must both be [max_position, {head_dim // 2}], got {tuple(cos_table.shape)}")
    if not (cos_table.is_contiguous() and sin_table.is_contiguous()):
        raise ValueError("cos/sin tables must be contiguous")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be given or both be None")
    for weight in (q_weight, k_weight):
        if weight is not None and (weight.shape != (head_dim,) or weight.dtype != q.dtype):
            raise ValueError(f"norm weight {tuple(weight.shape)} {weight.dtype} does not fit head_dim {head_dim}")
    if num_tokens == 0:
        return
    has_norm = q_weight is not None
    block_q, block_kv = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_kv_heads)
    _qk_norm_rope_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_table,
        sin_table,
        q_weight if has_norm else q,  # unread without the norm
        k_weight if has_norm else k,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        eps,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_Q=block_q,
        BLOCK_KV=block_kv,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        HAS_NORM=has_norm,
        num_warps=4 if block_q * head_dim >= 1024 else 1,
        enable_fp_fusion=False,
    )


# ---------------------------------------------------------------------------------------------------------------------
# SiLU-and-mul
# ---------------------------------------------------------------------------------------------------------------------

# Columns per program: wide enough for full-width loads, small enough that a row of a large MLP spreads over programs.
_SILU_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    # F.silu's formula, rounded to the input dtype before the multiply as `F.silu(gate) * up` is.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (act * up).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] -> F.silu(x[..., :I]) * x[..., I:], a new [..., I] tensor."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {tuple(x.shape)}")
    n = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = _rows(x)
    block = min(triton.next_power_of_2(n), _SILU_BLOCK)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
        rows, out, rows.stride(0), N=n, BLOCK=block, num_warps=4 if block >= 512 else 1, enable_fp_fusion=False
    )
    return out
