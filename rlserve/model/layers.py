"""Building blocks shared by the decoder models: norms, rotary embedding, fused projections."""

from __future__ import annotations

import importlib.util
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from rlserve.model import batch_invariant

# Triton is an optional dependency (the `gpu` extra); without it CUDA runs the PyTorch code below too.
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def fused_kernels(x: torch.Tensor, exact: bool = False) -> ModuleType | None:
    """rlserve.model.kernels.fused_ops when its Triton kernels should run on x, else None (run the PyTorch code).

    The kernels run only on CUDA, and when autograd records, only for `exact` callers (a model in batch-invariant
    mode, whose trainer forward must give the engine's bits): they have no backward of their own, so those callers
    wrap them in `batch_invariant.exact_values` with the PyTorch code as the backward. The PyTorch code is their
    reference and the CPU path.
    """
    if not (x.is_cuda and _HAS_TRITON and (exact or not torch.is_grad_enabled())):
        return None
    from rlserve.model.kernels import fused_ops  # imported on first use, so that CPU-only runs never load Triton

    return fused_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Hugging Face's op order (normalise in fp32, cast back, then scale), so outputs agree with it in any dtype.
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    batch_invariant = False  # set by DecoderForCausalLM.set_batch_invariant: the fused kernels even under autograd

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (ops := fused_kernels(x, self.batch_invariant)) is not None:
            return batch_invariant.exact_values(partial(ops.rms_norm, eps=self.eps), self._reference, x, self.weight)
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual): the decoder's residual add fused into the norm that follows it."""
        if (ops := fused_kernels(x, self.batch_invariant)) is not None:
            return batch_invariant.exact_values(
                partial(ops.fused_add_rms_norm, eps=self.eps), self._add_reference, x, residual, self.weight
            )
        residual = x + residual
        return self(residual), residual

    def _reference(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def _add_reference(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return rms_norm(residual, weight, self.eps), residual


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
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head q/k RMSNorm (when qk_norms is given), then the rotary embedding; q/k: [tokens, heads, dim].
    exact: the fused kernel even under autograd (see fused_kernels).

    Without autograd the fused kernel rewrites q and k in place (they are views into the qkv projection output, used
    only here), so the attention backend gets strided views where the PyTorch path hands it new tensors; both accept
    either. Under autograd it works on copies: the backward needs q and k as they were.
    """
    weights = () if qk_norms is None else (qk_norms[0].weight, qk_norms[1].weight)
    eps = 0.0 if qk_norms is None else qk_norms[0].eps

    def reference(q: torch.Tensor, k: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if weights:
            q, k = rms_norm(q, weights[0], eps), rms_norm(k, weights[1], eps)
        return rotary(positions, q), rotary(positions, k)

    if (ops := fused_kernels(q, exact)) is None:
        return reference(q, k, *weights)

    def fused(q: torch.Tensor, k: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops.qk_norm_rope(q, k, positions, rotary.cos, rotary.sin, *(weights or (None, None)), eps)
        return q, k

    if not torch.is_grad_enabled():
        return fused(q, k, *weights)
    return batch_invariant.exact_values(lambda q, k, *w: fused(q.clone(), k.clone(), *w), reference, q, k, *weights)


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


def silu_and_mul(x: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """SiLU(gate) * up of x = [gate, up]; exact: the fused kernel even under autograd (see fused_kernels)."""
    if (ops := fused_kernels(x, exact)) is not None:
        return batch_invariant.exact_values(ops.silu_and_mul, _silu_and_mul_reference, x)
    return _silu_and_mul_reference(x)


def _silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
