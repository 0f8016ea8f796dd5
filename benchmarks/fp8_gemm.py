"""Where an FP8 projection's time goes on the GPU, against the bf16 GEMM it replaces: at each of Qwen3-8B's projection
shapes and token counts, the median over --iters of one call's GPU time (CUDA events around the replay of a CUDA graph
of several calls, as a decode step replays them; after a warm-up: benchmarks/gpu_timing.py):

  bf16            F.linear in bf16 (the bf16 engine's projection)
  quant torch     the activation quantization as PyTorch ops (rlserve.model.fp8.scaled_mm_activation)
  quant fused     the same in one Triton launch (rlserve.model.kernels.fp8_quant.quantize_activation)
  gemm            scaled_mm alone, on operands quantized beforehand
  fp8 torch       quant torch + gemm: the FP8 projection before the fused kernel
  fp8 fused       quant fused + gemm: rlserve.model.fp8.fp8_linear as the engine runs it

for --method fp8 (BlockWise1x128 x BlockWise128x128) and fbgemm_fp8 (RowWise). A ratio below 1 of "fp8 fused" to
"bf16" is what W1 can gain from the projections; "gemm" alone says how much of it the GEMM leaves.

    python benchmarks/fp8_gemm.py --tokens 1 256 1024 4096
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from gpu_timing import median_ms

from rlserve.model.fp8 import BLOCK, Fp8Scheme, fp8_linear, scaled_gemm, scaled_mm_activation, weight_scale_storage

# Qwen3-8B's projections (out, in).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def time_projection(
    x: torch.Tensor, w16: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, iters: int
) -> dict[str, float]:
    from rlserve.model.kernels.fp8_quant import quantize_activation

    group = BLOCK if scheme.block_wise else None
    xq, xs = quantize_activation(x, group)
    return {
        "bf16": median_ms(lambda: F.linear(x, w16), iters),
        "quant torch": median_ms(lambda: scaled_mm_activation(x, group), iters),
        "quant fused": median_ms(lambda: quantize_activation(x, group), iters),
        "gemm": median_ms(lambda: scaled_gemm(xq, xs, q, scale, scheme, torch.bfloat16), iters),
        "fp8 torch": median_ms(lambda: fp8_linear(x, q, scale, None, scheme), iters),
        "fp8 fused": median_ms(lambda: fp8_linear(x, q, scale, None, scheme, quantize_activation), iters),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 1024, 4096])
    ap.add_argument("--method", nargs="+", default=["fp8", "fbgemm_fp8"], choices=["fp8", "fbgemm_fp8"])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device: the FP8 GEMMs are cuBLASLt's (the CPU runs a reference, not timed here)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    columns = ("bf16", "quant torch", "quant fused", "gemm", "fp8 torch", "fp8 fused", "fused/bf16")
    print(f"{'method':10}  {'shape':7}  {'tokens':>6}  " + "  ".join(f"{c:>11}" for c in columns) + "  (ms)")
    for method in args.method:
        scheme = Fp8Scheme(method)
        for name, (out_features, in_features) in SHAPES.items():
            weight = torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02
            q, scale = scheme.quantize(weight)
            if scheme.block_wise:  # as the loader stores it
                scale = weight_scale_storage(tuple(scale.shape), "cuda").copy_(scale)
            w16 = weight.bfloat16()
            for tokens in args.tokens:
                x = torch.randn(tokens, in_features, device="cuda", generator=gen).bfloat16()
                ms = time_projection(x, w16, q, scale, scheme, args.iters)
                cells = "  ".join(f"{v:11.3f}" for v in ms.values())
                ratio = f"{ms['fp8 fused'] / ms['bf16']:10.2f}x"
                print(f"{method:10}  {name:7}  {tokens:6}  {cells}  {ratio}", flush=True)


if __name__ == "__main__":
    main()
