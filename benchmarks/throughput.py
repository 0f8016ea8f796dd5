"""W1 (rollout), W2 (GRPO groups), W3 (mixed) throughput, with Hugging Face baselines and the roofline of the same run.

GPU:  python benchmarks/throughput.py --device cuda --preset qwen3-0.6b-shape
      (--tensor-parallel-size 2: the model split over two GPUs; BENCHMARKS.md has the 8B-shape command)
CPU:  python benchmarks/throughput.py --device cpu --preset small --scale 0.03 --hf dynamic

The roofline (benchmarks/roofline.py, which states the model) is computed for the batch schedule the engine actually
ran, with bandwidth and matrix rate measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import torch
from roofline import instrument, measure_ceilings, model_cost, roofline_seconds, timed
from workloads import W1_ENGINE, run_engine, workloads

from rlserve import LLM, SamplingParams
from rlserve.engine.args import add_engine_arguments, engine_kwargs
from rlserve.toy import make_model_dir


def profile_host(llm: LLM, prompts, params) -> None:
    """Where the wall time of a run goes, by Python function; time spent waiting on the GPU shows up in the
    synchronising call (the event wait in ModelRunner.resolve)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run_engine(llm, prompts, params)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


def run_hf(model_dir: str, device: torch.device, dtype: torch.dtype, mode: str, batch: int, in_len: int, out_len: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return hf_generate_tok_s(model, device, mode, batch, in_len, out_len)


def hf_generate_tok_s(model, device: torch.device, mode: str, batch: int, in_len: int, out_len: int) -> float:
    """Output tokens/s of `model.generate` sampling out_len tokens for batch random prompts (after a warm-up run);
    frees the model."""
    ids = torch.randint(0, model.config.vocab_size - 3, (batch, in_len), device=device)
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, max_new_tokens=out_len, min_new_tokens=out_len)
    if mode == "static":
        # generate() compiles the forward itself for a static cache (its compile_config); compiling it again on top
        # breaks its CUDA graphs ("accessing tensor output of CUDAGraphs that has been overwritten").
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        model.generate(ids, **kwargs)  # warm-up (and compilation)
        seconds = timed(lambda: model.generate(ids, **kwargs), device)
    model = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return batch * out_len / seconds


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--workloads", default="W1,W2,W3", help="comma list; NAME/sync runs NAME without async scheduling")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each workload's prompts (CPU runs)")
    ap.add_argument("--hf", default="dynamic", help="comma list of HF baselines: dynamic, static, none")
    ap.add_argument("--hf-batch", type=int, default=256)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--profile", action="store_true", help="cProfile the host side of the first workload")
    ap.add_argument(
        "--warmup",
        choices=("full", "short"),
        default="full",
        help="full: run each workload once untimed first; short: a few short requests (first-run costs included)",
    )
    # --dtype not given: bfloat16 on cuda, float32 on cpu (the toy model is made in it too).
    add_engine_arguments(
        ap,
        defaults={"device": "cuda" if torch.cuda.is_available() else "cpu", **W1_ENGINE},
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    if "dtype" not in vars(args):
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    dtype_name = args.dtype
    dtype = getattr(torch, dtype_name)

    model_dir = args.model_dir or str(make_model_dir(tempfile.mkdtemp(), preset=args.preset, dtype=dtype))
    ceilings = measure_ceilings(device)
    print(
        f"ceilings: bandwidth {ceilings.bandwidth / 1e12:.3f} TB/s, matmul {ceilings.matmul_flops / 1e12:.1f} TFLOP/s",
        flush=True,
    )
    # Hugging Face first, while the GPU is empty; the engine then takes the memory it sizes its cache from.
    hf_rows = []
    for mode in [m for m in args.hf.split(",") if m and m != "none"]:
        in_len = max(4, int(256 * args.scale**0.5))
        try:
            tok_s = run_hf(
                model_dir, device, dtype, mode, min(args.hf_batch, max(1, int(1024 * args.scale))), in_len, in_len
            )
        except Exception as e:  # a baseline that breaks must not cost the engine's own figures
            print(f"hf-{mode} failed: {e!r}"[:400], flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        hf_rows.append(dict(baseline=f"hf-{mode}", tok_s=tok_s))
        print(json.dumps(hf_rows[-1]), flush=True)
    # The core in this process: the benchmark logs every step from the runner, reads the model's size and the
    # prefix-cache counters off the core, and switches async scheduling per workload on the core's config.
    os.environ["RLSERVE_ENABLE_MULTIPROCESSING"] = "0"
    t0 = time.perf_counter()
    llm = LLM(model_dir, **engine_kwargs(args))
    startup = time.perf_counter() - t0
    runner = llm.engine_core.runner
    spec = runner.spec
    cost = model_cost(runner.model, spec, dtype, num_kv_heads=runner.num_kv_heads, tp_size=runner.tp.size)
    print(
        f"engine start {startup:.1f}s; KV cache: {runner.num_blocks} blocks x {runner.bytes_per_block} B/block "
        f"= {runner.num_blocks * runner.bytes_per_block / 1e9:.1f} GB; "
        f"fits {runner.num_blocks * runner.block_size // 512} sequences of 512 tokens; "
        f"weights {cost.weight_bytes / 1e9:.2f} GB",
        flush=True,
    )
    log = instrument(llm)
    rows = []
    core = llm.engine_core
    for name in args.workloads.split(","):
        # "W1/sync": the same workload without async scheduling, to show what overlapping host and device buys.
        base, _, variant = name.partition("/")
        core.config = dataclasses.replace(core.config, async_scheduling=variant != "sync")
        prompts, sps = workloads(base, spec.vocab_size, args.scale, seed=0)
        if args.warmup == "full":
            # The first run of a workload's shapes pays one-time costs (Triton compiling kernel variants, the
            # allocators growing): on the H200 W1's first run took 8.0 s, the next ones 4.8 s. Time the steady state.
            run_engine(llm, prompts, sps)
        else:
            warm = [dict(prompt_token_ids=p["prompt_token_ids"][:16]) for p in prompts[:8]]
            llm.generate(warm, SamplingParams(max_tokens=4), use_tqdm=False)
        llm.reset_prefix_cache()  # the warm-up's prompts are prefixes of the workload's: no free hits
        log.steps.clear()
        hits0 = llm.engine_core.kv_cache.prefix_hits, llm.engine_core.kv_cache.prefix_queries
        if args.profile and not rows:
            profile_host(llm, prompts, sps)
            llm.reset_prefix_cache()  # the profiled run cached these very prompts
            log.steps.clear()
        dt, out_tokens = run_engine(llm, prompts, sps)
        roof = roofline_seconds(log.steps, cost, ceilings)
        hits = llm.engine_core.kv_cache.prefix_hits - hits0[0]
        queries = llm.engine_core.kv_cache.prefix_queries - hits0[1]
        row = dict(
            workload=name,
            seconds=dt,
            output_tokens=out_tokens,
            tok_s=out_tokens / dt,
            roofline_s=roof,
            roofline_tok_s=out_tokens / roof,
            fraction=roof / dt,
            steps=len(log.steps),
            max_batch=max(step.batch for step in log.steps),
            prefix_hit_rate=hits / max(queries, 1),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n{'workload':<8} {'out tok/s':>11} {'roofline tok/s':>15} {'of roofline':>12} {'steps':>6} {'hit rate':>9}"
    )
    for r in rows:
        print(
            f"{r['workload']:<8} {r['tok_s']:>11,.0f} {r['roofline_tok_s']:>15,.0f} {r['fraction']:>11.1%} "
            f"{r['steps']:>6} {r['prefix_hit_rate']:>8.1%}"
        )
    for h in hf_rows:
        ratio = rows[0]["tok_s"] / h["tok_s"] if rows else float("nan")
        print(
            f"{h['baseline']:<8} {h['tok_s']:>11,.0f}   (rlserve {rows[0]['workload'] if rows else ''} is {ratio:.1f}x)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, hf=hf_rows, **dataclasses.asdict(ceilings), device=str(device)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
