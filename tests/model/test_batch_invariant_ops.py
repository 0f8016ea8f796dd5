"""The CPU side of rlserve.model.batch_invariant: linear rows and attended queries independent of their batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlserve.model import batch_invariant


@pytest.mark.parametrize(("in_features", "out_features"), [(64, 192), (128, 1000), (896, 4864)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_do_not_depend_on_the_number_of_rows(in_features, out_features, bias) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(600, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    full = batch_invariant.linear(x, weight, b)
    torch.testing.assert_close(full, F.linear(x, weight, b))
    for rows in [*range(1, 20), 31, 64, 257]:
        assert torch.equal(batch_invariant.linear(x[:rows], weight, b), full[:rows]), rows
        assert torch.equal(batch_invariant.linear(x[-rows:], weight, b), full[-rows:]), rows
    # Leading dimensions are kept.
    assert torch.equal(batch_invariant.linear(x[:12].view(3, 4, -1), weight, b), full[:12].view(3, 4, -1))


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_each_query_sees_exactly_its_keys_whatever_the_step(heads, kv_heads) -> None:
    gen = torch.Generator().manual_seed(1)
    seq, dim = 37, 16
    q = torch.randn(seq, heads, dim, generator=gen)
    k = torch.randn(seq, kv_heads, dim, generator=gen)
    v = torch.randn(seq, kv_heads, dim, generator=gen)
    scale = dim**-0.5
    prefill = batch_invariant.attend_each_query(q, k, v, 0, scale)
    reference = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale,
        enable_gqa=heads != kv_heads,
    ).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(prefill, reference)
    # Decode steps (one query over its context) and a chunk in the middle give the same bits as the prefill.
    for pos in (0, 15, 16, 36):
        decode = batch_invariant.attend_each_query(q[pos : pos + 1], k[: pos + 1], v[: pos + 1], pos, scale)
        assert torch.equal(decode, prefill[pos : pos + 1])
    chunk = batch_invariant.attend_each_query(q[10:20], k[:20], v[:20], 10, scale)
    assert torch.equal(chunk, prefill[10:20])
