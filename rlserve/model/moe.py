"""The sparse mixture-of-experts MLP (Qwen3-MoE's): a softmax top-k router over experts stored as stacked tensors.

Experts live in two parameters shaped for the fused kernel: `gate_up_proj` [E * 2I, H] (each expert's gate rows, then
its up rows) and `down_proj` [E * H, I], viewed as [E, 2I, H] and [E, H, I]. Stored two-dimensional, each checkpoint
tensor (`experts.E.gate_proj.weight`, ...) is a run of rows of one parameter, which the decoder's loader writes in
place as it writes q/k/v into `qkv_proj` (see Qwen3MoeForCausalLM).

The router's choices can be recorded (the engine returns them: vLLM's routed experts) and replayed (the trainer routes
each token as the engine did; the routing weights still come from the trainer's own router logits, so the router gets
gradients): both through `ForwardContext` fields, `routed_experts` and `replay_experts`.

With `--quantization fp8|fbgemm_fp8` the experts are float8_e4m3fn with scales stacked beside them
(`FusedExperts.quantize_fp8`; each expert's checkpoint `weight_scale_inv` / `weight_scale` is a run of their rows),
loaded, updated and checksummed per expert as the dense projections are; the fused kernel multiplies them in FP8, the
reference through rlserve.model.fp8.fp8_linear per expert.

Under expert parallel (rlserve.model.expert_parallel) a rank's FusedExperts hold only its experts, and the block
exchanges tokens with the other ranks around them.

On CUDA without autograd the experts run in the fused Triton kernel (rlserve.model.kernels.fused_moe); elsewhere in
`experts_reference`, which is the kernel's reference and what the trainer differentiates. Both combine a token's top-k
expert outputs in top-k order, in fp32, so a token's result never depends on the other tokens of the batch (in
batch-invariant mode the expert projections also use the batch-invariant matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlserve.model import batch_invariant, expert_parallel
from rlserve.model.expert_parallel import ExpertShard
from rlserve.model.forward_context import ForwardContext
from rlserve.model.fp8 import BLOCK, FP8_DTYPE, ExpertScales, Fp8Scheme, fp8_linear
from rlserve.model.layers import Linear, ShardSlice, fused_kernels, scale_slice, silu_and_mul
from rlserve.model.parallel import TensorParallelGroup


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size, per expert
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has the MoE MLP (Hugging Face's rule); the others have the dense one."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


def moe_spec_from_hf_config(cfg) -> MoESpec:
    # transformers 5.2x names it num_local_experts (num_experts remains an alias); older versions num_experts.
    num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    spec = MoESpec(
        num_experts=num_experts,
        top_k=cfg.num_experts_per_tok,
        intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=bool(cfg.norm_topk_prob),
        decoder_sparse_step=getattr(cfg, "decoder_sparse_step", 1) or 1,
        mlp_only_layers=tuple(getattr(cfg, "mlp_only_layers", None) or ()),
    )
    if not 0 < spec.top_k <= spec.num_experts:
        raise ValueError(
            f"num_experts_per_tok {spec.top_k} must be in [1, num_experts={spec.num_experts}] (model config)"
        )
    return spec


def routed_experts_dtype(num_experts: int) -> torch.dtype:
    """vLLM's: uint8 while expert ids fit, else a wider integer (torch's uint16 lacks indexing ops: int32)."""
    return torch.uint8 if num_experts <= 256 else torch.int32


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] fp32, expert ids [T, K] int64): Hugging Face's softmax (fp32) then top-k, renormalised when
    norm_topk_prob."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def replay_route(
    logits: torch.Tensor, own_ids: torch.Tensor, replay: torch.Tensor, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing with the experts of `replay` [T, K] (rows of -1: the router's own choice) and the weights the router's
    probabilities give those experts (R3: the trainer's gradients still reach its router)."""
    ids = torch.where(replay >= 0, replay.long(), own_ids)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def combine_topk(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum over k of weights[:, k] * y[:, k] ([T, K, H] -> [T, H]), in fp32 and in top-k order: one fixed order per
    token, whatever the batch."""
    acc = y[:, 0].float() * weights[:, :1]
    for k in range(1, y.shape[1]):
        acc = acc + y[:, k].float() * weights[:, k : k + 1]
    return acc.to(dtype)


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    batch_invariant_mode: bool = False,
    out_dtype: torch.dtype | None = None,
    fp8: ExpertScales | None = None,
) -> torch.Tensor:
    """The experts in PyTorch: x [T, H], w13 [E, 2I, H], w2 [E, H, I], routing weights/ids [T, K] -> [T, H] (in
    `out_dtype`, default x's). An id of -1 is an expert held elsewhere (expert parallel): that term is left out.
    With `fp8`, w13 and w2 are float8_e4m3fn with those scales, each projection rlserve.model.fp8.fp8_linear.

    Differentiable (the trainer's forward); its per-expert loop reads the expert counts on the host."""
    num_tokens, top_k = ids.shape
    if fp8 is None:
        plain = batch_invariant.linear if batch_invariant_mode else F.linear

        def linear(a: torch.Tensor, w: torch.Tensor, expert: int, scales: torch.Tensor | None) -> torch.Tensor:
            return plain(a, w[expert])
    else:

        def linear(a: torch.Tensor, w: torch.Tensor, expert: int, scales: torch.Tensor | None) -> torch.Tensor:
            scale = scales[expert] if fp8.block_wise else scales[expert].unsqueeze(1)  # per channel: [rows, 1]
            return fp8_linear(a, w[expert], scale, None, fp8.scheme)

    w13_scales, w2_scales = (fp8.w13, fp8.w2) if fp8 is not None else (None, None)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert, the absent ones (-1) first
    counts = torch.bincount(flat + 1, minlength=w13.shape[0] + 1).tolist()
    outputs, start = [], counts[0]
    for expert, count in enumerate(counts[1:]):
        if count:
            rows = order[start : start + count]
            h = silu_and_mul(linear(x[rows // top_k], w13, expert, w13_scales))
            outputs.append(linear(h, w2, expert, w2_scales))
            start += count
    out_dtype = out_dtype or x.dtype
    if not outputs:
        return x.new_zeros(x.shape, dtype=out_dtype)
    if counts[0]:
        y = x.new_zeros(num_tokens * top_k, x.shape[1])
        y[order[counts[0] :]] = torch.cat(outputs)
    else:
        y = torch.cat(outputs)[torch.argsort(order)]
    return combine_topk(y.view(num_tokens, top_k, -1), weights, out_dtype)


class FusedExperts(nn.Module):
    """The experts' weights, stacked: gate_up_proj [E * 2I, H], down_proj [E * H, I] (see the module docstring). Under
    expert parallel, E is this rank's experts (`experts`): the others' checkpoint tensors resolve to empty slices,
    checked for shape and written nowhere. After `quantize_fp8` both are float8_e4m3fn with their scales stacked the
    same way beside them (`gate_up_proj_scale`, `down_proj_scale`): each expert's checkpoint `weight_scale_inv`
    (or `weight_scale`) is a run of their rows."""

    fp8: Fp8Scheme | None = None
    _FP8_WEIGHTS = {"gate_up_proj": "gate_up_proj_scale", "down_proj": "down_proj_scale"}

    def __init__(self, experts: ExpertShard, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.experts = experts
        num_experts = experts.num_local
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts * 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden_size, intermediate_size))

    def quantize_fp8(self, scheme: Fp8Scheme) -> None:
        """Make both stacked weights float8_e4m3fn with scale parameters beside them (on the meta device, before the
        loader gives the model storage). Block-wise, each expert's tensors must be whole 128x128 blocks."""
        size, hidden = self.intermediate_size, self.hidden_size
        if scheme.block_wise and (size % BLOCK or hidden % BLOCK):
            raise ValueError(
                f"quantization fp8: block-wise 128x128 scales need the experts' sizes to be multiples of 128; "
                f"moe_intermediate_size is {size}, hidden_size {hidden} (fbgemm_fp8, per-channel, has no such "
                "constraint)"
            )
        for weight_name, scale_name in self._FP8_WEIGHTS.items():
            weight = getattr(self, weight_name)
            q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
            setattr(self, weight_name, nn.Parameter(q, requires_grad=False))
            scale = torch.empty(scheme.scale_shape(*weight.shape), dtype=torch.float32, device=weight.device)
            self.register_parameter(scale_name, nn.Parameter(scale, requires_grad=False))
        self.fp8 = scheme

    def fp8_weights(self) -> dict[str, str]:
        """FP8 weight parameter name -> its scale parameter's name."""
        return dict(self._FP8_WEIGHTS)

    def expert_scales(self) -> ExpertScales | None:
        """The scales per expert, as the fused kernel and experts_reference take them; None in the model dtype."""
        if self.fp8 is None:
            return None
        e = self.num_experts
        if self.fp8.block_wise:
            w13 = self.gate_up_proj_scale.view(e, -1, self.hidden_size // BLOCK)
            return ExpertScales(self.fp8, w13, self.down_proj_scale.view(e, -1, self.intermediate_size // BLOCK))
        return ExpertScales(self.fp8, self.gate_up_proj_scale.view(e, -1), self.down_proj_scale.view(e, -1))

    def w13(self) -> torch.Tensor:
        return self.gate_up_proj.view(self.num_experts, 2 * self.intermediate_size, self.hidden_size)

    def w2(self) -> torch.Tensor:
        return self.down_proj.view(self.num_experts, self.hidden_size, self.intermediate_size)

    def shard(self, expert: int, checkpoint_name: str, param_name: str = "weight") -> tuple[nn.Parameter, ShardSlice]:
        """The parameter holding checkpoint tensor `experts.<expert>.<checkpoint_name>.<param_name>` and where: a
        block of its rows, the whole checkpoint tensor (none of it for another rank's expert). `expert`: the global
        index. `param_name`: "weight", or an FP8 model's scale name (`weight_scale_inv` / `weight_scale`)."""
        if param_name != "weight":
            if self.fp8 is None or param_name != self.fp8.scale_name:
                raise KeyError(param_name)
            param, weight_slice = self.shard(expert, checkpoint_name)
            return getattr(self, self._FP8_WEIGHTS[_stacked_name(param, self)]), scale_slice(weight_slice, self.fp8)
        size, hidden = self.intermediate_size, self.hidden_size
        local = self.experts.is_local(expert)
        expert -= self.experts.first
        if checkpoint_name == "gate_proj":
            param, first, rows = self.gate_up_proj, expert * 2 * size, size
        elif checkpoint_name == "up_proj":
            param, first, rows = self.gate_up_proj, expert * 2 * size + size, size
        elif checkpoint_name == "down_proj":
            param, first, rows = self.down_proj, expert * hidden, hidden
        else:
            raise KeyError(checkpoint_name)
        length = rows if local else 0
        return param, ShardSlice((rows, param.shape[1]), dim=0, start=0, length=length, offset=first if local else 0)


def _stacked_name(param: nn.Parameter, experts: FusedExperts) -> str:
    return "gate_up_proj" if param is experts.gate_up_proj else "down_proj"


class SparseMoeBlock(nn.Module):
    """Router + experts of one decoder layer (Hugging Face's Qwen3MoeSparseMoeBlock: `gate`, `experts`)."""

    def __init__(self, spec: MoESpec, hidden_size: int, layer_idx: int, ep: TensorParallelGroup) -> None:
        """`ep`: the expert-parallel group (rlserve.model.expert_parallel); one rank holds every expert."""
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.ep = ep
        shard = expert_parallel.shard_experts(spec.num_experts, ep)
        self.gate = Linear(hidden_size, spec.num_experts, bias=False)
        self.experts = FusedExperts(shard, hidden_size, spec.intermediate_size)
        self.batch_invariant = False  # set by DecoderForCausalLM.set_batch_invariant through the model's modules

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        logits = self.gate(x)
        weights, ids = route(logits, self.spec.top_k, self.spec.norm_topk_prob)
        if ctx.replay_experts is not None:
            weights, ids = replay_route(logits, ids, ctx.replay_experts[:, self.layer_idx], self.spec.norm_topk_prob)
        if ctx.routed_experts is not None:  # a static buffer (CUDA graphs): rows past this batch are left alone
            ctx.routed_experts[: ids.shape[0], self.layer_idx] = ids.to(ctx.routed_experts.dtype)
        w13, w2, fp8 = self.experts.w13(), self.experts.w2(), self.experts.expert_scales()
        if self.ep.size > 1:
            sent = expert_parallel.dispatch(self.ep, x, weights, ids)
            ids = expert_parallel.local_ids(sent.ids, self.experts.experts)
            partial = experts_reference(sent.x, w13, w2, sent.weights, ids, self.batch_invariant, torch.float32, fp8)
            return expert_parallel.combine(self.ep, partial, sent, x.dtype)
        if fused_kernels(x) is not None:
            from rlserve.model.kernels.fused_moe import fused_moe

            return fused_moe(x, w13, w2, weights, ids, self.batch_invariant, fp8)
        return experts_reference(x, w13, w2, weights, ids, self.batch_invariant, fp8=fp8)
