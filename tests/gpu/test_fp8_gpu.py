"""FP8 on the GPU: the tensor-core GEMMs (torch.nn.functional.scaled_mm, RowWise and BlockWise1x128 x
BlockWise128x128) against the CPU reference path's arithmetic (rlserve.model.fp8.reference_matmul, the same
dequantized operands multiplied in fp32) at Qwen3-8B's projection shapes and one whose in/128 is not a multiple of 4
(padded weight scales), with the activations quantized by PyTorch and by the fused Triton kernel, whose bits must be
PyTorch's, and so must the weight quantization kernel's; a weight update of an FP8 engine that runs on CUDA
graphs: the same storage (captured pointers), and outputs equal to a fresh engine of the new weights;
and the ipc backend's updates, bf16 and trainer-quantized.

    pytest -q tests/gpu/test_fp8_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve import LLM, SamplingParams
from rlserve.config import WeightTransferConfig
from rlserve.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
from rlserve.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from rlserve.model.fp8 import (
    BLOCK,
    Fp8Scheme,
    fp8_linear,
    quantize_activation,
    quantize_checkpoint,
    reference_matmul,
    scaled_mm_activation,
    weight_scale_storage,
)
from rlserve.model.layers import fp8_activation_kernel, quantize_fp8_weight
from rlserve.model.loader import iterate_checkpoint
from rlserve.rl.fp8_weights import Fp8QuantizedSource
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import compare_checksums, weight_checksums

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Qwen3-8B's projections (out, in): qkv, o, gate_up, down; and one whose in/128 is not a multiple of 4 (the padded
# weight-scale layout).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288), "odd": (256, 384)}
TOKENS = (1, 7, 16, 128, 1024)
SCHEMES = [Fp8Scheme("fp8"), Fp8Scheme("fbgemm_fp8")]


@pytest.mark.parametrize("group", [None, BLOCK], ids=["per-token", "per-128-group"])
def test_fused_activation_quantization_is_the_torch_paths_bits(group: int | None) -> None:
    kernel = fp8_activation_kernel(torch.empty(0, device="cuda"))
    assert kernel is not None  # Triton is there
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens in TOKENS:
        x = torch.randn(tokens, 12288, device="cuda", generator=gen).bfloat16() * 10.0 ** (tokens % 5 - 2)
        (q, scales), (ref_q, ref_scales) = kernel(x, group), scaled_mm_activation(x, group)
        assert q.stride() == ref_q.stride() and scales.shape == ref_scales.shape
        assert scales.stride() == ref_scales.stride() and torch.equal(scales, ref_scales)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), (group, tokens)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.method)
def test_weight_quantization_kernel_is_the_torch_paths_bits(scheme: Fp8Scheme) -> None:
    """What a bf16 update into an FP8 engine runs (rlserve.model.layers.quantize_fp8_weight) at the 8B projection
    shapes and the odd one, bf16 and fp32 weights of very different magnitudes per row."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for out_features, in_features in SHAPES.values():
        rows = torch.logspace(-5, 1, out_features, device="cuda").unsqueeze(1)
        for dtype in (torch.bfloat16, torch.float32):
            weight = (torch.randn(out_features, in_features, device="cuda", generator=gen) * rows).to(dtype)
            (q, scale), (ref_q, ref_scale) = quantize_fp8_weight(weight, scheme), scheme.quantize(weight)
            assert q.stride() == ref_q.stride() and torch.equal(scale, ref_scale), (scheme.method, dtype)
            assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), (scheme.method, dtype, in_features)


@pytest.mark.parametrize("fused", [False, True], ids=["torch-quant", "fused-quant"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.method)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_cuda_gemm_equals_the_reference_arithmetic(scheme: Fp8Scheme, shape: tuple[int, int], fused: bool) -> None:
    out_features, in_features = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(shape, device="cuda", generator=gen) * 0.02
    q, scale = scheme.quantize(weight)
    if scheme.block_wise:  # as the loader stores it (padded for cuBLASLt); the contiguous scales are padded per call
        scale = weight_scale_storage(tuple(scale.shape), "cuda").copy_(scale) if fused else scale
    bias = torch.randn(out_features, device="cuda", generator=gen).bfloat16()
    kernel = fp8_activation_kernel(bias) if fused else None
    for tokens in TOKENS:
        x = torch.randn(tokens, in_features, device="cuda", generator=gen).bfloat16()
        got = fp8_linear(x, q, scale, bias, scheme, kernel)
        assert got.dtype == torch.bfloat16 and got.shape == (tokens, out_features)
        xq, xs = quantize_activation(x, BLOCK if scheme.block_wise else None)
        want = reference_matmul(xq, xs, q, scale, scheme) + bias.float()
        # Same products, another summation order, a bf16 result: within bf16 rounding of each output plus a
        # little of the largest (a wrong scale layout is off by O(1) of it).
        err = (got.float() - want).abs()
        bound = 2**-7 * want.abs() + 2**-9 * want.abs().max()
        assert (err <= bound).all(), (scheme.method, shape, tokens, float(err.max()))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory):
    """(old, new) bf16 checkpoints of a preset, made once per module."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(preset: str) -> tuple[Path, Path]:
        if preset not in made:
            root = tmp_path_factory.mktemp(f"fp8-gpu-{preset}")
            made[preset] = (
                make_model_dir(root / "old", preset=preset, seed=0, dtype=torch.bfloat16),
                make_model_dir(root / "new", preset=preset, seed=1, dtype=torch.bfloat16),
            )
        return made[preset]

    return make


@pytest.fixture(scope="module")
def dirs(model_dirs) -> tuple[Path, Path]:
    return model_dirs("tiny-fp8")


def _tokens(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8, 9, 10 + i]} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["fp8", "fbgemm_fp8"])
@pytest.mark.parametrize("preset", ["tiny-fp8", "tiny-moe-fp8"])  # dense, and FP8 experts in the fused MoE kernel
def test_update_keeps_the_captured_pointers_and_outputs_equal_a_fresh_engine(
    model_dirs, preset: str, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = model_dirs(preset)
    monkeypatch.setenv("RLSERVE_ENABLE_MULTIPROCESSING", "0")  # the test reads the runner's parameters
    common = dict(device="cuda", dtype="bfloat16", quantization=method, num_kv_blocks=256, max_model_len=256)
    fresh = LLM(str(new), **common)
    expected = _tokens(fresh)
    fresh.shutdown()
    llm = LLM(str(old), **common)
    try:
        runner = llm.engine_core.runner
        assert runner.cuda_graphs is not None  # decode runs on captured graphs
        pointers = {name: p.data_ptr() for name, p in runner.model.named_parameters()}
        before = _tokens(llm)
        llm.load_weights(list(iterate_checkpoint(str(new))))  # bf16, quantized in place
        assert {name: p.data_ptr() for name, p in runner.model.named_parameters()} == pointers
        assert _tokens(llm) == expected != before
        llm.load_weights(list(iterate_checkpoint(str(old))))
        assert _tokens(llm) == before
    finally:
        llm.shutdown()


@pytest.mark.parametrize("packed", [False, True])
def test_ipc_updates_bf16_and_trainer_quantized(dirs, packed: bool) -> None:
    """The colocated ipc backend into an FP8 engine: the bf16 trainer's weights (quantized by the engine), then the same
    weights quantized by the trainer (Fp8QuantizedSource); both equal the checkpoint quantized."""
    old, new = dirs
    ipc = WeightTransferConfig("ipc")
    llm = LLM(
        str(old), dtype="bfloat16", device="cuda:0", quantization="fp8", num_kv_blocks=256, weight_transfer_config=ipc
    )
    try:
        trainer_model = AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.bfloat16).to("cuda:0")
        expected = weight_checksums(
            (name, t.cpu()) for name, t in quantize_checkpoint(trainer_model.state_dict().items(), Fp8Scheme("fp8"))
        )
        for source in (ModuleSource(trainer_model), Fp8QuantizedSource(ModuleSource(trainer_model))):
            init_info = IPCTrainerInitInfo(packed=packed, packed_buffer_size_bytes=4 << 20)
            engine = WeightTransferTrainerFactory.trainer_init(init_info, client=llm, source=source)
            llm.load_weights(list(iterate_checkpoint(str(old))))  # back to the old weights: the send must change them
            assert llm.weight_checksums() != expected
            engine.send_weights()
            engine.shutdown()
            assert compare_checksums(expected, llm.weight_checksums())["match"], type(source).__name__
    finally:
        llm.shutdown()
