"""Attention over the paged KV cache. A backend is picked by device: the PyTorch reference on CPU, Triton on CUDA."""

from rlserve.model.attention.base import AttentionBackend, AttentionMetadata
from rlserve.model.attention.factory import create_attention_backend
from rlserve.model.attention.prefix_groups import PrefixGroups, members_per_item

__all__ = ["AttentionBackend", "AttentionMetadata", "PrefixGroups", "create_attention_backend", "members_per_item"]
