"""Building blocks shared by the decoder models: norms, rotary embedding, fused projections."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from rlserve.model import batch_invariant

# Triton is an optional dependency (the `gpu` extra); without it CUDA runs the PyTorch code below too.
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """rlserve.model.kernels.fused_ops when its Triton kernels should run on x, else None (run the PyTorch code).

    The kernels run only on CUDA, and only when autograd records nothing: they have no backward, and the trainer's
    forward (rlserve.rl.train_forward) needs one. The PyTorch code is their reference and the CPU path.
    """
    if not (x.is_cuda and _HAS_TRITON and not torch.is_grad_enabled()):
        return None
    from rlserve.model.kernels import fused_ops  # imported on first use, so that CPU-only runs never load Triton

    return fused_ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (ops := fused_kernels(x)) is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        # Hugging Face's op order (normalise in fp32, cast back, then scale), so outputs agree with it in any dtype.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual): the decoder's residual add fused into the norm that follows it."""
        if (ops := fused_kernels(x)) is not None:
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual), residual


class RotaryEmbedding:
    """Neox-style rotary embedding (rotate half) with a cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, device: torch.device) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        t = torch.arange(max_position, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]."""
        cos = self.cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin[positions].to(x.dtype).unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def norm_and_rotate_qk(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    rotary: RotaryEmbedding,
    qk_norms: tuple[RMSNorm, RMSNorm] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head q/k RMSNorm (when qk_norms is given), then the rotary embedding; q/k: [tokens, heads, dim].

    The fused kernel rewrites q and k in place (they are views into the qkv projection output, used only here), so
    the attention backend gets strided views where the PyTorch path hands it new tensors; both accept either.
    """
    if (ops := fused_kernels(q)) is not None:
        if qk_norms is None:
            ops.qk_norm_rope(q, k, positions, rotary.cos, rotary.sin, None, None, 0.0)
        else:
            q_norm, k_norm = qk_norms
            ops.qk_norm_rope(q, k, positions, rotary.cos, rotary.sin, q_norm.weight, k_norm.weight, q_norm.eps)
        return q, k
    if qk_norms is not None:
        q, k = qk_norms[0](q), qk_norms[1](k)
    return rotary(positions, q), rotary(positions, k)


class Linear(nn.Linear):
    """nn.Linear that switches to the batch-invariant matmul (rlserve.model.batch_invariant) when its model is put in
    batch-invariant mode (DecoderForCausalLM.set_batch_invariant)."""

    batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return batch_invariant.linear(x, self.weight, self.bias)
        return super().forward(x)


class FusedLinear(Linear):
    """A linear layer whose output rows are several checkpoint tensors stacked (q/k/v or gate/up).

    `shards` maps each checkpoint sub-name to its row range, so the loader can write each checkpoint tensor in place.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shards: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shards[name] = (offset, size)
            offset += size


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if (ops := fused_kernels(x)) is not None:
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
