"""Issue 32: one MoE layer of the Qwen3-30B-A3B shape by component, each against its own floor, on the GPU.

    python benchmarks/moe_layer_profile.py --tokens 1 64 256 1024 4096 --quantization none fp8

The components of SparseMoeBlock.forward on the fused path (rlserve/model/moe.py, rlserve/model/kernels/fused_moe.py):

  router    the gate's matmul [T, H] x [H, E], softmax and top-k (rlserve.model.moe.route)
  align     the (token, k) pairs sorted by expert and padded to whole tiles (align_by_expert)
  gate_up   the gated grouped GEMM over w13 [E, 2I, H], SiLU(gate) * up (expert_gemm; with FP8, its input's
            quantization too)
  down      the grouped GEMM over w2 [E, H, I] (expert_gemm)
  combine   each token's weighted sum over its k outputs (combine_pairs)
  layer     router + fused_moe, as the model calls them: its excess over the parts' sum is what the phases' hand-offs
            cost

Each time is the median over --iters of one call's GPU time, replayed from a CUDA graph of several calls as a
decode step replays them (benchmarks/gpu_timing.py): the host's launch cost is not in it. Random weights (std 0.02)
and random inputs route about uniformly, as W1's random-weight model does. A component's floor is the larger of its
bytes over the measured bandwidth and its FLOPs over the measured bf16 matmul rate (benchmarks/roofline.py's
measure_ceilings): the weights it reads (of the experts its T tokens touch, E * (1 - (1 - k/E)^T) on uniform
routing) and the activations it reads and writes. "of floor" is floor / time: 100% is at the floor.
The last column multiplies by the preset's layers (48 for the 30B shape): the MoE part of one step at that
many tokens.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gpu_timing import median_ms
from roofline import Ceilings, measure_ceilings

from rlserve.model.fp8 import ExpertScales, Fp8Scheme
from rlserve.model.moe import route
from rlserve.toy import PRESETS

COMPONENTS = ("router", "align", "gate_up", "down", "combine", "layer")


def experts(num: int, rows: int, cols: int, scheme: Fp8Scheme | None, device: torch.device):
    """Stacked random expert weights [num, rows, cols] in bf16, or quantized per expert with their scales."""
    weight = torch.randn(num, rows, cols, dtype=torch.bfloat16, device=device) * 0.02
    if scheme is None:
        return weight, None
    q, scales = zip(*(scheme.quantize(w) for w in weight), strict=True)
    stacked = torch.stack(scales)
    return torch.stack(q), stacked if scheme.block_wise else stacked.squeeze(-1)


def floors_s(
    tokens: int, shape: dict, weight_bytes: float, bandwidth: float, matmul_flops: float
) -> dict[str, float | None]:
    """Each component's floor in seconds (None: no floor modelled; `align` moves a few bytes a pair)."""
    hidden, inter, num_experts, top_k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    touched = num_experts * (1 - (1 - top_k / num_experts) ** tokens)
    pairs = tokens * top_k
    act = 2  # bf16 activations

    def floor(nbytes: float, flops: float) -> float:
        return max(nbytes / bandwidth, flops / matmul_flops)

    parts = {
        "router": floor(num_experts * hidden * act + tokens * hidden * act, 2 * tokens * hidden * num_experts),
        "align": None,
        "gate_up": floor(
            touched * 2 * inter * hidden * weight_bytes + tokens * hidden * act + pairs * inter * act,
            2 * pairs * 2 * inter * hidden,
        ),
        "down": floor(
            touched * hidden * inter * weight_bytes + pairs * inter * act + pairs * hidden * act,
            2 * pairs * hidden * inter,
        ),
        "combine": floor(pairs * hidden * act + tokens * hidden * act, 0),
    }
    parts["layer"] = sum(v for v in parts.values() if v is not None)
    return parts


def time_components(tokens: int, shape: dict, scheme: Fp8Scheme | None, iters: int) -> dict[str, float]:
    from rlserve.model.kernels.fused_moe import align_by_expert, combine_pairs, expert_gemm, fused_moe, moe_tiles

    device = torch.device("cuda")
    hidden, inter, num_experts, top_k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    gate = torch.randn(num_experts, hidden, dtype=torch.bfloat16, device=device) * 0.02
    w13, s13 = experts(num_experts, 2 * inter, hidden, scheme, device)
    w2, s2 = experts(num_experts, hidden, inter, scheme, device)
    fp8 = None if scheme is None else ExpertScales(scheme, s13, s2)
    weights, ids = route(F.linear(x, gate), top_k, norm_topk_prob=True)
    cfg = moe_tiles(ids, w13, False, fp8)
    rows = align_by_expert(ids, num_experts, cfg.block_m)
    h = expert_gemm(x, w13, rows, cfg, top_k, gated=True, fp8=fp8)
    y = expert_gemm(h, w2, rows, cfg, 1, gated=False, fp8=fp8)
    calls: dict[str, Callable[[], object]] = {
        "router": lambda: route(F.linear(x, gate), top_k, norm_topk_prob=True),
        "align": lambda: align_by_expert(ids, num_experts, cfg.block_m),
        "gate_up": lambda: expert_gemm(x, w13, rows, cfg, top_k, gated=True, fp8=fp8),
        "down": lambda: expert_gemm(h, w2, rows, cfg, 1, gated=False, fp8=fp8),
        "combine": lambda: combine_pairs(y, weights),
        "layer": lambda: fused_moe(x, w13, w2, *route(F.linear(x, gate), top_k, norm_topk_prob=True), fp8=fp8),
    }
    return {name: median_ms(call, iters) for name, call in calls.items()}


def print_table(
    tokens_list: list[int], shape: dict, scheme: Fp8Scheme | None, layers: int, ceilings: Ceilings, iters: int
) -> None:
    print(f"| {'tokens':>6} | {'component':<9} | {'ms':>8} | {'floor ms':>8} | {'of floor':>8} | {'x layers ms':>11} |")
    print(f"|{'-' * 8}|{'-' * 11}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 13}|")
    weight_bytes = 2 if scheme is None else 1
    for tokens in tokens_list:
        times = time_components(tokens, shape, scheme, iters)
        floors = floors_s(tokens, shape, weight_bytes, ceilings.bandwidth, ceilings.matmul_flops)
        for name in COMPONENTS:
            ms, floor = times[name], floors[name]
            floor_cells = ("-", "-") if floor is None else (f"{floor * 1e3:.4f}", f"{floor * 1e3 / ms:.0%}")
            print(
                f"| {tokens:>6} | {name:<9} | {ms:>8.4f} | {floor_cells[0]:>8} | {floor_cells[1]:>8} | "
                f"{ms * layers:>11.2f} |"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    moe_presets = [name for name, fields in PRESETS.items() if "num_experts" in fields]
    ap.add_argument("--preset", default="qwen3-30b-a3b-shape", choices=moe_presets, help="a MoE shape of rlserve.toy")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 1024, 4096])
    ap.add_argument(
        "--quantization",
        nargs="+",
        choices=["none", "fp8", "fbgemm_fp8"],
        default=["none"],
        help="the experts' formats to profile, one table each: bf16 (none) and FP8 (issue 31)",
    )
    ap.add_argument("--iters", type=int, default=20, help="timed graph replays per component (median)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device: the fused MoE kernels are Triton's, timed under CUDA graphs")
    preset = PRESETS[args.preset]
    shape = dict(
        hidden=preset["hidden_size"],
        inter=preset["moe_intermediate_size"],
        experts=preset["num_experts"],
        top_k=preset["num_experts_per_tok"],
    )
    layers = preset["num_hidden_layers"]
    ceilings = measure_ceilings(torch.device("cuda"))
    for method in args.quantization:
        scheme = None if method == "none" else Fp8Scheme(method)
        print(
            f"\nMoE layer profile: {args.preset} (H {shape['hidden']}, I {shape['inter']}, E {shape['experts']}, "
            f"k {shape['top_k']}, {layers} layers), experts in {'bf16' if scheme is None else method}; bandwidth "
            f"{ceilings.bandwidth / 1e12:.2f} TB/s, matmul {ceilings.matmul_flops / 1e12:.0f} TFLOP/s; "
            f"medians of {args.iters} graph replays"
        )
        print_table(args.tokens, shape, scheme, layers, ceilings, args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
