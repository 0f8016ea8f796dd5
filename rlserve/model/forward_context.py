"""What one forward pass of a model needs beyond its inputs: the attention metadata and KV caches, and the MoE and
LoRA per-token inputs. Its own module, below both the decoders (rlserve.model.models) and the layers they are built
from (rlserve.model.moe), which all take it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlserve.model.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    """What attention layers need for one forward pass; passed explicitly, never stored globally."""

    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: AttentionBackend
    # MoE layers only: where to record each token's routed experts ([>= tokens, layers, top_k]), and experts to
    # route each token to instead of the router's choice ([tokens, layers, top_k]; -1: the router's). See moe.py.
    routed_experts: torch.Tensor | None = None
    replay_experts: torch.Tensor | None = None
    # With adapters loaded (DecoderForCausalLM.enable_lora): each token's one-hot LoRA slot [tokens, slots]
    # (rlserve.model.lora.lora_mask); None when no token of the batch uses one.
    lora_mask: torch.Tensor | None = None
