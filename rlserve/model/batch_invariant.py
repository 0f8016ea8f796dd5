"""Batch-invariant linear layers and CPU attention: a row's result does not depend on the other rows computed with it.

GEMM libraries pick their algorithm (and with it the order of the reduction over K) from the problem's shape, so the
same row multiplied alone and inside a batch of 300 can differ in its last bits; so can a query attended to by a
decode step and by a prefill. In batch-invariant mode (`EngineConfig.batch_invariant`) the engine computes every row
the same way whatever the batch, which makes a request's logprobs independent of what else runs, and equal, bit for
bit, to rlserve's trainer-side forward (`rlserve.rl.train_forward`), which runs these same functions.

- CUDA: one Triton matmul whose tile depends on the weight only, with no split over K, so each output element is
  reduced over K in the same order for any number of rows.
- CPU: the BLAS GEMM path. It takes a different kernel for very few rows (1 to about 8), and the same one from 16 rows
  up (checked by tests/model/test_batch_invariant.py); inputs with fewer rows are padded to 16.

A trainer runs the same forward with autograd on (rlserve.rl.train_forward): the Triton kernels have no backward of
their own, so each comes wrapped in an autograd function whose forward is the kernel (the engine's bits) and whose
backward is that of the PyTorch code computing the same function (`exact_values`; the matmul's is written out). The
backward is correct, not batch-invariant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

CPU_MIN_ROWS = 16


class _ExactValues(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, exact: Callable[..., Any], reference: Callable[..., Any], *tensors: torch.Tensor) -> Any:
        ctx.reference = reference
        ctx.save_for_backward(*tensors)
        return exact(*tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        needed = ctx.needs_input_grad[2:]
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needed, strict=True)]
        with torch.enable_grad():
            outputs = ctx.reference(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        wanted = [t for t, need in zip(inputs, needed, strict=True) if need]
        computed = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
        return None, None, *(next(computed) if need else None for need in needed)


def exact_values(exact: Callable[..., Any], reference: Callable[..., Any], *tensors: torch.Tensor) -> Any:
    """exact(*tensors) (a tensor or a tuple of new tensors), differentiable when autograd records: the backward
    recomputes reference(*tensors), the same function in differentiable PyTorch, and takes its gradients (as
    activation checkpointing recomputes a segment). `exact` must not write into its inputs."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _ExactValues.apply(exact, reference, *tensors)
    return exact(*tensors)


class _TritonLinear(torch.autograd.Function):
    """The fixed-tile matmul forward; the backward's two products by cuBLAS (they need not be batch-invariant)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from rlserve.model.kernels.batch_invariant_matmul import matmul

        ctx.save_for_backward(x, weight)
        return matmul(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad
        return (
            grad @ weight if need_x else None,
            grad.t() @ x if need_weight else None,
            grad.sum(0) if need_bias else None,
        )


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA path of `linear` on x [M, K] (any device under TRITON_INTERPRET=1), differentiable."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _TritonLinear.apply(x, weight, bias)
    from rlserve.model.kernels.batch_invariant_matmul import matmul

    return matmul(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias), computed per row independently of the number of rows."""
    rows = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        out = triton_linear(rows, weight, bias)
    else:
        num_rows = rows.shape[0]
        if num_rows < CPU_MIN_ROWS:
            rows = torch.cat([rows, rows.new_zeros(CPU_MIN_ROWS - num_rows, rows.shape[1])])
        out = F.linear(rows, weight, bias)[:num_rows]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def attend_each_query(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_position: int, scale: float
) -> torch.Tensor:
    """Causal attention of q [q_len, heads, dim], whose row i sits at position first_position + i, over keys/values
    [seq, kv_heads, dim]. Each query is attended to alone over exactly the keys it sees, so a query gives the same
    result in a decode step, a prefill chunk or a trainer's whole-sequence forward."""
    gqa = q.shape[1] != keys.shape[1]
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [kv_heads, seq, dim]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        seen = first_position + i + 1
        o = F.scaled_dot_product_attention(
            q[i].unsqueeze(1), keys[:, :seen], values[:, :seen], scale=scale, enable_gqa=gqa
        )
        out[i] = o.squeeze(1)
    return out
