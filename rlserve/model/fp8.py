"""FP8 (float8_e4m3fn) weights for the decoder's dense projections, with dynamically quantized activations.

Two layouts, each named after the checkpoints (and vLLM's `quantization` methods) that use it:
- "fp8", block-wise: DeepSeek-V3's and Qwen3-FP8's. Each 128x128 block of a weight [out, in] has one fp32 scale,
  `weight_scale_inv` [ceil(out/128), ceil(in/128)] (the name is the checkpoints'; the weight is `q * scale_inv`);
  activations get a scale per token and 128-wide group of features.
- "fbgemm_fp8", per-channel: a scale per output row, `weight_scale` [out, 1]; activations a scale per token.

In both, a dequantized tensor is `q.float() * scale` and a scale is the block's (row's) largest magnitude over
FP8_MAX, so the largest element maps to +-448 exactly. On CUDA the product runs on the FP8 tensor cores through
`torch.nn.functional.scaled_mm` (RowWise x RowWise, or BlockWise1x128 x BlockWise128x128, which needs cuBLASLt 12.9+
on Hopper); elsewhere the reference: dequantize both operands and multiply in fp32, which is what the FP8 GEMM
computes up to its accumulation order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
BLOCK = 128
# Smallest amax a scale is computed from: an all-zero block gets a tiny scale (its q are 0), never a 0 to divide by.
MIN_AMAX = 1e-12
# The decoder projections whose weights are quantized (checkpoint sub-names); the LM head, embeddings, norms and a
# MoE router stay in the model dtype.
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Fp8Scheme:
    method: str  # "fp8" (block-wise 128x128) or "fbgemm_fp8" (per-channel)

    def __post_init__(self) -> None:
        if self.method not in FP8_METHODS:
            raise ValueError(f"quantization: {self.method!r} is not an FP8 method ({', '.join(FP8_METHODS)})")

    @property
    def block_wise(self) -> bool:
        return self.method == "fp8"

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.block_wise else "weight_scale"

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        if self.block_wise:
            return -(-out_features // BLOCK), -(-in_features // BLOCK)
        return out_features, 1

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_blockwise(weight) if self.block_wise else quantize_per_channel(weight)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_blockwise(q, scale) if self.block_wise else q.float() * scale


FP8_METHODS = ("fp8", "fbgemm_fp8")


@dataclass(frozen=True)
class ExpertScales:
    """The scales of a MoE layer's stacked fp8 experts w13 [E, 2I, H] and w2 [E, H, I], as the fused MoE kernel reads
    them: block-wise each expert's weight_scale_inv, [E, 2I/128, H/128] and [E, H/128, I/128]; per-channel each
    expert's weight_scale without its unit column, [E, 2I] and [E, H]."""

    scheme: Fp8Scheme
    w13: torch.Tensor
    w2: torch.Tensor

    @property
    def block_wise(self) -> bool:
        return self.scheme.block_wise

    def check(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        for name, weight, scale in (("w13", w13, self.w13), ("w2", w2, self.w2)):
            experts, rows, cols = weight.shape
            want = (experts, *self.scheme.scale_shape(rows, cols))[: 3 if self.block_wise else 2]
            if tuple(scale.shape) != want or scale.dtype != torch.float32:
                raise ValueError(
                    f"fused_moe: {name}'s {self.scheme.method} scales are {tuple(scale.shape)} {scale.dtype}; its "
                    f"weight {tuple(weight.shape)} needs {want} float32"
                )


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    # A true division on every device: PyTorch's CUDA kernel divides by a Python number (or a CPU scalar) as a multiply
    # by its reciprocal, 1 ulp off now and then, which broke the fused kernel's bits on an H100 (2026-12-07), and the
    # division keeps quantize(dequantize(q, s)) == (q, s), what an update of unchanged weights needs.
    amax = amax.float().clamp(min=MIN_AMAX)
    return amax / amax.new_full((), FP8_MAX)


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, a temporary of the caller's) clamped in place and cast."""
    return x.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] zero-padded to whole blocks and viewed as [out blocks, 128, in blocks, 128], in its dtype."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // BLOCK), -(-in_features // BLOCK)
    padded = weight
    if (rows * BLOCK, cols * BLOCK) != tuple(weight.shape):
        padded = F.pad(weight, (0, cols * BLOCK - in_features, 0, rows * BLOCK - out_features))
    return padded.view(rows, BLOCK, cols, BLOCK)


def quantize_blockwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] fp8, weight_scale_inv [ceil(out/128), ceil(in/128)] fp32) with weight ~= q * scale per block.
    The amax is taken in the weight's own dtype (exact: a magnitude), and the division of the bf16 weight by the fp32
    scale computes in fp32 (the exact widening, then IEEE division): the bits of widening first, without the fp32
    copy and its passes, which made a full update's load 7x bf16's on an H100 (2026-12-07)."""
    if weight.dim() != 2:
        raise ValueError(f"fp8 block-wise quantization takes a 2-d weight, got shape {list(weight.shape)}")
    blocks = _blocks(weight)
    scale = _scale_of(blocks.abs().amax(dim=(1, 3)))
    q = _to_fp8(blocks / scale[:, None, :, None]).view(blocks.shape[0] * BLOCK, blocks.shape[2] * BLOCK)
    return q[: weight.shape[0], : weight.shape[1]].contiguous(), scale


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_features, in_features = q.shape
    full = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return q.float() * full[:out_features, :in_features]


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] fp8, weight_scale [out, 1] fp32) with weight ~= q * scale per row."""
    if weight.dim() != 2:
        raise ValueError(f"fp8 per-channel quantization takes a 2-d weight, got shape {list(weight.shape)}")
    scale = _scale_of(weight.abs().amax(dim=1, keepdim=True))  # as quantize_blockwise: no fp32 copy of the weight
    return _to_fp8(weight / scale), scale


def quantize_activation(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, features] -> (q fp8, scales fp32): one per token (group None, [tokens, 1]) or per token and
    `group` features ([tokens, features / group]); features must be a multiple of `group`."""
    xf = x.float()
    if group is None:
        scale = _scale_of(xf.abs().amax(dim=-1, keepdim=True))
        return _to_fp8(xf / scale), scale
    grouped = xf.view(x.shape[0], -1, group)
    scale = _scale_of(grouped.abs().amax(dim=-1))
    return _to_fp8(grouped / scale.unsqueeze(-1)).view(x.shape), scale


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, group: int | None) -> torch.Tensor:
    if group is None:
        return q.float() * scale
    return (q.float().view(q.shape[0], -1, group) * scale.unsqueeze(-1)).view(q.shape)


ActivationQuantizer = Callable[[torch.Tensor, int | None], tuple[torch.Tensor, torch.Tensor]]


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    scheme: Fp8Scheme,
    quantize_for_gemm: ActivationQuantizer | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) for an fp8 weight with its scales; x [..., in] in the model dtype, the result in x's dtype.
    On CUDA the activations are quantized by `quantize_for_gemm` (the fused kernel of
    rlserve.model.kernels.fp8_quant, which rlserve.model.layers passes where Triton is) or `scaled_mm_activation`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    group = BLOCK if scheme.block_wise else None
    if x.is_cuda:  # the GEMM writes bf16 (what cuBLASLt's scaled GEMMs support everywhere); fp16/fp32 models cast
        xq, xs = (quantize_for_gemm or scaled_mm_activation)(x2, group)
        y = scaled_gemm(xq, xs, weight, scale, scheme, torch.bfloat16)[: x2.shape[0]].to(x.dtype)
    else:
        xq, xs = quantize_activation(x2, group)
        y = reference_matmul(xq, xs, weight, scale, scheme).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])


def reference_matmul(
    xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme
) -> torch.Tensor:
    """The FP8 GEMM's result computed from dequantized operands in fp32 (the CPU path, and the GPU tests' truth)."""
    group = BLOCK if scheme.block_wise else None
    return dequantize_activation(xq, xs, group) @ scheme.dequantize(weight, scale).t()


def scaled_mm_rows(num_tokens: int, group: int | None) -> int:
    """The rows of the activation operand scaled_mm gets: cuBLASLt's block-scaled GEMM wants the activation scales'
    leading dimension (the token count) a multiple of 4, so block-wise pads the tokens (zero rows, unit scales)."""
    return num_tokens if group is None else -(-num_tokens // 4) * 4


def scaled_mm_activation(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation` laid out for scaled_mm: per token as it is; block-wise with the tokens padded
    (`scaled_mm_rows`) and the scales column-major with strides (1, rows), which torch 2.11's scaled_mm checks. The
    PyTorch reference of rlserve.model.kernels.fp8_quant.quantize_activation, which computes it in one launch."""
    xq, xs = quantize_activation(x, group)
    rows = scaled_mm_rows(x.shape[0], group)
    if group is None:
        return xq, xs
    if rows != x.shape[0]:
        xq = torch.cat([xq, xq.new_zeros(rows - x.shape[0], xq.shape[1])])
        xs = torch.cat([xs, xs.new_ones(rows - x.shape[0], xs.shape[1])])
    column_major = torch.empty_strided(xs.shape, (1, rows), dtype=xs.dtype, device=xs.device)
    column_major.copy_(xs)
    return xq, column_major


def weight_scale_storage(shape: tuple[int, int], device: torch.device | str) -> torch.Tensor:
    """Storage for a block-wise `weight_scale_inv` [out/128, in/128]: a view of a zeroed [out/128, L4] buffer, L4 =
    in/128 rounded up to a multiple of 4, which is what cuBLASLt's 128x128 block scaling reads (transposed: [L4,
    out/128], L4-major). The padding columns are never a scale of anything (the GEMM has in/128 groups)."""
    rows, cols = shape
    return torch.zeros((rows, -(-cols // 4) * 4), dtype=torch.float32, device=device)[:, :cols]


def gemm_weight_scales(scale: torch.Tensor) -> torch.Tensor:
    """The [L4, out/128] L4-major operand of `scale` [out/128, in/128]: the padded buffer behind a
    `weight_scale_storage` view, transposed (no copy), or a padded copy where the storage lost its padding (a weight
    brought back from sleep is contiguous)."""
    rows, cols = scale.shape
    padded_cols = -(-cols // 4) * 4
    if scale.stride() != (padded_cols, 1):
        padded = weight_scale_storage((rows, cols), scale.device)
        padded.copy_(scale)
        scale = padded
    return scale.as_strided((rows, padded_cols), (padded_cols, 1)).t()


def scaled_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scheme: Fp8Scheme,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The FP8 GEMM on operands laid out by `scaled_mm_activation` (or its kernel); [rows, out] in out_dtype."""
    recipe = F.ScalingType
    if not scheme.block_wise:
        return F.scaled_mm(
            xq, weight.t(), xs, recipe.RowWise, scale.reshape(1, -1), recipe.RowWise, output_dtype=out_dtype
        )
    # cuBLASLt's block-scaled layouts, which torch 2.11's scaled_mm checks by stride: both scales column-major, the
    # activation's [rows, in/128] with strides (1, rows), the weight's [in/128, out/128] with strides (1, ld): that is
    # weight_scale_inv ([out/128, in/128], row-major) transposed as is.
    return F.scaled_mm(
        xq,
        weight.t(),
        xs,
        recipe.BlockWise1x128,
        gemm_weight_scales(scale),
        recipe.BlockWise128x128,
        output_dtype=out_dtype,
    )


def is_quantized_weight_name(name: str) -> bool:
    """A decoder projection's weight (`model.layers.L.self_attn.q_proj.weight`, ...): what FP8 quantizes."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in QUANTIZED_PROJECTIONS and ".layers." in name


WeightQuantizer = Callable[[torch.Tensor, Fp8Scheme], tuple[torch.Tensor, torch.Tensor]]


def quantize_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme, quantize: WeightQuantizer | None = None
) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with every projection weight replaced by its fp8 tensor and scales (`name` and
    `name_scale_inv` / `name_scale`), the rest as they are: what an FP8 checkpoint holds, and what a trainer that
    quantizes before sending sends. `quantize` (weight, scheme) -> (q, scale) gives the same bits as
    `scheme.quantize` faster (rlserve.model.layers.quantize_fp8_weight, a kernel on CUDA)."""
    for name, tensor in weights:
        if not is_quantized_weight_name(name):
            yield name, tensor
            continue
        q, scale = quantize(tensor, scheme) if quantize is not None else scheme.quantize(tensor)
        yield name, q
        yield name.removesuffix("weight") + scheme.scale_name, scale


def scheme_from_hf_config(requested: str | None, quantization_config: dict[str, Any] | None) -> Fp8Scheme | None:
    """The FP8 scheme of an engine asked for `requested` (None: whatever the checkpoint is) over a checkpoint whose
    config.json has `quantization_config` (None: a checkpoint in the model dtype, quantized at load). A layout rlserve
    does not implement is refused by name."""
    if quantization_config is None:
        return Fp8Scheme(requested) if requested in FP8_METHODS else None
    if not isinstance(quantization_config, dict):
        quantization_config = quantization_config.to_dict()
    method = quantization_config.get("quant_method")
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum, in a config object
    if method not in FP8_METHODS:
        raise ValueError(
            f"model: the checkpoint's quantization_config.quant_method {method!r} is not implemented (rlserve loads "
            f"{', '.join(FP8_METHODS)} checkpoints)"
        )
    if requested is not None and requested != method:
        raise ValueError(f"quantization: {requested!r} was asked for, but the checkpoint is {method!r}")
    if method == "fp8":
        block = quantization_config.get("weight_block_size")
        if block is None or list(block) != [BLOCK, BLOCK]:
            raise ValueError(
                f"model: quantization_config.weight_block_size {block!r}: rlserve implements block-wise [128, 128] "
                "fp8 checkpoints (per-tensor scales are not implemented)"
            )
        if quantization_config.get("scale_fmt") not in (None, "float"):
            raise ValueError(
                f"model: quantization_config.scale_fmt {quantization_config['scale_fmt']!r}: only fp32 scales "
                "('float') are implemented"
            )
        if quantization_config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(
                f"model: quantization_config.activation_scheme {quantization_config['activation_scheme']!r}: only "
                "dynamic activation scales are implemented"
            )
    if quantization_config.get("modules_to_convert"):
        raise ValueError("model: quantization_config.modules_to_convert (a subset quantized) is not implemented")
    skipped = quantization_config.get("ignored_layers") or quantization_config.get("modules_to_not_convert") or []
    others = [name for name in skipped if name != "lm_head"]  # the LM head is never quantized here anyway
    if others:
        raise ValueError(
            f"model: quantization_config leaves layers unquantized ({others[:3]}): only the LM head can be (not "
            "implemented for other layers)"
        )
    return Fp8Scheme(method)
