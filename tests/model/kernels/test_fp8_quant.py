"""CPU checks of the fused FP8 quantization kernels (rlserve.model.kernels.fp8_quant) under TRITON_INTERPRET=1.
Activations: fp8 values and scales bit-identical to the PyTorch reference (rlserve.model.fp8.scaled_mm_activation), in
the same shapes and strides (block-wise: tokens padded to a multiple of 4, scales column-major), for per-token and
128-group scales, bf16 and fp32 inputs, strided rows, all-zero and negative-zero rows. Weights: bit-identical to
`Fp8Scheme.quantize` in both layouts, for shapes that are not whole blocks or chunks, bf16 / fp16 / fp32, strided
weights, all-zero blocks and negative zeros.

The interpreter's own fp32 -> fp8 cast is wrong (interpret_helpers.round_casts_like_the_gpu): these checks make it
round as the GPU's cvt.rn does, so a bit that differs here is the kernel's arithmetic, not the interpreter's.
"""

from __future__ import annotations

import interpret_helpers  # first: sets TRITON_INTERPRET before anything imports triton
import pytest
import torch

interpret_helpers.require_triton()

from rlserve.model.fp8 import BLOCK, FP8_DTYPE, Fp8Scheme, scaled_mm_activation  # noqa: E402
from rlserve.model.kernels.fp8_quant import quantize_activation, quantize_weight  # noqa: E402

interpreted = interpret_helpers.interpreted

if not interpret_helpers.IN_PROCESS:

    def test_in_fresh_process():
        interpret_helpers.run_in_fresh_process(__file__)


FEATURES = 384  # 3 groups of 128; per token a row that is not a power of two (the kernel's block is masked)


@pytest.fixture(autouse=True)
def gpu_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    if interpret_helpers.IN_PROCESS:
        interpret_helpers.round_casts_like_the_gpu(monkeypatch)


def activations(num_tokens: int, dtype: torch.dtype, features: int = FEATURES) -> torch.Tensor:
    """Rows of very different magnitudes, one all zero and one of negative zeros (where there are enough rows), as a
    strided view of a wider buffer (the engine hands projections slices of fused outputs)."""
    gen = torch.Generator().manual_seed(num_tokens)
    buffer = torch.randn(num_tokens, features + 64, generator=gen) * torch.logspace(-4, 3, num_tokens).unsqueeze(1)
    if num_tokens > 2:
        buffer[1] = 0.0
        buffer[2] = -0.0
    return buffer.to(dtype)[:, :features]


def assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, scales), (ref_q, ref_scales) = got, want
    assert q.dtype == FP8_DTYPE and q.shape == ref_q.shape and q.stride() == ref_q.stride()
    assert scales.dtype == torch.float32 and scales.shape == ref_scales.shape
    assert scales.stride() == ref_scales.stride()
    assert torch.equal(scales, ref_scales)
    differing = (q.view(torch.uint8) != ref_q.view(torch.uint8)).sum().item()
    assert differing == 0, f"{differing} of {q.numel()} fp8 values differ from the reference's bits"


@interpreted
@pytest.mark.parametrize("group", [None, BLOCK], ids=["per-token", "per-128-group"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 6, 8])
def test_values_and_scales_are_the_references_bits(group: int | None, dtype: torch.dtype, num_tokens: int) -> None:
    x = activations(num_tokens, dtype)
    got = quantize_activation(x, group)
    assert_same_bits(got, scaled_mm_activation(x, group))
    if group is not None:  # padded to a multiple of 4 tokens: zero values, unit scales, column-major scales
        rows = got[0].shape[0]
        assert rows % 4 == 0 and got[1].stride() == (1, rows)
        assert not got[0][num_tokens:].float().any() and (got[1][num_tokens:] == 1).all()


@interpreted
def test_rows_wider_than_one_programs_groups() -> None:
    """20 groups: a program quantizes 16 of a row's groups, so the row takes two, the second with 12 masked."""
    x = activations(6, torch.bfloat16, features=20 * BLOCK)
    assert_same_bits(quantize_activation(x, BLOCK), scaled_mm_activation(x, BLOCK))


@interpreted
def test_values_that_round_into_the_next_power_of_two() -> None:
    """x / scale just under 128 and 256 rounds up to them (the mantissa carries into the exponent), and ties go to
    even: the roundings Triton's interpreter gets wrong by itself."""
    amax = torch.tensor([448.0])
    ratios = torch.tensor([126.4, 124.0, 252.0, 250.0, 27.0, 29.0, 0.0009765625, 0.0029296875])
    x = torch.cat([amax, ratios, -ratios]).repeat(1, BLOCK)[:, :BLOCK]
    assert_same_bits(quantize_activation(x, BLOCK), scaled_mm_activation(x, BLOCK))
    assert quantize_activation(x, BLOCK)[0][0, 1].float().item() == 128.0


@interpreted
def test_a_width_that_is_not_whole_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="200 features are not a multiple of the group 128"):
        quantize_activation(torch.zeros(2, 200), BLOCK)


def weight(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes as a strided view of a wider buffer, with an all-zero 128x128 block (where
    there is one), a row of negative zeros and a value that is its block's and its row's amax exactly at a tie."""
    gen = torch.Generator().manual_seed(rows * cols)
    buffer = torch.randn(rows, cols + 32, generator=gen) * torch.logspace(-6, 2, rows).unsqueeze(1)
    if rows > BLOCK and cols > BLOCK:
        buffer[:BLOCK, :BLOCK] = 0.0
    buffer[-1] = -0.0
    buffer[-2, 3] = 448.0
    return buffer.to(dtype)[:, :cols]


@interpreted
@pytest.mark.parametrize("method", ["fp8", "fbgemm_fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(200, 300), (6, 1500), (256, 128)])
def test_weights_are_the_references_bits(method: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    scheme = Fp8Scheme(method)
    w = weight(*shape, dtype)
    q, scales = quantize_weight(w, scheme)
    ref_q, ref_scales = scheme.quantize(w)
    assert q.shape == ref_q.shape and q.stride() == ref_q.stride()
    assert scales.shape == ref_scales.shape and scales.dtype == torch.float32
    assert_same_bits((q, scales), (ref_q, ref_scales))


@interpreted
def test_a_weight_that_is_not_2d_is_refused() -> None:
    with pytest.raises(ValueError, match="2-d weight"):
        quantize_weight(torch.zeros(2, 3, 4), Fp8Scheme("fp8"))


@interpreted
@pytest.mark.parametrize("method", ["fp8", "fbgemm_fp8"])
def test_weights_quantized_into_parameter_views_are_the_references_bits(method: str) -> None:
    """Into rows of a larger fp8 parameter and its scales (block-wise: the padded storage the loader gives them), as a
    weight update writes a fused projection's part; the rows around them are untouched."""
    from rlserve.model.fp8 import weight_scale_storage

    scheme = Fp8Scheme(method)
    w = weight(256, 384, torch.bfloat16)
    param = torch.full((512, 384), 7.0).to(FP8_DTYPE)
    rows = 2 if scheme.block_wise else 256
    scales = weight_scale_storage((4, 3), "cpu") if scheme.block_wise else torch.full((512, 1), 5.0)
    out = (param[256:], scales[rows:])
    quantize_weight(w, scheme, out)
    ref_q, ref_scales = scheme.quantize(w)
    assert torch.equal(out[1], ref_scales) and torch.equal(out[0].view(torch.uint8), ref_q.view(torch.uint8))
    assert (param[:256].float() == 7.0).all() and (scales[:rows] == (0.0 if scheme.block_wise else 5.0)).all()


@interpreted
def test_a_wrong_output_is_refused() -> None:
    with pytest.raises(ValueError, match=r"out scales is \[3, 2\]"):
        quantize_weight(
            torch.ones(256, 256), Fp8Scheme("fp8"), (torch.empty(256, 256, dtype=FP8_DTYPE), torch.empty(3, 2))
        )
