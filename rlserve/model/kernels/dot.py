"""tl.dot as rlserve's Triton kernels use it, on the GPU and under Triton's CPU interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Whether triton.jit makes kernels CPU-interpreted functions (it reads the same variable at decoration).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def dot(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    if DOT_UPCAST:
        # Triton's CPU interpreter multiplies bf16 operands as their raw uint16 bits; fp32 operands holding the same
        # bf16 values give the product the GPU computes.
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands are for exactness: keep tl.dot in full precision rather than tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_upcast(dtype: torch.dtype) -> bool:
    # The interpreter multiplies fp8 operands as their raw uint8 bits too.
    return dtype in (torch.bfloat16, torch.float8_e4m3fn) and INTERPRETED
