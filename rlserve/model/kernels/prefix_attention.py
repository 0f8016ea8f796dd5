"""Grouped decode attention: a shared prefix read once per group of sequences (Hydragen-style), over the paged cache.

Sequences that share their leading KV blocks (found on the host: rlserve.model.attention.prefix_groups) split their
decode attention in two. The prefix kernel runs one program per (work item, kv head, prefix split), an item being up
to BLOCK_M // G members of one group: it stacks their G query heads as the M rows of one matmul and streams the
group's shared blocks once for all of them. Each sequence's own keys after the prefix (its whole context when
ungrouped) go through the split-KV decode kernel with a per-sequence start. Both write partial outputs with their
log-sum-exp into one buffer, and the decode reduce kernel merges every partial of a (sequence, head): the one merge
formula.

Launch grids come from host ints and tensor shapes only, as in paged_attention, so the wrapper never reads device
memory on the host and a CUDA graph can capture it over fixed-capacity metadata (items of 0 members do nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlserve.model.kernels.dot import dot_precision, dot_upcast
from rlserve.model.kernels.paged_attention import (
    _LOG2E,
    _M_FLOOR,
    _MAX_DECODE_SPLITS,
    _MIN_TOKENS_PER_SPLIT,
    _attend_kv_tile,
    _check_attention_shapes,
    _decode_config,
    _decode_num_splits,
    _decode_reduce_kernel,
    _num_sms,
    _output_like,
    _paged_decode_kernel,
)

# The prefix tile holds 4x the decode tile's query rows, so its K/V pipeline keeps 2 tiles in flight, not 3: 2 x 64 KB
# of 128-key bf16 K and V tiles fit an H100/H200's shared memory beside the tile math. Not tuned yet (no GPU run).
_PREFIX_STAGES = 2


@triton.jit(do_not_specialize=["stride_bt"])  # see paged_attention._paged_attention_kernel
def _prefix_group_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,
    part_lse_ptr,
    member_rows_ptr,
    items_ptr,
    block_tables_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    stride_bt,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MEMBERS_PER_TILE: tl.constexpr,
    PREFIX_SPLITS: tl.constexpr,
    FIRST_PARTIAL: tl.constexpr,
    NUM_PARTIALS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    item = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    first_member = tl.load(items_ptr + item * 3)
    num_members = tl.load(items_ptr + item * 3 + 1)
    if num_members == 0:  # an unused item of a CUDA graph's fixed capacity
        return
    shared_len = tl.load(items_ptr + item * 3 + 2)
    tiles_per_split = tl.cdiv(tl.cdiv(shared_len, BLOCK_N), PREFIX_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, shared_len)
    full_end = start + (tl.maximum(end - start, 0) // BLOCK_N) * BLOCK_N

    # Row r of the tile is the item's member r // G, in query head kv_head * G + r % G.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    member = offs_m // G
    head = kv_head * G + offs_m % G
    row_valid = (offs_m < MEMBERS_PER_TILE * G) & (member < num_members)  # num_members <= MEMBERS_PER_TILE
    d_valid = offs_d < HEAD_DIM
    seq = tl.load(member_rows_ptr + first_member + member, mask=row_valid, other=0).to(tl.int64)
    q_off = seq[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    # Every member holds the prefix in the same blocks: the first member's block table serves the whole item.
    first_seq = tl.load(member_rows_ptr + first_member).to(tl.int64)
    block_table_ptr = block_tables_ptr + first_seq * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_ch
    v_head_ptr = v_cache_ptr + kv_head * stride_ch
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _M_FLOOR, dtype=tl.float32)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32)  # unused: a decode query sees the whole prefix
    for start_n in range(start, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, q_pos, start_n, end, k_head_ptr, v_head_ptr, block_table_ptr, qk_scale,
            stride_cb, stride_ct, stride_cd,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, False, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip
    for start_n in range(full_end, end, BLOCK_N):  # the ragged last tile, if any
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, q_pos, start_n, end, k_head_ptr, v_head_ptr, block_table_ptr, qk_scale,
            stride_cb, stride_ct, stride_cd,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, False, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    # The partial layout of the decode kernel: [B, Hq, NUM_PARTIALS, BLOCK_D] and [B, Hq, NUM_PARTIALS], log2 domain.
    row = (seq * (tl.num_programs(1) * G) + head) * NUM_PARTIALS + FIRST_PARTIAL + split
    tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=row_valid[:, None] & d_valid[None, :])
    tl.store(part_lse_ptr + row, lse, mask=row_valid)


def grouped_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    member_rows: torch.Tensor,
    items: torch.Tensor,
    suffix_starts: torch.Tensor,
    members_per_item: int,
    max_shared_len: int,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    prefix_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] (each sequence's one query, its key already stored) equal to
    paged_decode_attention's, with each group's shared prefix read once per work item instead of once per sequence.

    items [I, 3] int32: each work item's (first index into member_rows, member count <= members_per_item, shared
    tokens <= max_shared_len); its members are batch rows member_rows[first:first + count] that hold their first
    `shared` context tokens (whole blocks) in the same physical blocks. suffix_starts [B] is where each sequence's own
    keys begin: its group's shared tokens, 0 when ungrouped (rlserve.model.attention.prefix_groups builds all three).
    num_splits splits each sequence's own keys as paged_decode_attention does (by default from the batch and
    max_seq_len); prefix_splits splits the prefixes (by default from the items and max_shared_len).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, group = _check_attention_shapes(q, k_cache, v_cache, block_tables, batch)
    num_items = items.shape[0]
    if seq_lens.shape != (batch,) or suffix_starts.shape != (batch,):
        raise ValueError(f"seq_lens and suffix_starts must be [{batch}], got {seq_lens.shape}, {suffix_starts.shape}")
    if items.dim() != 2 or items.shape[1] != 3 or not items.is_contiguous():
        raise ValueError(f"items must be a contiguous [num_items, 3], got {tuple(items.shape)}")
    out = _output_like(q, out)
    if batch == 0:
        return out
    block_size = k_cache.shape[1]
    max_seq_len = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    block_m = max(16, triton.next_power_of_2(members_per_item * group))
    if num_splits is None:
        num_splits = _decode_num_splits(batch, num_kv_heads, max_seq_len, q.device)
    if prefix_splits is None:
        prefix_splits = _prefix_num_splits(num_items, num_kv_heads, max_shared_len, q.device)
    num_partials = num_splits + prefix_splits
    block_n, num_warps, num_stages = _decode_config(head_dim, q.element_size())
    block_d = triton.next_power_of_2(head_dim)
    part_out = torch.empty((batch, num_heads, num_partials, block_d), dtype=torch.float32, device=q.device)
    # A sequence outside every group has no prefix partial: its slots must weigh nothing in the merge.
    part_lse = torch.full((batch, num_heads, num_partials), float("-inf"), dtype=torch.float32, device=q.device)
    common = dict(
        G=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype), DOT_UPCAST=dot_upcast(q.dtype), num_warps=num_warps,
    )  # fmt: skip
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, seq_lens, suffix_starts, block_tables, scale * _LOG2E,
        *q.stride(), *out.stride(), *k_cache.stride(), block_tables.stride(0),
        BLOCK_H=max(16, triton.next_power_of_2(group)), NUM_SPLITS=num_splits, HAS_START=True,
        NUM_PARTIALS=num_partials, num_stages=num_stages, **common,
    )  # fmt: skip
    if num_items:
        _prefix_group_kernel[(num_items, num_kv_heads, prefix_splits)](
            q, k_cache, v_cache, part_out, part_lse, member_rows, items, block_tables,
            scale * _LOG2E, *q.stride(), *k_cache.stride(), block_tables.stride(0),
            BLOCK_M=block_m, MEMBERS_PER_TILE=members_per_item, PREFIX_SPLITS=prefix_splits, FIRST_PARTIAL=num_splits,
            NUM_PARTIALS=num_partials, num_stages=_PREFIX_STAGES, **common,
        )  # fmt: skip
    _decode_reduce_kernel[(batch, num_heads)](
        part_out, part_lse, out, *out.stride(),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_partials,
        BLOCK_S=triton.next_power_of_2(num_partials), num_warps=4 if block_d >= 128 else 2,
    )  # fmt: skip
    return out


def _prefix_num_splits(num_items: int, num_kv_heads: int, max_shared_len: int, device: torch.device) -> int:
    """Split the prefixes only when (item, kv head) programs alone cannot fill the GPU about twice over (one group with
    a 4k prompt is 8 programs on a 132-SM GPU), as _decode_num_splits does for contexts."""
    programs = max(1, num_items * num_kv_heads)
    target = 2 * _num_sms(device)
    if programs >= target:
        return 1
    by_length = max(1, max_shared_len // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(triton.cdiv(target, programs), by_length, _MAX_DECODE_SPLITS))
