"""Dynamic FP8 activation quantization in one launch, written straight into the layout torch's scaled_mm takes.

`quantize_activation` computes what rlserve.model.fp8.scaled_mm_activation computes with about eight small PyTorch
kernels (abs, amax, clamp, divide, divide, clamp, cast, and for block-wise scales a padded column-major copy): per
token (fbgemm_fp8, RowWise) or per token and 128-feature group (fp8, BlockWise1x128), a scale = amax / 448 and the
values x / scale cast to float8_e4m3fn. Every step is the reference's in the same fp32 arithmetic (a max is exact in
any order, the divisions are IEEE, the cast rounds to nearest even), so values and scales are bit-identical to it;
tests/model/kernels/test_fp8_quant.py holds it to that under TRITON_INTERPRET=1.

One program per (token, group): the group's features are read once, reduced to their amax in registers, and stored
as fp8 with the scale. Block-wise scales are written column-major with strides (1, rows) and the rows padded to a
multiple of 4 (zero values, unit scales), as cuBLASLt's block-scaled GEMM wants them; the launch depends only on the
input's shape, so a decode step that runs it is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlserve.model.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX, scaled_mm_rows


# The token count (and the block-wise scales' column stride, the padded count) changes every step: specialising on it
# (== 1, divisible by 16) would compile variants mid-run.
@triton.jit(do_not_specialize=["num_tokens", "stride_scale_group"])
def _quantize_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    num_tokens,
    group_size,
    stride_x,
    stride_q,
    stride_scale_token,
    stride_scale_group,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row `token`'s features [group * group_size, (group + 1) * group_size) -> fp8 values and one scale. A row past
    num_tokens is padding: zero values, scale 1."""
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * group_size + tl.arange(0, BLOCK)
    in_group = tl.arange(0, BLOCK) < group_size
    real = token < num_tokens
    read = tl.arange(0, BLOCK) < tl.where(real, group_size, 0)  # a padding row reads nothing
    x = tl.load(x_ptr + token * stride_x + offs, mask=read, other=0.0).to(tl.float32)
    # The reference's order: the amax clamped from below (an all-zero group gets a tiny scale, never 0), then / 448.
    # div_rn: Triton's `/` on fp32 is the GPU's approximate division (div.full.f32, up to 2 ulp off), which flipped
    # the fp8 rounding of about one value in a million against PyTorch's IEEE division on an H100 (2026-12-07); the
    # reference divides the scale by a tensor too (rlserve.model.fp8._scale_of says why).
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX), FP8_MAX)
    scale = tl.where(real, scale, 1.0)
    q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + token * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=in_group)
    tl.store(scale_ptr + token * stride_scale_token + group * stride_scale_group, scale)


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
        group_size, block, strides = features, triton.next_power_of_2(features), (1, 0)
    else:
        scales = torch.empty_strided((rows, features // group), (1, rows), dtype=torch.float32, device=x.device)
        group_size, block, strides = group, triton.next_power_of_2(group), (1, rows)
    if rows == 0:
        return q, scales
    _quantize_kernel[(rows, features // group_size)](
        x, q, scales, num_tokens, group_size, x.stride(0), q.stride(0), *strides,
        FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, BLOCK=block, num_warps=min(max(block // 512, 1), 16),
    )  # fmt: skip
    return q, scales
