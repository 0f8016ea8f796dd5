"""Where batch-invariant mode loses to the default mode on W1, one CUDA GPU (written for an H200). From the repo root:

    python benchmarks/batch_invariant_profile.py           # a W1 decode step's kernels, default vs batch-invariant
    python benchmarks/batch_invariant_profile.py --sweep   # also the matmul tiles at each weight shape, best first
    python benchmarks/batch_invariant_profile.py --w1      # also W1 end to end in both modes, in this one run

A W1 decode step at batch 1,024 (`--batch`), each sequence's context uniform in 257..512 (W1's 256 prompt and 256
output tokens), on the `qwen3-0.6b-shape` model (`--preset`), bf16. Each component is timed alone with CUDA events
(`triton.testing.do_bench` medians, L2 flushed), in both modes:
- matmuls: every projection of every layer and the LM head, cuBLAS (`F.linear`) against the batch-invariant Triton
  matmul with the tile `tile_for` gives each weight (rlserve.model.kernels.batch_invariant_matmul);
- attention, per layer x layers: the split-KV decode kernel (default) against the varlen kernel with the
  batch-invariant tile (what batch-invariant decode runs), and a W1 prefill step (64 x 256 tokens) in both modes;
  both also with the long-prompt tile batch-invariant mode used before 2026-12-01;
- sampler: temperature 1.0 sampling with the chosen token's logprob, the fused kernel (default) against
  batch-invariant mode's (the fused kernel's token, the PyTorch passes' logprob), and the PyTorch passes alone (what
  batch-invariant mode ran before 2026-12-07).
The fused norm/rotary/activation kernels are the same in both modes and are not timed. `--w1` runs W1 through the
public `LLM` API (the core in its own process), default mode first, then batch-invariant, each with one untimed run
first, and prints both with their ratio (issue 21's target: >= 0.87x).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from attention_kernels import kernels, make_batch
from transformers import AutoConfig
from workloads import W1_ENGINE, run_engine, workloads

from rlserve.model.models.llama import spec_from_hf_config
from rlserve.model.sampler import Sampler, SamplingMetadata
from rlserve.toy import PRESETS

DTYPE = torch.bfloat16
DEVICE = "cuda"
# Tiles the sweep tries at each weight shape: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Triton and the kernels are
# imported where used, so that the script answers --help where Triton is missing (CPU CI).
SWEEP_TILES = (
    (64, 64, 64, 4, 3),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 256, 64, 8, 3),
    (128, 64, 64, 4, 3),
    (128, 128, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (64, 64, 128, 4, 3),
)


def bench_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def weight_shapes(spec) -> list[tuple[str, int, int, int]]:
    """(name, N, K, how many per decode step) of every matmul in a forward."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    layers = spec.num_layers
    return [
        ("qkv_proj", q + 2 * kv, spec.hidden_size, layers),
        ("o_proj", spec.hidden_size, q, layers),
        ("gate_up_proj", 2 * spec.intermediate_size, spec.hidden_size, layers),
        ("down_proj", spec.hidden_size, spec.intermediate_size, layers),
        ("lm_head", spec.vocab_size, spec.hidden_size, 1),
    ]


def profile_matmuls(spec, batch: int, sweep: bool) -> tuple[float, float]:
    from rlserve.model.kernels.batch_invariant_matmul import Tile, matmul, tile_for

    print(f"\nmatmuls at M = {batch} (ms per call; x count = per decode step)")
    print(f"{'weight':<13} {'N':>7} {'K':>5} {'count':>5} {'cuBLAS':>8} {'invariant':>9} {'ratio':>6}  tile")
    default_total = invariant_total = 0.0
    for name, n, k, count in weight_shapes(spec):
        x = torch.randn(batch, k, device=DEVICE, dtype=DTYPE)
        w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k**0.5
        cublas = bench_ms(lambda: F.linear(x, w))  # noqa: B023 (timed before the loop moves on)
        tile = tile_for(n, k, w.element_size())
        invariant = bench_ms(lambda: matmul(x, w, None, tile))  # noqa: B023
        default_total += count * cublas
        invariant_total += count * invariant
        print(
            f"{name:<13} {n:>7} {k:>5} {count:>5} {cublas:>8.4f} {invariant:>9.4f} {invariant / cublas:>6.2f}  {tile}"
        )
        if sweep:
            tiles = [Tile(*t) for t in SWEEP_TILES]
            timed = sorted(((bench_ms(lambda t=t: matmul(x, w, None, t)), t) for t in tiles), key=lambda p: p[0])  # noqa: B023
            for ms, t in timed[:4]:
                print(f"{'':<13} sweep {ms:>9.4f} ms ({ms / cublas:.2f}x cuBLAS)  {t}")
    return default_total, invariant_total


def profile_attention(spec, batch: int) -> tuple[float, float]:
    """Decode (the step the table adds up) and a W1 prefill step (64 prompts of 256 tokens), each in the default
    mode, in batch-invariant mode, and with the long-prompt tile batch-invariant mode used before 2026-12-01."""
    gen = torch.Generator().manual_seed(0)
    scale, layers = spec.head_dim**-0.5, spec.num_layers
    heads = dict(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    decode = make_batch([(1, int(n)) for n in torch.randint(257, 513, (batch,), generator=gen)], **heads)
    prefill = make_batch([(256, 256)] * 64, **heads)
    times = {}
    for step, b in (("decode", decode), ("prefill", prefill)):
        default, invariant, former = times[step] = attention_times(b, scale, decode=step == "decode")
        print(
            f"\nattention, {step} ({len(b.q_lens)} sequences; ms per layer, x {layers} per step): default "
            f"{default:.4f}, batch-invariant {invariant:.4f} ({invariant / default:.2f}x), former batch-invariant "
            f"tile {former:.4f} ({former / default:.2f}x)"
        )
    return layers * times["decode"][0], layers * times["decode"][1]


def attention_times(b, scale: float, decode: bool) -> tuple[float, float, float]:
    """(default, batch-invariant, former batch-invariant tile) ms of one layer's attention over batch b."""
    q, args = b.q.contiguous(), (b.k_cache, b.v_cache, b.cu_seqlens_q, b.seq_lens, b.block_tables, scale)
    out = torch.empty_like(q)
    paged_attention, paged_decode_attention = kernels().paged_attention, kernels().paged_decode_attention
    if decode:
        max_seq_len = max(b.ctx_lens)
        default = bench_ms(lambda: paged_decode_attention(q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, scale,
                                                          max_seq_len=max_seq_len))  # fmt: skip
    else:
        default = bench_ms(lambda: paged_attention(q, *args, b.max_seqlen_q))
    invariant = bench_ms(lambda: paged_attention(q, *args, b.max_seqlen_q, batch_invariant=True))
    former = bench_ms(lambda: kernels()._launch_paged_attention(q, *args, out, 64, 64, 4, 2))
    return default, invariant, former


def profile_sampler(spec, batch: int) -> tuple[float, float]:
    logits = torch.randn(batch, spec.vocab_size, device="cuda", dtype=DTYPE)
    meta = SamplingMetadata(
        temperature=torch.ones(batch, device="cuda"),
        greedy=torch.zeros(batch, dtype=torch.bool, device="cuda"),
        top_k=None, top_p=None, min_p=None, generators=[None] * batch, min_tokens_mask=[], max_num_logprobs=0,
        all_greedy=False, all_random=True,
    )  # fmt: skip
    fused = bench_ms(lambda: Sampler("processed_logprobs")(logits, meta))
    invariant = bench_ms(lambda: Sampler("processed_logprobs", batch_invariant=True)(logits, meta))
    torch_path = bench_ms(lambda: Sampler("processed_logprobs")._sample_torch(logits, meta))
    print(f"\nsampler at batch {batch} x vocab {spec.vocab_size}, T=1 with the token's logprob (ms per step)")
    print(
        f"fused kernel (default) {fused:.4f}   batch-invariant {invariant:.4f} ({invariant / fused:.2f}x)   "
        f"PyTorch passes alone {torch_path:.4f} ({torch_path / fused:.2f}x)"
    )
    return fused, invariant


def run_w1(preset: str, vocab_size: int) -> None:
    from rlserve import LLM
    from rlserve.toy import make_model_dir

    model_dir = str(make_model_dir(tempfile.mkdtemp(), preset=preset, dtype=DTYPE))
    results = {}
    for mode in ("default", "batch-invariant"):
        llm = LLM(model_dir, dtype="bfloat16", device="cuda", batch_invariant=mode != "default", **W1_ENGINE)
        prompts, params = workloads("W1", vocab_size, 1.0, seed=0)
        run_engine(llm, prompts, params)  # untimed: first-run compiles and allocator growth
        llm.reset_prefix_cache()
        seconds, tokens = run_engine(llm, prompts, params)
        results[mode] = tokens / seconds
        print(f"W1 {mode}: {tokens / seconds:,.0f} output tok/s ({seconds:.2f} s)", flush=True)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        time.sleep(2)  # the core process's memory goes back to the driver
    print(f"W1 batch-invariant / default: {results['batch-invariant'] / results['default']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--sweep", action="store_true", help="time the SWEEP_TILES tiles at each weight shape")
    ap.add_argument("--w1", action="store_true", help="also W1 end to end in both modes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("batch_invariant_profile.py times CUDA kernels: no CUDA device here")
    config = AutoConfig.for_model("qwen3", architectures=["Qwen3ForCausalLM"], **PRESETS[args.preset])
    spec = spec_from_hf_config(config)
    rows = [
        ("matmuls", *profile_matmuls(spec, args.batch, args.sweep)),
        ("attention", *profile_attention(spec, args.batch)),
        ("sampler", *profile_sampler(spec, args.batch)),
    ]
    print(f"\nW1 decode step at batch {args.batch}: ms per step by component")
    print(f"{'component':<10} {'default':>8} {'invariant':>9} {'extra':>7}")
    for name, default, invariant in rows:
        print(f"{name:<10} {default:>8.3f} {invariant:>9.3f} {invariant - default:>+7.3f}")
    default, invariant = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"{'total':<10} {default:>8.3f} {invariant:>9.3f} {invariant - default:>+7.3f}  ({default / invariant:.2f}x)")
    if args.w1:
        run_w1(args.preset, spec.vocab_size)


if __name__ == "__main__":
    main()
