"""Triton kernels over the paged KV cache: store, varlen causal attention, and split-KV decode.

Cache layout (fixed by the engine): k_cache / v_cache are [num_blocks, block_size, num_kv_heads, head_dim]; the
token at absolute position p of sequence b lives in block block_tables[b, p // block_size] at offset
p % block_size. Query head h reads kv head h // G (G = num_q_heads // num_kv_heads).

Every kernel program owns one kv head and processes all G query heads that share it, so each K/V tile is loaded once
and reused G times. Softmax runs online (flash-attention style) in fp32, in the log2 domain so exp2 can be used.

The wrappers are CUDA-graph capturable: launch grids and tile shapes come only from tensor shapes and Python ints,
nothing reads device memory on the host, and scratch buffers come from torch's allocator.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rlserve.model.kernels.dot import dot, dot_precision, dot_upcast

_LOG2E = 1.4426950408889634
# Running row maxima start at a finite floor instead of -inf: a row whose keys are all masked then computes
# exp2(-inf - floor) = 0 and exp2(floor - floor) = 1 instead of NaN, and simply ends with a zero denominator.
# (A constexpr, because jit code may only read globals that are.)
_M_FLOOR = tl.constexpr(-1.0e30)
_MAX_DECODE_SPLITS = 64
# A split must cover at least this many keys, or the per-split overhead and the reduction outweigh the parallelism.
_MIN_TOKENS_PER_SPLIT = 256


# ---------------------------------------------------------------------------------------------------------------------
# store_kv_cache
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # CUDA-graph padding: nothing to store
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
    dst += offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    src_k = token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    src_v = token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
    if BLOCK_H == NUM_KV_HEADS and BLOCK_D == HEAD_DIM:
        k = tl.load(key_ptr + src_k)
        v = tl.load(value_ptr + src_v)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty))
    else:
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(key_ptr + src_k, mask=mask)
        v = tl.load(value_ptr + src_v, mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hkv, D] (any strides) into the paged caches at slot_mapping [T]; slot -1 writes nothing."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_cache_pair(k_cache, v_cache)
    if value.shape != key.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit cache {tuple(k_cache.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Shared tile step
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _attend_kv_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    start_n,
    kv_end,
    k_head_ptr,
    v_head_ptr,
    block_table_ptr,
    qk_scale,
    stride_cb,
    stride_ct,
    stride_cd,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_KV: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """One online-softmax step of the [M, D] query tile against keys start_n .. start_n + BLOCK_N.

    The tile's keys may span several cache blocks (or part of one): each key's block id is gathered from the block
    table, so BLOCK_N is independent of the cache block size. MASK_KV guards keys at or past kv_end (never reading
    their block-table entries); CAUSAL masks keys after each row's absolute position q_pos.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if MASK_KV:
        kv_valid = offs_n < kv_end
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=kv_valid, other=0)
    else:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
    token_off = block_ids.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct
    # K and V tiles are both [N, D] with D contiguous, so one offset tensor and one mask serve both.
    kv_off = token_off[:, None] + offs_d[None, :] * stride_cd
    if MASK_KV and BLOCK_D != HEAD_DIM:
        mask, other = kv_valid[:, None] & (offs_d < HEAD_DIM)[None, :], 0.0
    elif MASK_KV:
        mask, other = kv_valid[:, None], 0.0
    elif BLOCK_D != HEAD_DIM:
        mask, other = (offs_d < HEAD_DIM)[None, :], 0.0
    else:  # the common case: full tile, power-of-two head_dim, plain vectorised loads
        mask, other = None, None
    k = tl.load(k_head_ptr + kv_off, mask=mask, other=other)
    v = tl.load(v_head_ptr + kv_off, mask=mask, other=other)

    s = dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), DOT_PRECISION, DOT_UPCAST) * qk_scale
    if CAUSAL:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & kv_valid[None, :], s, float("-inf"))
    elif MASK_KV:
        s = tl.where(kv_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
    return acc, l_i, m_new


# ---------------------------------------------------------------------------------------------------------------------
# paged_attention: varlen causal attention for prefill, chunked prefill, prefix hits and decode
# ---------------------------------------------------------------------------------------------------------------------


# Arguments that change from step to step are not specialised on (Triton compiles a variant per value class:
# equal to 1, divisible by 16, other), or steps would compile kernels long after the start-up warm-up.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
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
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    # The grid's first axis is a flat list of query tiles. Sequence b owns tiles starting at
    # cu_seqlens_q[b] // BLOCK_Q + b, which leaves it at least cdiv(q_len_b, BLOCK_Q) tiles, so a grid of
    # T // BLOCK_Q + B tiles covers every batch without reading its lengths on the host. Unused tiles exit at once.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    lo = tile * 0  # a scalar tensor from the start, so the loop-carried type never changes
    hi = lo + num_seqs
    while hi - lo > 1:  # find the last sequence whose first tile is <= this tile
        mid = (lo + hi) // 2
        mid_first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(mid_first_tile <= tile, mid, lo)
        hi = tl.where(mid_first_tile <= tile, hi, mid)
    seq = lo
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys already in the cache before this step's queries

    # Row r of the tile is query q_tile * BLOCK_Q + r // G of this sequence, in query head kv_head * G + r % G.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = q_tile * BLOCK_Q + offs_m // G
    head = kv_head * G + offs_m % G
    row_valid = (offs_m < BLOCK_Q * G) & (q_idx < q_len)
    q_pos = context_len + q_idx
    q_off = (q_start + q_idx).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + offs_d[None, :] * stride_qd, mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :])

    k_head_ptr = k_cache_ptr + kv_head * stride_ch
    v_head_ptr = v_cache_ptr + kv_head * stride_ch
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _M_FLOOR, dtype=tl.float32)

    # Keys before the tile's first query position are visible to every row: those full tiles need no mask. The rest,
    # up to the last query's position, are masked causally. Clamping at 0 keeps an inconsistent padding row
    # (seq_len < q_len) from looping or reading anything.
    first_q_pos = context_len + q_tile * BLOCK_Q
    kv_end = tl.maximum(context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len), 0)
    full_end = (tl.maximum(first_q_pos, 0) // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, q_pos, start_n, kv_end, k_head_ptr, v_head_ptr, block_table_ptr, qk_scale,
            stride_cb, stride_ct, stride_cd,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, False, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip
    for start_n in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, q_pos, start_n, kv_end, k_head_ptr, v_head_ptr, block_table_ptr, qk_scale,
            stride_cb, stride_ct, stride_cd,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, True, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip

    # A row that saw no key (only possible for padding) ends with l = 0 and acc = 0: write zeros, not NaN.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = (q_start + q_idx).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(
        out_ptr + o_off + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each sequence's paged context; returns out [T, Hq, D] in q's dtype.

    cu_seqlens_q [B+1] int32 splits q's rows into sequences; seq_lens [B] int32 is each sequence's context length
    after this step's keys were stored, so query i of sequence b sits at position seq_lens[b] - q_len_b + i.
    max_seqlen_q (a host int upper bound on q_len) only picks the tile shape. Serves prefill, chunked prefill,
    prefix-cache hits and decode; sequences with q_len 0 write nothing, rows with seq_len 0 get zeros.

    batch_invariant: one tile shape whatever max_seqlen_q. A query's result then does not depend on the step: every
    tile walks the keys from position 0 in the same BLOCK_N steps, each row's reductions are its own, and keys a row
    may not see (tiles past its position, loaded because a later row of its tile sees them) add exact zeros.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    _, group = _check_attention_shapes(q, k_cache, v_cache, block_tables, num_seqs)
    if cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(f"cu_seqlens_q must be [{num_seqs + 1}], got {tuple(cu_seqlens_q.shape)}")
    out = _output_like(q, out)
    if num_tokens == 0 or num_seqs == 0:
        return out
    tile_rows = _BATCH_INVARIANT_QUERY_ROWS if batch_invariant else max_seqlen_q
    block_m, block_n, num_warps, num_stages = _prefill_config(tile_rows, group, head_dim, q.element_size())
    _launch_paged_attention(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out, block_m, block_n, num_warps, num_stages
    )
    return out


def _launch_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> None:
    """Launch the varlen kernel with an explicit tile config (the benchmark sweeps configs through this)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        scale * _LOG2E,
        num_seqs,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        G=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        DOT_UPCAST=dot_upcast(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )


# Batch-invariant mode runs every step with the tile of one query run this long: the decode tile (16 rows, K/V in
# 128-key tiles), since decode steps are most of an RL rollout. The long-prompt tile (64 rows) it used until
# 2026-12-01 left 62 of a decode tile's 64 rows empty (one query x G heads), ~32x the tensor work a decode step needs;
# prefill pays for the small tile instead (benchmarks/batch_invariant_profile.py times both).
_BATCH_INVARIANT_QUERY_ROWS = 1


def _prefill_config(max_seqlen_q: int, group: int, head_dim: int, elem_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the varlen kernel, from host ints only.

    A tile holds BLOCK_M // G queries times all G heads of one kv head. Query runs of 64+ rows take 64-row tiles
    (on an H200, 64x64 tiles with 4 warps and 2 stages beat 128-row tiles for 512-token prompts and 512-token chunks
    over a 2k context); short runs (decode, small chunks) take the smallest tile tl.dot accepts and stream keys in
    decode-sized tiles, since they are bound by reading K/V.
    """
    rows = triton.next_power_of_2(max(max_seqlen_q, 1) * group)
    block_m = max(min(64, rows), 16, triton.next_power_of_2(group))  # at least one whole query per tile
    if block_m >= 64:
        return block_m, 64, 4, 2
    block_n, num_warps, num_stages = _decode_config(head_dim, elem_size)
    return block_m, block_n, num_warps, num_stages


# ---------------------------------------------------------------------------------------------------------------------
# paged_decode_attention: one query per sequence, split-KV across the context when the batch is small
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_bt"])  # see _paged_attention_kernel
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    seq_starts_ptr,
    block_tables_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_ob,
    stride_oh,
    stride_od,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    stride_bt,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_START: tl.constexpr,
    NUM_PARTIALS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """HAS_START: sequence b attends to keys seq_starts[b] .. seq_lens[b] - 1 only (the rest is a shared prefix the
    grouped path attends separately). NUM_PARTIALS: 0 writes the output itself (NUM_SPLITS 1 only); otherwise each
    (sequence, query head) owns NUM_PARTIALS partial slots, of which this kernel fills the first NUM_SPLITS."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if HAS_START:
        kv_start = tl.load(seq_starts_ptr + seq)
    else:
        kv_start = 0
    # Split s covers whole key tiles [s * tiles_per_split, (s + 1) * tiles_per_split) of this sequence's keys from
    # kv_start on; trailing splits of a short sequence are empty and report lse = -inf.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - kv_start, BLOCK_N), NUM_SPLITS)
    start = kv_start + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    full_end = start + (tl.maximum(end - start, 0) // BLOCK_N) * BLOCK_N

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head = kv_head * G + offs_h
    head_valid = offs_h < G
    d_valid = offs_d < HEAD_DIM
    q_off = seq.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=head_valid[:, None] & d_valid[None, :], other=0.0)

    k_head_ptr = k_cache_ptr + kv_head * stride_ch
    v_head_ptr = v_cache_ptr + kv_head * stride_ch
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], _M_FLOOR, dtype=tl.float32)
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32)  # unused: decode queries see their whole context
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

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # empty range (padding row / empty split): zeros
    mask = head_valid[:, None] & d_valid[None, :]
    if NUM_PARTIALS == 0:
        o_off = seq.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials are [B, Hq, NUM_PARTIALS, BLOCK_D] fp32 and lse [B, Hq, NUM_PARTIALS] (log2 domain), contiguous.
        row = (seq.to(tl.int64) * (tl.num_programs(1) * G) + head) * NUM_PARTIALS + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_valid)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < NUM_SPLITS
    row = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row + offs_s, mask=s_valid, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: all weights become 0
    w = tl.exp2(lse - lse_max)
    # A partial of no keys is never read: the grouped path leaves the prefix slots of ungrouped sequences unwritten.
    has_keys = s_valid & (lse > float("-inf"))
    parts = tl.load(
        part_out_ptr + (row + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=has_keys[:, None], other=0.0
    )
    w_sum = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(w_sum > 0.0, w_sum, 1.0)
    o_off = seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Decode attention: q [B, Hq, D] holds each sequence's one new query (already stored in the cache).

    Sequence b attends to keys 0..seq_lens[b]-1; seq_len 0 (padding) writes zeros. With num_splits > 1 each
    (sequence, kv head) spreads its context over that many programs and a second kernel merges them. By default
    num_splits follows from the batch size and max_seq_len (a host int upper bound on seq_lens; when omitted, the
    block table's capacity), never from device data, so the call can be captured in a CUDA graph.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, group = _check_attention_shapes(q, k_cache, v_cache, block_tables, batch)
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [{batch}], got {tuple(seq_lens.shape)}")
    out = _output_like(q, out)
    if batch == 0:
        return out
    block_size = k_cache.shape[1]
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = _decode_num_splits(batch, num_kv_heads, max_seq_len, q.device)
    block_n, num_warps, num_stages = _decode_config(head_dim, q.element_size())
    _launch_decode(q, k_cache, v_cache, seq_lens, block_tables, scale, out, num_splits, block_n, num_warps, num_stages)
    return out


def _launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> None:
    """Launch the decode kernel(s) with an explicit tile config (the benchmark sweeps configs through this)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = torch.empty((batch, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:  # unused by the kernel; any tensor satisfies the signature
        part_out = part_lse = out
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        seq_lens,
        seq_lens,  # no start offsets (HAS_START False): any tensor satisfies the signature
        block_tables,
        scale * _LOG2E,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        G=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        HAS_START=False,
        NUM_PARTIALS=num_splits if num_splits > 1 else 0,
        DOT_PRECISION=dot_precision(q.dtype),
        DOT_UPCAST=dot_upcast(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            out,
            *out.stride(),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4 if block_d >= 128 else 2,
        )


def _decode_config(head_dim: int, elem_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for streaming K/V in 32 KB tiles (128 keys x 128 dims of bf16).

    Measured on an H200 (bf16, Hkv 8, D 128, contexts 256-640): 4 warps and 3 stages read at ~99% of copy bandwidth
    for 1024 sequences and ~87% for 256, ahead of 64-key tiles and of 2 or 8 warps.
    """
    block_n = max(16, min(128, 32768 // (triton.next_power_of_2(head_dim) * elem_size)))
    return block_n, 4, 3


def _decode_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split the context only when (sequence, kv head) programs alone cannot fill the GPU about twice over."""
    programs = batch * num_kv_heads
    target = 2 * _num_sms(device)
    if programs >= target:
        return 1
    by_occupancy = triton.cdiv(target, programs)
    by_length = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, _MAX_DECODE_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # CPU (interpreter): behave like an H100/H200 so tests exercise the same choices


# ---------------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------------


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be [num_blocks, block_size, "
            "num_kv_heads, head_dim] with equal strides"
        )
    block_size = k_cache.shape[1]
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")


def _check_attention_shapes(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, num_seqs: int
) -> tuple[int, int]:
    """Validate shapes and dtypes; return (num_kv_heads, G)."""
    _check_cache_pair(k_cache, v_cache)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads/dim {(num_heads, head_dim)} do not fit cache {tuple(k_cache.shape)}")
    if k_cache.dtype != q.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from q dtype {q.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    return num_kv_heads, num_heads // num_kv_heads


def _output_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    return out
