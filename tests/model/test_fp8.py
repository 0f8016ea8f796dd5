"""FP8 weights (rlserve.model.fp8) on the CPU reference path: both layouts against transformers' own FP8 conversion
ops (the `Fp8Quantize` / `Fp8Dequantize` of transformers.integrations.finegrained_fp8, which write and read
DeepSeek-V3 / Qwen3-FP8 checkpoints), round-trip error bounds, the reference GEMM, and the checkpoint configs rlserve
loads or refuses."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import FbgemmFp8Config, FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

from rlserve.model.fp8 import (
    BLOCK,
    FP8_DTYPE,
    Fp8Scheme,
    dequantize_activation,
    fp8_linear,
    gemm_weight_scales,
    quantize_activation,
    quantize_checkpoint,
    scheme_from_hf_config,
)
from rlserve.model.layers import MergedColumnParallelLinear, RowParallelLinear
from rlserve.model.loader import load_model
from rlserve.model.parallel import TensorParallelGroup
from rlserve.toy import make_fp8_model_dir, make_model_dir

BLOCK_WISE, PER_CHANNEL = Fp8Scheme("fp8"), Fp8Scheme("fbgemm_fp8")
# e4m3 keeps 3 mantissa bits: a normal value rounds to within 2**-4 of itself; below 2**-6 (the smallest normal)
# the spacing is 2**-9, so the absolute error there is at most half of that, times the scale.
RELATIVE_ROUNDING = 2.0**-4
SUBNORMAL_STEP = 2.0**-9


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, as trained weights have: a per-block scale has to follow them.
    return torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 1, rows).unsqueeze(1)


def _scale_per_element(scheme: Fp8Scheme, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if scheme.block_wise:
        return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: shape[0], : shape[1]]
    return scale.expand(shape)


@pytest.mark.parametrize("scheme", [BLOCK_WISE, PER_CHANNEL], ids=lambda s: s.method)
@pytest.mark.parametrize("shape", [(256, 384), (200, 300)], ids=["whole-blocks", "partial-blocks"])
def test_round_trip_is_within_fp8_rounding(scheme: Fp8Scheme, shape: tuple[int, int]) -> None:
    w = _weight(*shape)
    q, scale = scheme.quantize(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == scheme.scale_shape(*shape)
    back = scheme.dequantize(q, scale)
    bound = RELATIVE_ROUNDING * w.abs() + SUBNORMAL_STEP / 2 * _scale_per_element(scheme, scale, w.shape)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    # Each block's (row's) largest magnitude maps to +-448 exactly.
    assert q.float().abs().max() == 448.0
    # Quantizing the dequantized weight gives the same bits (what an update of unchanged weights must do).
    q2, scale2 = scheme.quantize(back)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)


def test_block_wise_layout_is_transformers_fp8_checkpoints() -> None:
    """Our tensors read back through transformers' dequantization exactly, and transformers' quantization of the same
    weight gives our scales and, but for ties rounded the other way by its multiply-by-reciprocal, our fp8 values."""
    w = _weight(256, 384)
    q, scale = BLOCK_WISE.quantize(w)
    hf = SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=(BLOCK, BLOCK)))
    theirs = Fp8Dequantize(hf).convert({"weight": q, "weight_scale_inv": scale})["weight"]
    assert torch.equal(theirs.float(), BLOCK_WISE.dequantize(q, scale))
    quantized = Fp8Quantize(hf).convert({"model.layers.0.mlp.up_proj.weight": w})
    their_q, their_scale = (
        quantized["model.layers.0.mlp.up_proj.weight"],
        quantized["model.layers.0.mlp.up_proj.weight_scale_inv"],
    )
    torch.testing.assert_close(their_scale, scale, rtol=1e-6, atol=0)
    same = their_q.view(torch.uint8) == q.view(torch.uint8)
    assert same.float().mean() > 0.999


def test_per_channel_layout_reads_back_through_transformers() -> None:
    w = _weight(96, 200)
    q, scale = PER_CHANNEL.quantize(w)
    assert scale.shape == (96, 1)
    hf = SimpleNamespace(quantization_config=FineGrainedFP8Config())
    theirs = Fp8Dequantize(hf).convert({"weight": q, "weight_scale_inv": scale})["weight"]  # a [1, 200] block grid
    assert torch.equal(theirs.float(), PER_CHANNEL.dequantize(q, scale))


@pytest.mark.parametrize("group", [None, BLOCK], ids=["per-token", "per-128-group"])
def test_activation_quantization_scales_each_token_and_group(group: int | None) -> None:
    x = torch.randn(7, 256) * torch.logspace(-2, 2, 7).unsqueeze(1)
    q, scale = quantize_activation(x, group)
    assert scale.shape == ((7, 1) if group is None else (7, 2))
    back = dequantize_activation(q, scale, group)
    per_element = scale if group is None else scale.repeat_interleave(BLOCK, 1)
    assert ((back - x).abs() <= (RELATIVE_ROUNDING * x.abs() + SUBNORMAL_STEP / 2 * per_element) * (1 + 1e-6)).all()


@pytest.mark.parametrize("scheme", [BLOCK_WISE, PER_CHANNEL], ids=lambda s: s.method)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_gemm_is_the_product_of_dequantized_operands(scheme: Fp8Scheme, dtype: torch.dtype) -> None:
    w, x, bias = _weight(256, 384), torch.randn(2, 5, 384).to(dtype), torch.randn(256).to(dtype)
    q, scale = scheme.quantize(w)
    y = fp8_linear(x, q, scale, bias, scheme)
    assert y.shape == (2, 5, 256) and y.dtype == dtype
    xq, xs = quantize_activation(x.reshape(10, 384), BLOCK if scheme.block_wise else None)
    group = BLOCK if scheme.block_wise else None
    expected = (dequantize_activation(xq, xs, group) @ scheme.dequantize(q, scale).t()).to(dtype) + bias
    torch.testing.assert_close(y.reshape(10, 256), expected, rtol=0, atol=0)
    # And close to the unquantized product: each operand within 2**-4 relative.
    exact = x.float().reshape(10, 384) @ w.t() + bias.float()
    assert (y.reshape(10, 256).float() - exact).norm() / exact.norm() < 0.05


def test_fused_projection_quantizes_each_checkpoint_tensor_in_its_own_blocks() -> None:
    with torch.device("meta"):
        layer = MergedColumnParallelLinear(256, {"gate_proj": 128, "up_proj": 384}, False, TensorParallelGroup())
        layer.quantize_fp8(BLOCK_WISE)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale_inv.shape == (4, 2)
    scale_slice = layer.slice_of("weight_scale_inv", "up_proj", 0)
    assert (scale_slice.full_shape, scale_slice.offset, scale_slice.length) == ((3, 2), 1, 3)
    with torch.device("meta"):
        odd = MergedColumnParallelLinear(256, {"gate_proj": 96, "up_proj": 96}, False, TensorParallelGroup())
    with pytest.raises(ValueError, match="multiples of 128; gate_proj has 96x256"):
        odd.check_fp8_blocks()
    layer.check_fp8_blocks()  # 256 inputs: whole blocks, though not the groups of 4 cuBLASLt reads (padded storage)
    odd.quantize_fp8(PER_CHANNEL)  # per-channel has no block constraint
    assert odd.slice_of("weight_scale", "up_proj", 0).offset == 96


def test_block_wise_scales_are_stored_padded_for_the_gpu_gemm(tmp_path: Path) -> None:
    """cuBLASLt's 128x128 block scaling reads weight_scale_inv transposed as [L4, out/128], L4 = in/128 rounded up to
    a multiple of 4: the loader's storage has that padding behind the [out/128, in/128] parameter, so the GEMM's
    operand is a view; scales without it (a weight back from sleep) are copied into it."""
    model_dir = make_model_dir(tmp_path / "m", preset="tiny-fp8", seed=0)
    model, _ = load_model(str(model_dir), "float32", torch.device("cpu"), quantization="fp8")
    down = model.model.layers[0].mlp.down_proj  # 256 inputs: 2 blocks, padded to 4
    scale = down.weight_scale_inv
    assert scale.shape == (1, 2) and scale.stride() == (4, 1)
    operand = gemm_weight_scales(scale)
    assert operand.shape == (4, 1) and operand.stride() == (1, 4) and operand.data_ptr() == scale.data_ptr()
    assert torch.equal(operand[:2].t(), scale) and not operand[2:].any()
    contiguous = torch.empty(scale.shape).copy_(scale)
    copied = gemm_weight_scales(contiguous)
    assert copied.stride() == (1, 4) and copied.data_ptr() != contiguous.data_ptr()
    assert torch.equal(copied, operand)
    wide = torch.rand(3, 8)  # in/128 already a multiple of 4: the parameter as it is
    assert gemm_weight_scales(wide).data_ptr() == wide.data_ptr() and torch.equal(gemm_weight_scales(wide), wide.t())


def test_per_channel_scales_are_whole_rows_under_a_column_split() -> None:
    """A row-parallel layer splits its columns over the ranks; a per-channel scale covers the whole row, so every rank
    holds all of it (quantized from the whole checkpoint tensor)."""
    with torch.device("meta"):
        layer = RowParallelLinear(256, 128, False, TensorParallelGroup(rank=1, size=2))
        layer.quantize_fp8(PER_CHANNEL)
    assert layer.slice_of("weight_scale", None, 1).length is None
    with torch.device("meta"):
        block = RowParallelLinear(512, 128, False, TensorParallelGroup(rank=1, size=2))
        block.quantize_fp8(BLOCK_WISE)
    sl = block.slice_of("weight_scale_inv", None, 1)
    assert (sl.full_shape, sl.dim, sl.start, sl.length) == ((1, 4), 1, 2, 2)


def test_quantize_checkpoint_quantizes_the_projections_only() -> None:
    weights = {
        "model.layers.0.self_attn.q_proj.weight": _weight(128, 128),
        "model.layers.0.input_layernorm.weight": torch.ones(128),
        "model.embed_tokens.weight": torch.randn(10, 128),
        "lm_head.weight": torch.randn(10, 128),
    }
    out = dict(quantize_checkpoint(weights.items(), BLOCK_WISE))
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (1, 1)
    for name in ("model.layers.0.input_layernorm.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert out[name] is weights[name]


def test_checkpoint_configs_are_read_or_refused_by_name() -> None:
    assert scheme_from_hf_config(None, FineGrainedFP8Config().to_dict()) == BLOCK_WISE
    assert scheme_from_hf_config("fp8", FineGrainedFP8Config().to_dict()) == BLOCK_WISE
    assert scheme_from_hf_config(None, FbgemmFp8Config().to_dict()) == PER_CHANNEL
    assert scheme_from_hf_config("fbgemm_fp8", None) == PER_CHANNEL
    assert scheme_from_hf_config(None, None) is None
    assert scheme_from_hf_config("bf16_last_layer_fp32", None) is None
    refused = {
        "was asked for, but the checkpoint is 'fp8'": ("fbgemm_fp8", FineGrainedFP8Config().to_dict()),
        "weight_block_size \\(64, 64\\)": (None, FineGrainedFP8Config(weight_block_size=(64, 64)).to_dict()),
        "scale_fmt 'ue8m0'": (None, FineGrainedFP8Config(scale_fmt="ue8m0").to_dict()),
        "activation_scheme 'static'": (None, FineGrainedFP8Config(activation_scheme="static").to_dict()),
        "quant_method 'awq' is not implemented": (None, {"quant_method": "awq"}),
        "leaves layers unquantized \\(\\['model.layers.0.mlp'\\]\\)": (
            None,
            FbgemmFp8Config(modules_to_not_convert=["lm_head", "model.layers.0.mlp"]).to_dict(),
        ),
    }
    for message, (requested, config) in refused.items():
        with pytest.raises(ValueError, match=message):
            scheme_from_hf_config(requested, config)
    assert scheme_from_hf_config(None, FbgemmFp8Config(modules_to_not_convert=["lm_head"]).to_dict()) == PER_CHANNEL


@pytest.mark.parametrize("method", ["fp8", "fbgemm_fp8"])
def test_an_fp8_moe_checkpoint_loads_as_the_checkpoint_quantized_at_load(tmp_path: Path, method: str) -> None:
    """Qwen3-MoE: each expert's fp8 weights and scales (`experts.E.gate_proj.weight_scale_inv`, ...) land in the
    stacked experts exactly where quantizing the bf16 checkpoint at load puts them."""
    model_dir = make_model_dir(tmp_path / "moe", preset="tiny-moe-fp8", seed=3)
    from_file, _ = load_model(str(make_fp8_model_dir(tmp_path / "fp8", model_dir, method)), "float32", "cpu")
    at_load, _ = load_model(str(model_dir), "float32", torch.device("cpu"), quantization=method)
    got, want = dict(from_file.checkpoint_weights()), dict(at_load.checkpoint_weights())
    scale = f"model.layers.1.mlp.experts.3.up_proj.{Fp8Scheme(method).scale_name}"
    assert scale in got and got.keys() == want.keys()
    assert all(
        torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want if got[n].dtype == FP8_DTYPE
    )
    assert all(torch.equal(got[n], want[n]) for n in want if got[n].dtype != FP8_DTYPE)


def test_an_fp8_checkpoint_without_a_scale_is_refused(tmp_path: Path) -> None:
    fp8_dir = make_fp8_model_dir(tmp_path / "fp8", make_model_dir(tmp_path / "bf16", preset="tiny-fp8"))
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    model, _ = load_model(str(fp8_dir), "auto", torch.device("cpu"))  # the layout from quantization_config
    assert model.model.layers[1].mlp.down_proj.fp8 == BLOCK_WISE
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights \\['model.layers.1.mlp.down_proj.weight_scale_inv'\\]"):
        load_model(str(fp8_dir), "auto", torch.device("cpu"))
