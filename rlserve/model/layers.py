"""Building blocks shared by the decoder models: norms, rotary embedding, and the projections and embeddings
sharded for tensor parallelism (vLLM's names; with the one-rank group they are the plain layers)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from rlserve.model import batch_invariant
from rlserve.model.fp8 import BLOCK, FP8_DTYPE, ActivationQuantizer, Fp8Scheme, fp8_linear
from rlserve.model.lora import LoRASlots
from rlserve.model.parallel import TensorParallelGroup

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


def fp8_activation_kernel(x: torch.Tensor) -> ActivationQuantizer | None:
    """The fused FP8 activation quantization (rlserve.model.kernels.fp8_quant) where it runs: CUDA with Triton."""
    if not (x.is_cuda and _HAS_TRITON):
        return None
    from rlserve.model.kernels.fp8_quant import quantize_activation

    return quantize_activation


def quantize_fp8_weight(
    weight: torch.Tensor, scheme: Fp8Scheme, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scheme.quantize(weight)`, in one Triton launch where it runs (CUDA with Triton: the same bits,
    rlserve.model.kernels.fp8_quant.quantize_weight), else the PyTorch reference; written into `out` (q, scale) if
    given (the kernel writes there directly: no temporary to copy)."""
    if not (weight.is_cuda and _HAS_TRITON):
        q, scale = scheme.quantize(weight)
        if out is None:
            return q, scale
        out[0].copy_(q)
        out[1].copy_(scale)
        return out
    from rlserve.model.kernels.fp8_quant import quantize_weight

    return quantize_weight(weight, scheme, out)


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
    batch-invariant mode (DecoderForCausalLM.set_batch_invariant), adds each token's LoRA delta when its model
    holds adapters (DecoderForCausalLM.enable_lora) and the forward has a `lora_mask`, and multiplies in FP8 once
    `quantize_fp8` has made its weight float8 with scales (rlserve.model.fp8)."""

    batch_invariant = False
    lora: LoRASlots | None = None
    fp8: Fp8Scheme | None = None

    def quantize_fp8(self, scheme: Fp8Scheme) -> None:
        """Make the weight float8_e4m3fn with a scale parameter (`scheme.scale_name`) beside it, on the device it is
        on (the meta device, before the loader gives the model storage)."""
        weight = self.weight
        self.weight = nn.Parameter(torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device), False)
        shape = scheme.scale_shape(*weight.shape)
        scale = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=weight.device), False)
        self.register_parameter(scheme.scale_name, scale)
        self.fp8 = scheme

    @property
    def fp8_scale(self) -> torch.Tensor:
        return getattr(self, self.fp8.scale_name)

    def fp8_weights(self) -> dict[str, str]:
        """FP8 weight parameter name -> its scale parameter's name (as rlserve.model.moe.FusedExperts has)."""
        return {"weight": self.fp8.scale_name}

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias, in FP8, batch-invariant or plain."""
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, self.fp8_scale, bias, self.fp8, fp8_activation_kernel(x))
        if self.batch_invariant:
            return batch_invariant.linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.project(x, self.bias)
        if lora_mask is not None and self.lora is not None:
            y = self.lora.apply(x, y, lora_mask, self.batch_invariant)
        return y


@dataclass(frozen=True)
class ShardSlice:
    """Where one rank's part of a checkpoint tensor lives: indices [start, start + length) of the checkpoint tensor
    along `dim` sit at [offset, offset + length) of the parameter along the same dim. `length` None: the parameter is
    the whole checkpoint tensor (replicated on every rank)."""

    full_shape: tuple[int, ...]  # the checkpoint tensor's shape
    dim: int = 0
    start: int = 0
    length: int | None = None
    offset: int = 0

    @property
    def whole(self) -> bool:
        """This rank's part is the whole checkpoint tensor (replicated, or one rank)."""
        return self.length is None or (self.start == 0 and self.length == self.full_shape[self.dim])

    def of_checkpoint(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.length is None else tensor.narrow(self.dim, self.start, self.length)

    def of_param(self, param: torch.Tensor) -> torch.Tensor:
        return param if self.length is None else param.narrow(self.dim, self.offset, self.length)


class ShardedWeights:
    """What the loader needs of a layer whose parameters hold (parts of) checkpoint tensors: `shard_slice` for each
    parameter and shard id (the checkpoint sub-name of a fused layer: "q_proj", "gate_proj"; None otherwise)."""

    tp: TensorParallelGroup
    shard_ids: tuple[str, ...] = ()  # the checkpoint tensors stacked in a fused layer, in row order

    def shard_slice(self, param_name: str, shard_id: str | None, rank: int) -> ShardSlice:
        raise NotImplementedError

    def slice_of(self, param_name: str, shard_id: str | None, rank: int) -> ShardSlice:
        """`shard_slice`, and for an FP8 weight's scales the slice of the scale tensor that goes with the weight's."""
        scheme = getattr(self, "fp8", None)
        if scheme is None or param_name != scheme.scale_name:
            return self.shard_slice(param_name, shard_id, rank)
        return scale_slice(self.shard_slice("weight", shard_id, rank), scheme)

    def check_fp8_blocks(self) -> None:
        """Block-wise FP8 needs every checkpoint tensor's part on this rank to be whole 128x128 blocks: a block across
        two tensors of a fused layer (or two ranks) would have no one scale. (cuBLASLt's block-scaled GEMM also wants
        the input's blocks in groups of four: the scales' storage is padded for that, rlserve.model.fp8.)"""
        for shard_id in self.shard_ids or (None,):
            sl = self.shard_slice("weight", shard_id, self.tp.rank)
            rows = sl.full_shape[0] if sl.length is None or sl.dim != 0 else sl.length
            cols = self.weight.shape[1]  # type: ignore[attr-defined]
            if rows % BLOCK or cols % BLOCK or (sl.length is not None and (sl.start % BLOCK or sl.offset % BLOCK)):
                raise ValueError(
                    f"quantization fp8: block-wise 128x128 scales need a projection's rows and columns (per tensor "
                    f"and rank) to be multiples of 128; {shard_id or type(self).__name__} has {rows}x{cols} here "
                    "(fbgemm_fp8, per-channel, has no such constraint)"
                )

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None) -> None:
        """vLLM's per-parameter loader: copy this rank's part of the checkpoint tensor into the parameter, in place."""
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)  # type: ignore[attr-defined]
        sl = self.slice_of(name, shard_id, self.tp.rank)
        sl.of_param(param.data).copy_(sl.of_checkpoint(loaded_weight))


def scale_slice(weight: ShardSlice, scheme: Fp8Scheme) -> ShardSlice:
    """Where the scales of `weight`'s part sit: the same rows and columns in blocks of 128 (block-wise), or the same
    rows and the one column (per-channel, whose scale covers a whole row, so a split of the columns shares it)."""
    full = scheme.scale_shape(*weight.full_shape)
    if weight.length is None:
        return ShardSlice(full)
    if scheme.block_wise:
        return ShardSlice(full, weight.dim, weight.start // BLOCK, weight.length // BLOCK, weight.offset // BLOCK)
    if weight.dim == 0:
        return ShardSlice(full, 0, weight.start, weight.length, weight.offset)
    return ShardSlice(full)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"tensor_parallel_size: {what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


class ColumnParallelLinear(ShardedWeights, Linear):
    """Y = X W^T with W's output rows split over the ranks: each rank computes its columns of Y, no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__(in_features, _divide(out_features, tp.size, "a projection's output size"), bias=bias)
        self.tp = tp
        self.full_out_features = out_features

    def shard_slice(self, param_name: str, shard_id: str | None, rank: int) -> ShardSlice:
        rows = self.out_features
        full = (self.full_out_features, *getattr(self, param_name).shape[1:])
        return ShardSlice(full, 0, rank * rows, rows, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several checkpoint tensors stacked along the output (gate/up), each split over the ranks: a rank holds its
    part of each, stacked in the same order (so `silu_and_mul` pairs them up on every rank)."""

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__(in_features, sum(output_sizes.values()), bias, tp)
        self.shard_ids = tuple(output_sizes)
        self.full_sizes = dict(output_sizes)
        self.shards: dict[str, tuple[int, int]] = {}  # shard id -> (first row in this rank's parameter, rows)
        offset = 0
        for name, size in output_sizes.items():
            local = _divide(size, tp.size, f"{name}'s output size")
            self.shards[name] = (offset, local)
            offset += local

    def shard_rows(self, shard_id: str, rank: int) -> tuple[int, int]:
        """(first row of the checkpoint tensor, rows) that `rank` holds of shard `shard_id`."""
        rows = self.shards[shard_id][1]
        return rank * rows, rows

    def shard_slice(self, param_name: str, shard_id: str | None, rank: int) -> ShardSlice:
        offset, rows = self.shards[shard_id]
        start, rows = self.shard_rows(shard_id, rank)
        full = (self.full_sizes[shard_id], *getattr(self, param_name).shape[1:])
        return ShardSlice(full, 0, start, rows, offset)


class QKVParallelLinear(MergedColumnParallelLinear):
    """The fused q/k/v projection split by heads. With fewer kv heads than ranks each kv head is replicated on
    tp / kv_heads ranks (vLLM's scheme), so every rank has the kv head its query heads attend to."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallelGroup,
    ) -> None:
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size: {tp.size} ranks cannot share {num_kv_heads} kv heads (one must divide the "
                "other)"
            )
        local_heads = _divide(num_heads, tp.size, "the number of attention heads")
        local_kv_heads = max(1, num_kv_heads // tp.size)
        # Sized per rank, not by splitting the full sizes: replicated kv heads are not a split.
        local = {"q_proj": local_heads * head_dim, "k_proj": local_kv_heads * head_dim}
        local["v_proj"] = local["k_proj"]
        super().__init__(hidden_size, {name: size * tp.size for name, size in local.items()}, bias, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = local_heads, local_kv_heads, head_dim
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        self.full_sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv}

    def shard_rows(self, shard_id: str, rank: int) -> tuple[int, int]:
        rows = self.shards[shard_id][1]
        if shard_id == "q_proj":
            return rank * rows, rows
        return rank // self.kv_replicas * rows, rows


class RowParallelLinear(ShardedWeights, Linear):
    """Y = X W^T with W's input columns split over the ranks: each rank's partial product over its part of X's
    features, summed over the ranks (the bias added once, by rank 0)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__(_divide(in_features, tp.size, "a projection's input size"), out_features, bias=bias)
        self.tp = tp

    def shard_slice(self, param_name: str, shard_id: str | None, rank: int) -> ShardSlice:
        if param_name == "bias":
            return ShardSlice(tuple(self.bias.shape))
        cols = self.in_features
        return ShardSlice((self.out_features, cols * self.tp.size), 1, rank * cols, cols, 0)

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x, lora_mask)
        # No adapters under tensor parallelism (EngineConfig refuses enable_lora with it).
        return self.tp.all_reduce(self.project(x, self.bias if self.tp.rank == 0 else None))


class VocabParallelEmbedding(ShardedWeights, nn.Module):
    """The embedding with its vocabulary rows split over the ranks (the last rank's part padded to the others'
    size); each rank embeds the tokens it holds, zero for the others, and the sum over ranks is the embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        # torch.empty, not an initialised weight: on the meta device nn.Embedding's init (normal_) imports
        # torch._dynamo, seconds of an engine's start-up, for values the checkpoint overwrites anyway.
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)

    def shard_slice(self, param_name: str, shard_id: str | None, rank: int) -> ShardSlice:
        start = rank * self.rows_per_rank
        rows = max(0, min(self.rows_per_rank, self.vocab_size - start))
        return ShardSlice((self.vocab_size, self.weight.shape[1]), 0, start, rows, 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.rows_per_rank)
        x = F.embedding(local.masked_fill(~held, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(~held.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head split by vocabulary rows like the embedding (so a tied head is the embedding's parameter): each
    rank computes its logits, `gather` puts the whole vocabulary together on every rank."""

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., : self.vocab_size]


def silu_and_mul(x: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """SiLU(gate) * up of x = [gate, up]; exact: the fused kernel even under autograd (see fused_kernels)."""
    if (ops := fused_kernels(x, exact)) is not None:
        return batch_invariant.exact_values(ops.silu_and_mul, _silu_and_mul_reference, x)
    return _silu_and_mul_reference(x)


def _silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
