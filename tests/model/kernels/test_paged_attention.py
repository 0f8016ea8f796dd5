"""CPU checks of the Triton paged-attention kernels under TRITON_INTERPRET=1 against a float64 PyTorch reference.

Shapes are tiny so the interpreter stays fast; every case randomises the block tables (blocks out of order), fills
cache slots that no sequence owns with NaN (any stray read shows up), feeds strided q/k/v views as a fused qkv
projection produces them, and poisons the output with NaN so an unwritten element fails.

interpret_helpers.py sets the interpreter up (or re-runs these checks in a fresh process where triton was imported
before it could).
"""

from __future__ import annotations

from dataclasses import dataclass

import interpret_helpers  # first: sets TRITON_INTERPRET before anything imports triton
import pytest
import torch

interpret_helpers.require_triton()

from rlserve.model.kernels.paged_attention import (  # noqa: E402
    paged_attention,
    paged_decode_attention,
    store_kv_cache,
)

interpreted = interpret_helpers.interpreted

if not interpret_helpers.IN_PROCESS:

    def test_in_fresh_process():
        interpret_helpers.run_in_fresh_process(__file__)


TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D] strided view
    k_new: torch.Tensor  # [T, Hkv, D] strided views: this step's keys / values
    v_new: torch.Tensor
    slots: torch.Tensor  # [T]; -1 for padding tokens
    k_cache: torch.Tensor  # holds each sequence's earlier context; NaN wherever no sequence will own a slot
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    q_lens: list[int]
    ctx_lens: list[int]  # seq_len per sequence


def make_batch(
    lens: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> PagedBatch:
    """lens holds (q_len, seq_len) per sequence; a sequence with seq_len < q_len is padding (its slots are -1)."""
    num_heads = num_kv_heads * group
    num_tokens = sum(q for q, _ in lens)
    blocks_needed = [-(-s // block_size) for _, s in lens]
    max_blocks = max(blocks_needed) + 2  # spare columns hold garbage that must never be read
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.randint(-1, 10**6, (len(lens), max_blocks), generator=gen, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype)  # fused projection output: q, k, v are views
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k_new = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, -1)
    v_new = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    next_block, row = 0, 0
    for b, (q_len, seq_len) in enumerate(lens):
        ids = perm[next_block : next_block + blocks_needed[b]]
        next_block += blocks_needed[b]
        block_tables[b, : len(ids)] = ids.to(torch.int32)
        if seq_len >= q_len:
            positions = torch.arange(seq_len)
            slot_of = ids[positions // block_size] * block_size + positions % block_size
            context = slot_of[: seq_len - q_len]  # already cached before this step
            flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
            flat_k[context] = torch.randn(len(context), num_kv_heads, head_dim, generator=gen).to(dtype)
            flat_v[context] = torch.randn(len(context), num_kv_heads, head_dim, generator=gen).to(dtype)
            slots[row : row + q_len] = slot_of[seq_len - q_len :]
        row += q_len
    cu = torch.tensor([0] + [q for q, _ in lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in lens], dtype=torch.int32)
    return PagedBatch(
        q, k_new, v_new, slots, k_cache, v_cache, cu, seq_lens, block_tables, [q for q, _ in lens], seq_lens.tolist()
    )


def reference_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """float64 causal attention per sequence, gathering K/V through the block table; zeros for padding rows."""
    num_tokens, num_heads, head_dim = batch.q.shape
    block_size, num_kv_heads = batch.k_cache.shape[1], batch.k_cache.shape[2]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    row = 0
    for b, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
        if q_len == 0 or seq_len == 0:
            row += q_len
            continue
        ids = batch.block_tables[b, : -(-seq_len // block_size)].long()
        keys = batch.k_cache[ids].flatten(0, 1)[:seq_len].double()  # [S, Hkv, D]
        values = batch.v_cache[ids].flatten(0, 1)[:seq_len].double()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        query = batch.q[row : row + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > q_pos, float("-inf"))
        out[row : row + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        row += q_len
    return out


def reference_store(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    valid = batch.slots >= 0
    k_cache.view(-1, *k_cache.shape[2:])[batch.slots[valid]] = batch.k_new[valid]
    v_cache.view(-1, *v_cache.shape[2:])[batch.slots[valid]] = batch.v_new[valid]
    return k_cache, v_cache


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "some output element was not written (still NaN)"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert (out.double() - ref).norm() <= tol * ref.norm()


@interpreted
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("dtype", "num_kv_heads", "head_dim", "block_size"),
    [(torch.float32, 2, 32, 16), (torch.bfloat16, 3, 64, 32), (torch.float16, 1, 48, 16)],
)
def test_store_kv_cache(slot_dtype, dtype, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(0)
    batch = make_batch([(5, 21), (0, 0), (3, 3), (2, 0), (4, 40)], num_kv_heads, 2, head_dim, block_size, dtype, gen)
    expected_k, expected_v = reference_store(batch)
    store_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slots.to(slot_dtype))
    # equal_nan: untouched slots keep their NaN poison, so a stray write (e.g. for slot -1) would show up.
    assert torch.equal(batch.k_cache.isnan(), expected_k.isnan())
    torch.testing.assert_close(batch.k_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, expected_v, atol=0, rtol=0, equal_nan=True)


# (q_len, seq_len) per sequence: full prefills, a chunked prefill, prefix-cache hits (context ends mid-block and on a
# block boundary), decodes, and CUDA-graph padding (q_len 0, and a q_len 1 row with seq_len 0).
MIXED = [(37, 37), (0, 0), (20, 70), (5, 48), (1, 33), (12, 44), (1, 0), (1, 1), (18, 18)]


@interpreted
@pytest.mark.parametrize(
    ("dtype", "group", "head_dim", "block_size"),
    [
        (torch.float32, 1, 32, 16),
        (torch.bfloat16, 2, 64, 32),
        (torch.bfloat16, 4, 32, 16),
        (torch.float32, 4, 64, 32),
        (torch.float16, 3, 32, 16),
    ],
)
def test_paged_attention_mixed_batch(dtype, group, head_dim, block_size):
    gen = torch.Generator().manual_seed(1)
    batch = make_batch(MIXED, 2, group, head_dim, block_size, dtype, gen)
    store_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slots)
    scale = head_dim**-0.5
    out = torch.full(batch.q.shape, float("nan"), dtype=dtype)
    result = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, scale,
        max_seqlen_q=max(batch.q_lens), out=out,
    )  # fmt: skip
    assert result is out
    assert_matches(out, reference_attention(batch, scale), dtype)


@interpreted
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_long_prefill_tiles(block_size):
    """A 160-token prompt spans several 64-key tiles and query tiles, so both the unmasked and causal loops run."""
    gen = torch.Generator().manual_seed(2)
    dtype = torch.bfloat16
    batch = make_batch([(160, 160), (70, 150)], 1, 2, 32, block_size, dtype, gen)
    store_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slots)
    out = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, 0.2,
        max_seqlen_q=160,
    )  # fmt: skip
    assert_matches(out, reference_attention(batch, 0.2), dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_query_bits_do_not_depend_on_the_step(dtype):
    """batch_invariant=True: a query's output bits are the same in its whole prompt's prefill, in a chunk, in a decode
    step alone and in a decode step beside another sequence, over one cache (what makes the engine's decode equal
    the trainer's whole-sequence forward)."""
    gen = torch.Generator().manual_seed(7)
    batch = make_batch([(150, 150), (30, 30)], 2, 2, 32, 16, dtype, gen)
    store_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slots)

    def attend(q, q_lens, seq_lens, rows):
        cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return paged_attention(
            q, batch.k_cache, batch.v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), batch.block_tables[rows],
            0.25, max(q_lens), batch_invariant=True,
        )  # fmt: skip

    full = attend(batch.q, [150, 30], [150, 30], [0, 1])
    assert_matches(full, reference_attention(batch, 0.25), dtype)
    assert torch.equal(attend(batch.q[110:150], [40], [150], [0]), full[110:150])
    for p in (0, 15, 16, 37, 127, 128, 149):
        assert torch.equal(attend(batch.q[p : p + 1], [1], [p + 1], [0]), full[p : p + 1]), p
        beside = attend(torch.cat([batch.q[p : p + 1], batch.q[179:180]]), [1, 1], [p + 1, 30], [0, 1])
        assert torch.equal(beside, full[[p, 179]]), p


@interpreted
def test_paged_attention_decode_rows():
    """A decode-only batch through the varlen kernel (max_seqlen_q 1 picks the smallest tile)."""
    gen = torch.Generator().manual_seed(3)
    batch = make_batch([(1, 90), (1, 0), (1, 17), (1, 64)], 2, 2, 32, 16, torch.float32, gen)
    store_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slots)
    out = torch.full(batch.q.shape, float("nan"))
    paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, 0.3,
        max_seqlen_q=1, out=out,
    )  # fmt: skip
    assert_matches(out, reference_attention(batch, 0.3), torch.float32)


@interpreted
@pytest.mark.parametrize(
    ("dtype", "group", "head_dim", "block_size", "num_splits"),
    [
        (torch.float32, 1, 32, 16, None),
        (torch.bfloat16, 2, 64, 32, 1),
        (torch.bfloat16, 4, 32, 16, 3),
        (torch.float32, 2, 64, 16, 4),
        (torch.float16, 3, 32, 32, 2),
    ],
)
def test_paged_decode_attention(dtype, group, head_dim, block_size, num_splits):
    gen = torch.Generator().manual_seed(4)
    lens = [(1, 200), (1, 0), (1, 1), (1, 65), (1, 130)]
    batch = make_batch(lens, 2, group, head_dim, block_size, dtype, gen)
    store_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slots)
    scale = head_dim**-0.5
    out = torch.full(batch.q.shape, float("nan"), dtype=dtype)
    paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, scale, out=out,
        num_splits=num_splits, max_seq_len=256,
    )  # fmt: skip
    assert_matches(out, reference_attention(batch, scale), dtype)


@interpreted
def test_paged_decode_default_splits_small_batch():
    """A tiny batch with a long bound gets split-KV by default; the result must not depend on the split count."""
    gen = torch.Generator().manual_seed(5)
    batch = make_batch([(1, 300), (1, 129)], 1, 2, 32, 32, torch.float32, gen)
    store_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slots)
    ref = reference_attention(batch, 0.25)
    for num_splits in (None, 1):
        out = paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, 0.25, num_splits=num_splits,
            max_seq_len=1024,
        )  # fmt: skip
        assert_matches(out, ref, torch.float32)
