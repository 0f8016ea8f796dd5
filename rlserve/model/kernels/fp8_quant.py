"""FP8 quantization in one launch: dynamic activations, written straight into the layout torch's scaled_mm takes,
and weights (a bf16 update quantized into an FP8 engine).

`quantize_activation` computes what rlserve.model.fp8.scaled_mm_activation computes with about eight small PyTorch
kernels (abs, amax, clamp, divide, divide, clamp, cast, and for block-wise scales a padded column-major copy): per
token (fbgemm_fp8, RowWise) or per token and 128-feature group (fp8, BlockWise1x128), a scale = amax / 448 and the
values x / scale cast to float8_e4m3fn. Every step is the reference's in the same fp32 arithmetic (a max is exact in
any order, the divisions are IEEE, the cast rounds to nearest even), so values and scales are bit-identical to it;
tests/model/kernels/test_fp8_quant.py holds it to that under TRITON_INTERPRET=1.

One program per token and 16 groups (per token: the whole row): the features are read once, reduced to each group's
amax in registers, and stored as fp8 with the scales. Block-wise scales are written column-major with strides
(1, rows) and the rows padded to a multiple of 4 (zero values, unit scales), as cuBLASLt's block-scaled GEMM wants
them; the launch depends only on the input's shape, so a decode step that runs it is CUDA-graph capturable.

`quantize_weight` is rlserve.model.fp8's `Fp8Scheme.quantize` in one pass over the weight (read once, fp8 and scales
written once), with the same bits for the same reasons; the PyTorch form takes about ten passes and an fp32
temporary of the weight's size, which made a full 8B update's FP8 load 7.4x bf16's copy on an H100 (2026-12-07).
Block-wise one program per 128x128 block, read once into registers; per-channel one per few rows, looping over
their columns twice (amax, then values: the second read comes from L2) unless they fit in one chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlserve.model.fp8 import BLOCK, FP8_DTYPE, FP8_MAX, MIN_AMAX, Fp8Scheme, scaled_mm_rows


# The token count (and the block-wise scales' column stride, the padded count) changes every step: specialising on it
# (== 1, divisible by 16) would compile variants mid-run.
@triton.jit(do_not_specialize=["num_tokens", "stride_scale_group"])
def _quantize_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    num_tokens,
    num_groups,
    group_size,
    stride_x,
    stride_q,
    stride_scale_token,
    stride_scale_group,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row `token`'s groups [GROUPS * g, GROUPS * (g + 1)) of group_size features each -> fp8 values and one scale
    per group. A row past num_tokens is padding: zero values, scale 1."""
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    feature = tl.arange(0, BLOCK)
    offs = group[:, None] * group_size + feature[None, :]
    write = (group < num_groups)[:, None] & (feature < group_size)[None, :]
    real = token < num_tokens
    read = (group < num_groups)[:, None] & (feature < tl.where(real, group_size, 0))[None, :]  # padding reads nothing
    x = tl.load(x_ptr + token * stride_x + offs, mask=read, other=0.0).to(tl.float32)
    # The reference's order: the amax clamped from below (an all-zero group gets a tiny scale, never 0), then / 448.
    # div_rn: Triton's `/` on fp32 is the GPU's approximate division (div.full.f32, up to 2 ulp off), which flipped
    # the fp8 rounding of about one value in a million against PyTorch's IEEE division on an H100 (2026-12-07); the
    # reference divides the scale by a tensor too (rlserve.model.fp8._scale_of says why).
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX), FP8_MAX)
    scale = tl.where(real, scale, 1.0)
    q = tl.clamp(tl.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + token * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=write)
    tl.store(scale_ptr + token * stride_scale_token + group * stride_scale_group, scale, mask=group < num_groups)


# 128-feature groups per program: a whole row of a 2,048-wide activation, so that a program is not one warp's 128
# values (32,768 programs for 1,024 tokens of a 4,096-wide row, scheduled in waves).
_GROUPS_PER_PROGRAM = 16


def quantize_activation(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, features] in the model dtype -> (q [rows, features] float8_e4m3fn, scales fp32) for scaled_mm:
    group None: one scale per token, [tokens, 1] (rows = tokens); group 128: one per token and group,
    [rows, features / 128] column-major, rows = tokens padded to a multiple of 4."""
    if x.dim() != 2:
        raise ValueError(f"fp8 activation quantization takes [tokens, features], got shape {list(x.shape)}")
    num_tokens, features = x.shape
    if group is not None and features % group:
        raise ValueError(f"fp8 activation quantization: {features} features are not a multiple of the group {group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows = scaled_mm_rows(num_tokens, group)
    q = torch.empty((rows, features), dtype=FP8_DTYPE, device=x.device)
    if group is None:
        scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
        group_size, groups_per_program, strides = features, 1, (1, 0)
    else:
        scales = torch.empty_strided((rows, features // group), (1, rows), dtype=torch.float32, device=x.device)
        group_size, strides = group, (1, rows)
        groups_per_program = min(_GROUPS_PER_PROGRAM, triton.next_power_of_2(features // group))
    if rows == 0:
        return q, scales
    num_groups, block = features // group_size, triton.next_power_of_2(group_size)
    warps = min(max(groups_per_program * block // 512, 1), 16)
    _quantize_kernel[(rows, triton.cdiv(num_groups, groups_per_program))](
        x, q, scales, num_tokens, num_groups, group_size, x.stride(0), q.stride(0), *strides,
        FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, GROUPS=groups_per_program, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return q, scales


@triton.jit
def _quantize_weight_kernel(
    w_ptr,
    q_ptr,
    scale_ptr,
    rows,
    cols,
    stride_w,
    stride_q,
    stride_scale_row,
    stride_scale_col,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Rows [BLOCK_R * r, BLOCK_R * (r + 1)) and columns [SPAN * c, SPAN * (c + 1)) -> fp8 values and their scales:
    PER_BLOCK one scale for the whole tile (BLOCK_R = SPAN = 128), else one per row (SPAN covers all columns)."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    first_col = tl.program_id(1).to(tl.int64) * SPAN
    row_ok = row < rows
    if SPAN == BLOCK_C:  # the tile fits in registers (every block-wise tile): read it once
        col = first_col + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (col < cols)[None, :]
        tile = tl.load(w_ptr + row[:, None] * stride_w + col[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(tile), axis=1)
    else:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for start in range(0, SPAN, BLOCK_C):
            col = first_col + start + tl.arange(0, BLOCK_C)
            mask = row_ok[:, None] & (col < cols)[None, :]
            x = tl.load(w_ptr + row[:, None] * stride_w + col[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    if PER_BLOCK:
        amax = tl.zeros_like(amax) + tl.max(amax, axis=0)
    # The reference's order and IEEE divisions (div_rn; the quantize_activation kernel says why).
    scale = tl.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX)
    if SPAN == BLOCK_C:
        q = tl.clamp(tl.div_rn(tile, scale[:, None]), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row[:, None] * stride_q + col[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    else:  # a second read per chunk, from L2 for a few rows' worth of columns
        for start in range(0, SPAN, BLOCK_C):
            col = first_col + start + tl.arange(0, BLOCK_C)
            mask = row_ok[:, None] & (col < cols)[None, :]
            x = tl.load(w_ptr + row[:, None] * stride_w + col[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(tl.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
            tl.store(q_ptr + row[:, None] * stride_q + col[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    if PER_BLOCK:  # one lane writes the tile's scale
        lane = tl.arange(0, BLOCK_R)
        where = tl.program_id(0) * stride_scale_row + tl.program_id(1) * stride_scale_col + lane * 0
        tl.store(scale_ptr + where, scale, mask=lane == 0)
    else:
        tl.store(scale_ptr + row * stride_scale_row, scale, mask=row_ok)


# Per-channel: rows per program and the column chunk each loop step reads (4 x 1024 fp32 values in registers).
_CHANNEL_ROWS, _CHANNEL_CHUNK = 4, 1024


def quantize_weight(
    weight: torch.Tensor, scheme: Fp8Scheme, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scheme.quantize(weight)` in one launch, the same bits: (q [out, in] float8_e4m3fn, scales fp32), block-wise
    `weight_scale_inv` [ceil(out/128), ceil(in/128)], per-channel `weight_scale` [out, 1]; written into `out`
    (q, scales: views with unit column strides, such as a model's parameters) if given."""
    if weight.dim() != 2:
        raise ValueError(f"fp8 weight quantization takes a 2-d weight, got shape {list(weight.shape)}")
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    rows, cols = weight.shape
    scale_shape = scheme.scale_shape(rows, cols)
    if out is None:
        q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=weight.device)
        scales = torch.empty(scale_shape, dtype=torch.float32, device=weight.device)
    else:
        q, scales = out
        wanted = (("q", q, (rows, cols), FP8_DTYPE), ("scales", scales, scale_shape, torch.float32))
        for what, tensor, shape, dtype in wanted:
            if tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device != weight.device:
                raise ValueError(
                    f"fp8 weight quantization: out {what} is {list(tensor.shape)} {tensor.dtype} on {tensor.device}, "
                    f"the weight needs {list(shape)} {dtype} on {weight.device}"
                )
        if q.stride(-1) != 1:
            raise ValueError(f"fp8 weight quantization: out q needs unit column stride, has strides {q.stride()}")
    if weight.numel() == 0:
        return q, scales
    if scheme.block_wise:
        grid, span, block_r, block_c, warps = (scales.shape[0], scales.shape[1]), BLOCK, BLOCK, BLOCK, 8
    else:
        span = triton.cdiv(cols, _CHANNEL_CHUNK) * _CHANNEL_CHUNK  # a constexpr: one compile per column count
        grid, block_r, block_c, warps = (triton.cdiv(rows, _CHANNEL_ROWS), 1), _CHANNEL_ROWS, _CHANNEL_CHUNK, 4
    _quantize_weight_kernel[grid](
        weight, q, scales, rows, cols, weight.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
        FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, PER_BLOCK=scheme.block_wise, SPAN=span, BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    return q, scales
