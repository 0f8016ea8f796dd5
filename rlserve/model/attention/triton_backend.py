"""The CUDA attention backend: Triton kernels over the paged cache (decode gets the split-KV kernel, or the grouped
kernels when the step has groups of sequences sharing a prefix: AttentionMetadata.prefix_groups)."""

from __future__ import annotations

import torch

from rlserve.model.attention.base import AttentionMetadata
from rlserve.model.kernels.paged_attention import paged_attention, paged_decode_attention, store_kv_cache
from rlserve.model.kernels.prefix_attention import grouped_decode_attention


class TritonBackend:
    """batch_invariant: every step, decode included, runs the varlen kernel with one tile configuration, so a query's
    result does not depend on the step's shape (see kernels.paged_attention.paged_attention)."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        groups = meta.prefix_groups
        if meta.is_decode and groups is not None:  # never set under batch_invariant (the config refuses both)
            return grouped_decode_attention(
                q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale, groups.member_rows, groups.items,
                groups.suffix_starts, groups.members_per_item, groups.max_shared_len, max_seq_len=meta.max_seq_len,
            )  # fmt: skip
        if meta.is_decode and not self.batch_invariant:
            return paged_decode_attention(
                q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale, max_seq_len=meta.max_seq_len
            )
        return paged_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale, meta.max_seqlen_q,
            batch_invariant=self.batch_invariant,
        )  # fmt: skip
