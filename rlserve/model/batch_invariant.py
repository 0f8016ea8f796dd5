"""Batch-invariant linear layers and CPU attention: a row's result does not depend on the other rows computed with it.

GEMM libraries pick their algorithm (and with it the order of the reduction over K) from the problem's shape, so the
same row multiplied alone and inside a batch of 300 can differ in its last bits; so can a query attended to by a
decode step and by a prefill. In batch-invariant mode (`EngineConfig.batch_invariant`) the engine computes every row
the same way whatever the batch, which makes a request's logprobs independent of what else runs, and equal, bit for
bit, to rlserve's trainer-side forward (`rlserve.rl.train_forward`), which runs these same functions.

- CUDA: one Triton matmul with a fixed tile shape and no split over K, so each output element is reduced over K in
  the same order for any number of rows.
- CPU: the BLAS GEMM path. It takes a different kernel for very few rows (1 to about 8), and the same one from 16 rows
  up (checked by tests/model/test_batch_invariant.py); inputs with fewer rows are padded to 16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_MIN_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias), computed per row independently of the number of rows."""
    rows = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        from rlserve.model.kernels.batch_invariant_matmul import matmul

        out = matmul(rows, weight, bias)
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
