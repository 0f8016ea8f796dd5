"""The CUDA attention backend: Triton kernels over the paged cache (decode gets the split-KV kernel)."""

from __future__ import annotations

import torch

from rlserve.model.attention.base import AttentionMetadata
from rlserve.model.kernels.paged_attention import paged_attention, paged_decode_attention, store_kv_cache


class TritonBackend:
    """batch_invariant: every step, decode included, runs the varlen kernel with one tile configuration, so a query's
    result does not depend on the step's shape (see kernels.paged_attention.paged_attention)."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode and not self.batch_invariant:
            return paged_decode_attention(
                q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale, max_seq_len=meta.max_seq_len
            )
        return paged_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale, meta.max_seqlen_q,
            batch_invariant=self.batch_invariant,
        )  # fmt: skip
