"""The attention backend interface and the metadata every backend reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlserve.model.attention.prefix_groups import PrefixGroups


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each sequence attends to.

    Tokens of all sequences are concatenated; sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and, after
    this step's keys are stored, has seq_lens[b] tokens of context (so its queries sit at the last q_len positions).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 writes nothing (padding)
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32
    max_seqlen_q: int
    max_seq_len: int
    # Host copies for backends that loop per sequence (the CPU reference); None on the GPU fast path.
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Decode only: sequences that share leading KV blocks, whose shared prefix is read once per group (None: every
    # sequence reads its whole context itself).
    prefix_groups: PrefixGroups | None = None

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store this step's k/v at meta.slot_mapping, then attend causally over each sequence's cached context."""
        ...
