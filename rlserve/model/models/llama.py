"""The Llama-family decoder (Llama, Qwen2, Qwen3) over the paged KV cache, with an in-place checkpoint loader.

Under tensor parallelism (a `TensorParallelGroup` of several ranks) each rank builds the same model with its part of
every projection (rlserve.model.layers), and the loader slices each full checkpoint tensor to that part."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from rlserve.lora.peft import PEFTAdapter
from rlserve.model import batch_invariant
from rlserve.model.forward_context import ForwardContext
from rlserve.model.fp8 import BLOCK, FP8_DTYPE, Fp8Scheme
from rlserve.model.layers import (
    Linear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    ShardedWeights,
    ShardSlice,
    VocabParallelEmbedding,
    norm_and_rotate_qk,
    quantize_fp8_weight,
    silu_and_mul,
)
from rlserve.model.lora import LoRASlots
from rlserve.model.moe import MoESpec, moe_spec_from_hf_config
from rlserve.model.parallel import TensorParallelGroup


@dataclass(frozen=True)
class DecoderSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2; Llama with attention_bias
    o_bias: bool  # Llama with attention_bias
    mlp_bias: bool
    qk_norm: bool  # Qwen3
    moe: MoESpec | None = None  # Qwen3-MoE: the sparse layers' experts (rlserve.model.models.qwen3_moe)


def spec_from_hf_config(cfg) -> DecoderSpec:
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    rope_scaling = getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (model config field 'rope_scaling')")
    rope_theta = getattr(cfg, "rope_theta", None)
    if rope_theta is None:  # transformers 5 moved it into rope_parameters
        rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    return DecoderSpec(
        architecture=arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=float(rope_theta),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        moe=moe_spec_from_hf_config(cfg) if arch == "Qwen3MoeForCausalLM" else None,
    )


class Attention(nn.Module):
    batch_invariant = False  # set by DecoderForCausalLM.set_batch_invariant: the fused kernels even under autograd

    def __init__(self, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.qkv_bias, tp
        )
        # This rank's heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = spec.head_dim
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, spec.o_bias, tp)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.rotary = rotary
        self.scale = spec.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(x, ctx.lora_mask)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :q_size].view(-1, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        qk_norms = (self.q_norm, self.k_norm) if self.qk_norm else None
        q, k = norm_and_rotate_qk(positions, q, k, self.rotary, qk_norms, exact=self.batch_invariant)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.meta, self.scale)
        return self.o_proj(out.flatten(1), ctx.lora_mask)


class MLP(nn.Module):
    batch_invariant = False  # as Attention's

    def __init__(self, spec: DecoderSpec, tp: TensorParallelGroup) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            spec.hidden_size, {"gate_proj": size, "up_proj": size}, spec.mlp_bias, tp
        )
        self.down_proj = RowParallelLinear(size, spec.hidden_size, spec.mlp_bias, tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        mask = ctx.lora_mask
        return self.down_proj(silu_and_mul(self.gate_up_proj(x, mask), exact=self.batch_invariant), mask)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        layer_idx: int,
        rotary: RotaryEmbedding,
        tp: TensorParallelGroup,
        make_mlp: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_idx, rotary, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = make_mlp(layer_idx)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the caller adds the two.

        Deferring each residual add into the next norm (vLLM's scheme) lets the fused kernel do add and norm in one
        pass. residual is None for the first layer, whose input x is the residual stream itself.
        """
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x, ctx), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        rotary: RotaryEmbedding,
        tp: TensorParallelGroup,
        make_mlp: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, rotary, tp, make_mlp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        return self.norm(x) if residual is None else self.norm.add_and_norm(x, residual)[0]


class DecoderForCausalLM(nn.Module):
    # Checkpoint tensors that live inside a fused parameter: checkpoint sub-name -> fused module name.
    fused_names = {
        "q_proj": "qkv_proj",
        "k_proj": "qkv_proj",
        "v_proj": "qkv_proj",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
    }
    # Checkpoint tensors that carry no weights of this model (derived buffers saved by old exporters).
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp = tp or TensorParallelGroup()
        self.model = DecoderModel(spec, rotary, tp, self.make_mlp)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._lm_head_fp32: torch.Tensor | None = None
        self.batch_invariant = False
        self._targets: dict[str, tuple[torch.nn.Parameter, ShardSlice] | None] = {}  # see _resolve

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    fp8_scheme: Fp8Scheme | None = None  # set by quantize_fp8

    def make_mlp(self, layer_idx: int) -> nn.Module:
        """The MLP of layer `layer_idx` (a MoE model's sparse layers have another)."""
        return MLP(self.spec, self.tp)

    def quantize_fp8(self, scheme: Fp8Scheme) -> None:
        """Make the decoder layers' dense projections FP8 (rlserve.model.fp8), and a MoE model's experts; the LM head,
        embeddings and routers stay in the model dtype. Called on the meta device, before the loader gives
        parameters storage."""
        for module in self._fp8_targets():
            if isinstance(module, Linear) and scheme.block_wise:
                module.check_fp8_blocks()
            module.quantize_fp8(scheme)
        self.fp8_scheme = scheme

    def _fp8_targets(self) -> Iterator[nn.Module]:
        """The modules FP8 quantizes: a dense decoder's are the projections adapters target."""
        return self._lora_targets()

    def unfuse_weights(self, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """`weights` with each tensor of a fused parameter under vLLM's kernel name (`...qkv_proj.weight`,
        `...gate_up_proj.weight_scale_inv`: the checkpoint tensors stacked by rows, as a trainer that quantizes for
        vLLM's kernels sends them) split into its checkpoint tensors (`q_proj`, `k_proj`, ...); the rest as they
        are. A fused tensor whose rows are not the sum of its parts' is refused by name."""
        fused_modules = set(self.fused_names.values())
        out = []
        for name, tensor in weights:
            parts = name.split(".")
            if len(parts) < 2 or parts[-2] not in fused_modules or ".layers." not in name:
                out.append((name, tensor))
                continue
            module = self.get_submodule(".".join(parts[:-1]))
            rows_per = BLOCK if parts[-1] == "weight_scale_inv" else 1  # block scales: a row per 128 weight rows
            sizes = [module.full_sizes[sub] // rows_per for sub in module.shard_ids]
            if tensor.dim() == 0 or tensor.shape[0] != sum(sizes):
                raise ValueError(
                    f"weight {name!r}: shape {list(tensor.shape)}, but its {', '.join(module.shard_ids)} have "
                    f"{sum(sizes)} rows"
                )
            prefix = ".".join(parts[:-2])
            pieces = zip(module.shard_ids, tensor.split(sizes), strict=True)
            out += [(f"{prefix}.{sub}.{parts[-1]}", piece) for sub, piece in pieces]
        return out

    def _fp8_module(self, name: str) -> nn.Module | None:
        """The FP8 module (a projection, a MoE layer's experts) that checkpoint tensor `name` (a weight or its scales)
        belongs to, if any: it has the `fp8` scheme, whose `quantize` makes a weight's fp8 tensor and scales."""
        target = self._resolve(name)
        if target is None or target[0].dtype != FP8_DTYPE and not name.endswith(("weight_scale_inv", "weight_scale")):
            return None
        module = self._module_of(name)
        return module if getattr(module, "fp8", None) is not None else None

    def _module_of(self, name: str) -> nn.Module:
        """The module holding checkpoint tensor `name` (a fused projection for its parts)."""
        parts = name.split(".")
        fused = self.fused_names.get(parts[-2])
        return self.get_submodule(".".join(parts[:-2] + [fused or parts[-2]]))

    def _scale_name(self, weight_name: str, module: Linear) -> str:
        return weight_name.removesuffix("weight") + module.fp8.scale_name

    def set_batch_invariant(self, enabled: bool) -> None:
        """Compute every projection and the LM head with the batch-invariant matmul (rlserve.model.batch_invariant),
        and run the fused kernels even under autograd, so that a trainer's forward gives the engine's bits."""
        self.batch_invariant = enabled
        for module in self.modules():
            if isinstance(module, (Linear, RMSNorm, Attention, MLP)):
                module.batch_invariant = enabled

    # ---- LoRA adapters (rlserve.model.lora) ----

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        """Give every projection of the decoder layers `num_slots` empty adapter slots of rank `max_rank`."""
        if self.tp.size > 1:
            raise ValueError("enable_lora: not with tensor_parallel_size > 1 yet (adapters are not sharded)")
        if self.spec.moe is not None:
            raise ValueError(f"enable_lora: {self.spec.architecture} is a MoE model; adapters need a dense decoder")
        weight = self.lm_head.weight
        for module in self._lora_targets():
            parts = tuple(module.shards.values()) if module.shard_ids else ((0, module.out_features),)
            module.lora = LoRASlots(
                module.in_features, module.out_features, parts, num_slots, max_rank, weight.dtype, weight.device
            )

    def _lora_targets(self) -> Iterator[Linear]:
        for layer in self.model.layers:
            yield from (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)

    def load_lora(self, slot: int, adapter: PEFTAdapter) -> None:
        """Write `adapter` into `slot` of every projection (those it does not target get no delta). Every tensor's
        module and shape is checked before anything is written: a refused adapter changes nothing."""
        plan: dict[Linear, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        for name, (a, b) in adapter.weights.items():
            module, part = self._lora_target(name)
            rows = module.lora.parts[part][1]
            if a.shape[1] != module.in_features or b.shape[0] != rows:
                raise ValueError(
                    f"adapter tensor {name}.lora_A.weight / lora_B.weight: shapes {list(a.shape)} / {list(b.shape)} "
                    f"do not fit the layer ([r, {module.in_features}] / [{rows}, r])"
                )
            plan.setdefault(module, [None] * len(module.lora.parts))[part] = (a, b)
        for module in self._lora_targets():
            module.lora.write(slot, plan.get(module, []), adapter.scaling)

    def _lora_target(self, name: str) -> tuple[Linear, int]:
        """The projection and the part of it that adapter module `name` (`model.layers.0.self_attn.q_proj`) adapts."""
        parts = name.split(".")
        fused = self.fused_names.get(parts[-1])
        try:
            module = self.get_submodule(".".join(parts[:-1] + [fused or parts[-1]]))
        except AttributeError:
            module = None
        if not isinstance(module, Linear) or module.lora is None:
            arch = self.spec.architecture
            raise ValueError(f"adapter tensor {name}.lora_A.weight: no such projection in this {arch} model")
        return module, module.shard_ids.index(parts[-1]) if fused else 0

    def clear_lora(self, slot: int) -> None:
        for module in self._lora_targets():
            module.lora.write(slot, [], 0.0)

    def drop_derived_weights(self) -> None:
        """Forget copies derived from the weights (the fp32 LM head): they are rebuilt from the weights when used."""
        self._lm_head_fp32 = None

    def compute_logits(self, hidden: torch.Tensor, fp32_head: bool = False) -> torch.Tensor:
        """Logits over the whole vocabulary on every rank (gathered from the ranks' parts), so that sampling and
        logprobs are computed as without tensor parallelism."""
        weight = self.lm_head.weight
        if fp32_head:
            if self._lm_head_fp32 is None:  # refreshed whenever load_weights writes the head
                self._lm_head_fp32 = weight.detach().float()
            hidden, weight = hidden.float(), self._lm_head_fp32
        if self.batch_invariant:
            logits = batch_invariant.linear(hidden, weight)
        else:
            logits = torch.nn.functional.linear(hidden, weight)
        return self.lm_head.gather(logits)

    # ---- checkpoint-format weights: one loader for start-up and for live updates ----

    def _resolve(self, name: str) -> tuple[torch.nn.Parameter, ShardSlice] | None:
        """Map a checkpoint name to (parameter, where this rank's part of the tensor sits in it); None for tensors
        the model ignores.

        Cached: a weight update resolves every name several times (check, then write), and walking the module tree
        for 310 names costs milliseconds of a sync that is meant to take a few. Parameters are updated in place, so
        a target never goes stale."""
        try:
            return self._targets[name]
        except KeyError:
            target = self._targets[name] = self._find_target(name)
            return target

    def _find_target(self, name: str) -> tuple[torch.nn.Parameter, ShardSlice] | None:
        if name.endswith(self.ignored_suffixes):
            return None
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        parts = name.split(".")
        fused = self.fused_names.get(parts[-2]) if len(parts) >= 2 else None
        module_name, sub = (".".join(parts[:-2] + [fused]), parts[-2]) if fused else (".".join(parts[:-1]), None)
        try:
            module = self.get_submodule(module_name)
            param = getattr(module, parts[-1])
        except AttributeError:
            raise ValueError(f"weight name {name!r} does not exist in this {self.spec.architecture} model") from None
        if not isinstance(param, torch.nn.Parameter):
            raise ValueError(f"weight name {name!r} does not exist in this {self.spec.architecture} model")
        return param, _shard_slice(module, parts[-1], sub, self.tp.rank)

    def written_names(self, name: str, dtype: torch.dtype | None = None) -> tuple[str, ...]:
        """The names `checkpoint_weights` gives the weights that tensor `name` writes (a tied LM head is the
        embedding; an FP8 projection's weight in another dtype, quantized, its scales too, as does one of unknown
        `dtype`, since an fp8 weight comes with its scales); none for a tensor the model ignores. An unknown name
        raises ValueError."""
        if self._resolve(name) is None:
            return ()
        module = self._fp8_module(name)
        if module is not None and name.endswith(".weight") and dtype != FP8_DTYPE:
            return name, self._scale_name(name, module)
        return ("model.embed_tokens.weight" if name == "lm_head.weight" and self.spec.tie_word_embeddings else name,)

    def check_weights(
        self, metadata: Iterable[tuple[str, tuple[int, ...], torch.dtype]], whole_update: bool = False
    ) -> None:
        """Refuse, before any byte moves, names the model lacks, shapes that differ from the checkpoint's (whole
        tensors, whatever part of them this rank holds), non-float dtypes, and fp8 tensors for parameters that are
        not fp8 (a cast would drop their scales). `whole_update`: `metadata` is all of one update call, in which an
        FP8 projection gets either its weight in another dtype (quantized here) or its fp8 weight and its scales
        together, never one of the pair alone (the other would stay from another version)."""
        metadata = list(metadata)
        for name, shape, dtype in metadata:
            target = self._resolve(name)
            if target is None:
                continue
            expected = target[1].full_shape
            if tuple(shape) != expected:
                raise ValueError(f"weight {name!r}: shape {list(shape)} does not match the model's {list(expected)}")
            if not dtype.is_floating_point:
                raise ValueError(f"weight {name!r}: dtype {dtype} is not a floating-point type")
            served = target[0].dtype
            if dtype.itemsize == 1 and dtype != served:
                why = "serves its weights in FP8 as float8_e4m3fn" if served == FP8_DTYPE else "is not in FP8"
                raise ValueError(
                    f"weight {name!r}: dtype {dtype} does not fit this parameter ({served}): the engine {why} "
                    "(start it with quantization fp8 or fbgemm_fp8 to serve an FP8 checkpoint)"
                )
        if whole_update:
            self._check_fp8_pairs(metadata)

    def _check_fp8_pairs(self, metadata: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        dtypes = {name: dtype for name, _, dtype in metadata}
        for name in dtypes:
            module = self._fp8_module(name)
            if module is None:
                continue
            scale_name = name if not name.endswith(".weight") else self._scale_name(name, module)
            weight_name = scale_name.removesuffix(module.fp8.scale_name) + "weight"
            weight_dtype = dtypes.get(weight_name)
            if weight_dtype == FP8_DTYPE and scale_name not in dtypes:
                raise ValueError(
                    f"weight {weight_name!r}: an fp8 weight needs its scales {scale_name!r} in the same update"
                )
            if scale_name in dtypes and weight_dtype != FP8_DTYPE:
                got = "no weight" if weight_dtype is None else f"the weight in {weight_dtype} (quantized here)"
                raise ValueError(
                    f"weight {scale_name!r}: scales come with their fp8 weight {weight_name!r}; this update has {got}"
                )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy checkpoint-format tensors (whole: each rank keeps its part) into the existing parameters, in place;
        validate all before writing any.

        Any subset of the model's weights may be given. Returns the number of tensors written.
        """
        weights = list(weights)
        self.check_weights((name, tuple(t.shape), t.dtype) for name, t in weights)
        targets, sources = [], []
        written = 0
        for name, tensor in self._quantized(weights):
            if tensor is None:  # quantized straight into its parameters
                written += 1
                continue
            target = self._resolve(name)
            if target is None:
                continue
            param, sl = target
            targets.append(sl.of_param(param.data))
            sources.append(sl.of_checkpoint(tensor))
            if param is self.lm_head.weight:
                self._lm_head_fp32 = None
        # One multi-tensor copy instead of a launch per tensor (310 for a 0.6B model).
        if targets:
            torch._foreach_copy_(targets, sources)
        return written + len(targets)

    def _quantized(self, weights: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The tensors to write: an FP8 projection's weight given in another dtype becomes its fp8 weight and scales,
        quantized on the device the parameter is on (the whole checkpoint tensor: a per-channel scale covers every
        column, whichever rank holds them). Where this rank holds the whole tensor, they are quantized straight into
        the parameters (no temporary and no copy: a full 8B update's FP8 load was 30 ms against bf16's 17 on an H100
        with them) and yielded as None."""
        for name, tensor in weights:
            module = self._fp8_module(name) if name.endswith(".weight") else None
            if module is None or tensor.dtype == FP8_DTYPE:
                yield name, tensor
                continue
            scale_name = self._scale_name(name, module)
            (param, sl), (scale_param, scale_sl) = self._resolve(name), self._resolve(scale_name)
            weight = tensor.to(param.device)
            if sl.whole and scale_sl.whole:
                quantize_fp8_weight(weight, module.fp8, (sl.of_param(param.data), scale_sl.of_param(scale_param.data)))
                yield name, None
                yield scale_name, None
                continue
            q, scale = quantize_fp8_weight(weight, module.fp8)
            yield name, q
            yield scale_name, scale

    def _checkpoint_parts(self) -> Iterator[tuple[str, nn.Module, str, str | None]]:
        """(checkpoint name, module, parameter name, shard id) of every checkpoint tensor, in parameter order."""
        for name, _ in self.named_parameters():  # a tied LM head appears once, as the embedding
            parts = name.split(".")
            module = self.get_submodule(".".join(parts[:-1]))
            ids = getattr(module, "shard_ids", ())
            if ids:
                prefix = ".".join(parts[:-2])
                for sub in ids:
                    yield f"{prefix}.{sub}.{parts[-1]}", module, parts[-1], sub
            else:
                yield name, module, parts[-1], None

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's weights under checkpoint names (views into fused parameters): this rank's part of each."""
        for name, module, param_name, sub in self._checkpoint_parts():
            param = getattr(module, param_name)
            yield name, _shard_slice(module, param_name, sub, self.tp.rank).of_param(param.data)

    def full_checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole checkpoint tensors, put together from every rank's part (a collective: every rank iterates
        them all, in the same order); under one rank, `checkpoint_weights`. For checksums a trainer compares."""
        if self.tp.size == 1:
            yield from self.checkpoint_weights()
            return
        gathered: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # the last parameter, from every rank
        for name, module, param_name, sub in self._checkpoint_parts():
            param = getattr(module, param_name)
            if self.tp.size == 1 or not isinstance(module, ShardedWeights):
                yield name, _shard_slice(module, param_name, sub, 0).of_param(param.data)
                continue
            if gathered is None or gathered[0] is not param:
                gathered = param, _all_gather_rows(self.tp, param.data)
            slices = [module.slice_of(param_name, sub, rank) for rank in range(self.tp.size)]
            full = torch.empty(slices[0].full_shape, dtype=param.dtype, device=param.device)
            for sl, part in zip(slices, gathered[1], strict=True):
                if sl.length is None:  # replicated: every rank's is the whole
                    full = part
                    break
                sl.of_checkpoint(full).copy_(sl.of_param(part))
            yield name, full


def _shard_slice(module: nn.Module, param_name: str, shard_id: str | None, rank: int) -> ShardSlice:
    if isinstance(module, ShardedWeights):
        return module.slice_of(param_name, shard_id, rank)
    return ShardSlice(tuple(getattr(module, param_name).shape))


def _all_gather_rows(tp: TensorParallelGroup, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `tensor`, in rank order; an fp8 one travels as its bytes (gloo has no float8 type)."""
    raw = tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor
    return [part.view(tensor.dtype) for part in tp.all_gather(raw.unsqueeze(0), dim=0)]
