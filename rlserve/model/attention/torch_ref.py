"""Plain-PyTorch attention over the paged cache: the reference every faster backend is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlserve.model.attention.base import AttentionMetadata
from rlserve.model.batch_invariant import attend_each_query


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    valid = slots >= 0
    if not bool(valid.all()):
        k, v, slots = k[valid], v[valid], slots[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


class TorchReferenceBackend:
    """batch_invariant: each query is attended to alone over exactly the keys it sees
    (rlserve.model.batch_invariant.attend_each_query), one SDPA call per query."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.prefix_groups is not None:
            return grouped_decode_reference(q, k_cache, v_cache, meta, scale)
        block_size = k_cache.shape[1]
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        out = torch.empty_like(q)
        start = 0
        for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            if q_len == 0:
                continue
            blocks = meta.block_tables[b, : (seq_len + block_size - 1) // block_size].long()
            keys = k_cache[blocks].flatten(0, 1)[:seq_len]  # [seq, kv_heads, dim]
            values = v_cache[blocks].flatten(0, 1)[:seq_len]
            if self.batch_invariant:
                out[start : start + q_len] = attend_each_query(
                    q[start : start + q_len], keys, values, seq_len - q_len, scale
                )
                start += q_len
                continue
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [kv_heads, seq, dim]
            query = q[start : start + q_len].transpose(0, 1)  # [heads, q_len, dim]
            # Query i sits at absolute position seq_len - q_len + i and sees keys 0..that position.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos
            o = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
            )
            out[start : start + q_len] = o.transpose(0, 1)
            start += q_len
        return out


def attend_with_lse(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries q [M, Hq, D] over keys / values [S, Hkv, D], every key visible, in fp32: the output [M, Hq, D] and
    each row's log-sum-exp of scores [M, Hq] (natural log; -inf and a zero output over no keys)."""
    if keys.shape[0] == 0:
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    scores = torch.einsum("mhd,shd->mhs", q.float(), keys) * scale
    lse = scores.logsumexp(-1)
    return torch.einsum("mhs,shd->mhd", (scores - lse[..., None]).exp(), values), lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Attention over the union of disjoint key sets from each set's result: outs [P, ...rows, D] and their lses
    [P, ...rows] (any one log base, the same for all). A part over no keys (lse -inf) weighs nothing; rows whose every
    part is empty give zeros. The reduce kernel of rlserve.model.kernels.paged_attention computes the same."""
    lse_max = lses.amax(0)
    lse_max = torch.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = (lses - lse_max).exp()
    total = weights.sum(0)
    return (outs * weights[..., None]).sum(0) / torch.where(total > 0, total, 1.0)[..., None]


def grouped_decode_reference(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode attention split as the grouped Triton path splits it: each group's shared prefix attended once per
    work item by its members' queries together, each sequence's own keys after it alone, the two merged by
    log-sum-exp."""
    groups = meta.prefix_groups
    block_size = k_cache.shape[1]

    def context(row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = meta.block_tables[row, : -(-end // block_size)].long()
        return k_cache[blocks].flatten(0, 1)[start:end], v_cache[blocks].flatten(0, 1)[start:end]

    own = [
        attend_with_lse(q[row : row + 1], *context(row, start, seq_len), scale)
        for row, (start, seq_len) in enumerate(zip(groups.suffix_starts.tolist(), meta.seq_lens_cpu, strict=True))
    ]
    own_out, own_lse = torch.cat([o for o, _ in own]), torch.cat([lse for _, lse in own])
    prefix_out, prefix_lse = torch.zeros_like(own_out), torch.full_like(own_lse, float("-inf"))
    members = groups.member_rows.long()
    for first, count, shared_len in groups.items.tolist():
        if count:  # a CUDA graph's unused items hold none
            rows = members[first : first + count]
            prefix_out[rows], prefix_lse[rows] = attend_with_lse(q[rows], *context(int(rows[0]), 0, shared_len), scale)
    merged = merge_partials(torch.stack([own_out, prefix_out]), torch.stack([own_lse, prefix_lse]))
    return merged.to(q.dtype)
