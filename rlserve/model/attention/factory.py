"""Pick an attention backend by name and device."""

from __future__ import annotations

import torch

from rlserve.model.attention.base import AttentionBackend


def create_attention_backend(name: str, device: torch.device, batch_invariant: bool = False) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from rlserve.model.attention.torch_ref import TorchReferenceBackend

        return TorchReferenceBackend(batch_invariant)
    if name == "triton":
        if device.type != "cuda":
            raise ValueError(f"attention_backend 'triton' needs a CUDA device, got {device}")
        from rlserve.model.attention.triton_backend import TritonBackend

        return TritonBackend(batch_invariant)
    raise ValueError(f"attention_backend must be auto, torch or triton, got {name!r}")
