"""CPU checks of the batch-invariant Triton matmul (rlserve.model.kernels.batch_invariant_matmul) under
TRITON_INTERPRET=1: it computes x @ w.T (+ bias), and a row's bits do not depend on how many rows are computed with it.

interpret_helpers.py sets the interpreter up (or re-runs these checks in a fresh process where triton was imported
before it could).
"""

from __future__ import annotations

import interpret_helpers  # first: sets TRITON_INTERPRET before anything imports triton
import pytest
import torch

interpret_helpers.require_triton()

from rlserve.model.batch_invariant import triton_linear  # noqa: E402
from rlserve.model.kernels.batch_invariant_matmul import (  # noqa: E402
    NARROW_TILE,
    SMALL_TILE,
    WIDE_TILE,
    matmul,
    tile_for,
)

interpreted = interpret_helpers.interpreted

if not interpret_helpers.IN_PROCESS:

    def test_in_fresh_process():
        interpret_helpers.run_in_fresh_process(__file__)


# Tails in every dimension: more rows than one tile, K not a multiple of BLOCK_K, N not a multiple of BLOCK_N.
M, K, N = SMALL_TILE.block_m + 11, SMALL_TILE.block_k + 24, SMALL_TILE.block_n + 9


def operands(dtype: torch.dtype, bias: bool):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(N, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    return x, w, b


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_computes_x_times_w_transposed(dtype, bias) -> None:
    x, w, b = operands(dtype, bias)
    out = matmul(x, w, b)
    assert out.dtype == dtype and out.shape == (M, N)
    expected = x.float() @ w.float().T + (b.float() if bias else 0.0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * K**0.5)


@interpreted
@pytest.mark.parametrize("tile", [SMALL_TILE, NARROW_TILE, WIDE_TILE])
def test_rows_do_not_depend_on_the_batch(tile) -> None:
    gen = torch.Generator().manual_seed(2)
    m, k, n = tile.block_m + 11, tile.block_k + 24, tile.block_n + 9
    x, w, b = (torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in ((m, k), (n, k), (n,)))
    full = matmul(x, w, b, tile)
    torch.testing.assert_close(full.float(), x.float() @ w.float().T + b.float(), rtol=2e-2, atol=2e-2 * k**0.5)
    for rows in (1, 2, 17, tile.block_m, tile.block_m + 1):
        assert torch.equal(matmul(x[:rows], w, b, tile), full[:rows]), rows
        assert torch.equal(matmul(x[-rows:], w, b, tile), full[-rows:]), rows


def test_the_tile_is_a_function_of_the_weight() -> None:
    """Qwen3-0.6B's weights in bf16: the wide tile for qkv (4096 x 1024), gate_up and the LM head, the narrow one for
    o_proj and down_proj (N = hidden = 1024); fp32 weights (an fp32 LM head) the small one."""
    assert tile_for(4096, 1024, 2) == tile_for(6144, 1024, 2) == tile_for(151936, 1024, 2) == WIDE_TILE
    assert tile_for(1024, 2048, 2) == tile_for(1024, 3072, 2) == NARROW_TILE
    assert tile_for(151936, 1024, 4) == SMALL_TILE


@interpreted
def test_strided_rows_and_bad_shapes() -> None:
    x, w, _ = operands(torch.float32, False)
    wide = torch.zeros(M, 2 * K)
    wide[:, ::2] = x  # rows and columns both strided
    assert torch.equal(matmul(wide[:, ::2], w), matmul(x, w))
    with pytest.raises(ValueError, match="x must be"):
        matmul(x[:, :-1], w)
    with pytest.raises(ValueError, match="dtype|is torch"):
        matmul(x.double(), w)
    assert matmul(x[:0], w).shape == (0, N)


@interpreted
@pytest.mark.parametrize("bias", [False, True])
def test_triton_linear_has_the_kernels_values_and_linears_gradients(bias) -> None:
    """The trainer's path (rlserve.model.batch_invariant.triton_linear): the kernel's bits forward, and the gradients
    of F.linear for x, the weight and the bias."""
    x, w, b = operands(torch.float32, bias)
    leaves = [t.clone().requires_grad_() for t in (x, w, *([b] if bias else []))]
    out = triton_linear(*leaves)
    assert out.requires_grad and torch.equal(out.detach(), matmul(x, w, b))
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, leaves, grad_out)
    reference = [t.clone().requires_grad_() for t in leaves]
    expected = torch.autograd.grad(torch.nn.functional.linear(*reference), reference, grad_out)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * K**0.5)
    with torch.no_grad():
        assert not triton_linear(*leaves).requires_grad
