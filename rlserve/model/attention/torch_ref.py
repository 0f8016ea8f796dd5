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
