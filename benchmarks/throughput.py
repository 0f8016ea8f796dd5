"""W1 (rollout), W2 (GRPO groups), W3 (mixed) throughput, with Hugging Face baselines and the roofline of the same run.

GPU:  python benchmarks/throughput.py --device cuda --preset qwen3-0.6b-shape
      (--tensor-parallel-size 2: the model split over two GPUs; BENCHMARKS.md has the 8B-shape command)
CPU:  python benchmarks/throughput.py --device cpu --preset small --scale 0.03 --hf dynamic

The roofline (benchmarks/roofline.py, which states the model) is computed for the batch schedule the engine actually
ran, with bandwidth and matrix rate measured in the same run. The timed runs record nothing: the schedule comes from
one more, untimed run of the same requests (`roofline.schedule_of`; its step count is checked against the timed runs'
count on the core). A workload named NAME/inline records its schedule inside its timed runs instead, as this script
did before 2026-12-02, which shows what recording inside the step costs: `--workloads W1,W1/inline --repeats 3`.
NAME/sync runs NAME without async scheduling. `--repeats R` times every workload R times, the workloads alternating
round by round, and reports the median and the range.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from roofline import (
    Ceilings,
    ModelCost,
    measure_ceilings,
    model_cost,
    recording,
    roofline_seconds,
    schedule_of,
    timed,
)
from workloads import W1_ENGINE, run_engine, w1_shape, workloads

from rlserve import LLM, SamplingParams
from rlserve.engine.frontend.args import add_engine_arguments, engine_kwargs
from rlserve.toy import make_model_dir

VARIANTS = {"sync": "without async scheduling", "inline": "its schedule recorded inside the timed runs"}


@dataclass(frozen=True)
class Workload:
    name: str  # as given: "W1", "W1/sync", "W1/inline", "W1/sync/inline"
    base: str  # W1, W2 or W3
    async_scheduling: bool
    record_inline: bool

    @classmethod
    def parse(cls, name: str) -> Workload:
        base, *variants = name.split("/")
        unknown = [v for v in variants if v not in VARIANTS]
        if base not in ("W1", "W2", "W3") or unknown:
            raise SystemExit(f"--workloads: {name!r} is not W1, W2 or W3 with /{' or /'.join(VARIANTS)}")
        return cls(name, base, "sync" not in variants, "inline" in variants)


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


def warm_up(llm: LLM, prompts, params, mode: str) -> None:
    if mode == "full":
        # The first run of a workload's shapes pays one-time costs (Triton compiling kernel variants, the
        # allocators growing): on the H200 W1's first run took 8.0 s, the next ones 4.8 s. Time the steady state.
        run_engine(llm, prompts, params)
    else:
        warm = [dict(prompt_token_ids=p["prompt_token_ids"][:16]) for p in prompts[:8]]
        llm.generate(warm, SamplingParams(max_tokens=4), use_tqdm=False)


def summary_row(workload: Workload, runs: list[dict], steps: list, roofline_s: float) -> dict:
    """A workload's timed runs (median and range) against the roofline of its schedule."""
    seconds = statistics.median(r["seconds"] for r in runs)
    out_tokens = runs[0]["output_tokens"]
    timed_steps = {r["steps"] for r in runs}
    if timed_steps != {len(steps)}:  # the roofline would be another schedule's
        print(f"{workload.name}: the timed runs took {sorted(timed_steps)} steps, the roofline's schedule {len(steps)}")
    return dict(
        workload=workload.name,
        schedule="recorded inline" if workload.record_inline else "recorded in an untimed run after",
        runs=len(runs),
        run_tok_s=[r["tok_s"] for r in runs],
        seconds=seconds,
        output_tokens=out_tokens,
        tok_s=out_tokens / seconds,
        tok_s_min=min(r["tok_s"] for r in runs),
        tok_s_max=max(r["tok_s"] for r in runs),
        roofline_s=roofline_s,
        roofline_tok_s=out_tokens / roofline_s,
        fraction=roofline_s / seconds,
        steps=len(steps),
        timed_steps=sorted(timed_steps),
        max_batch=max(step.batch for step in steps),
        prefix_hit_rate=statistics.median(r["prefix_hit_rate"] for r in runs),
    )


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


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument(
        "--workloads",
        default="W1,W2,W3",
        help="comma list; NAME/sync: without async scheduling; NAME/inline: its schedule recorded inside the timed "
        "runs (what recording costs)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of each workload, alternating; median reported")
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
        help="full: run each workload once untimed first (its variants share that run); "
        "short: a few short requests (first-run costs included)",
    )
    # --dtype not given: bfloat16 on cuda, float32 on cpu (the toy model is made in it too).
    add_engine_arguments(
        ap,
        defaults={"device": "cuda" if torch.cuda.is_available() else "cpu", **W1_ENGINE},
    )
    args = ap.parse_args()
    if "dtype" not in vars(args):
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    return args


def hf_baselines(args: argparse.Namespace, model_dir: str, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The Hugging Face baselines asked for, W1-shaped; one that fails is reported and left out."""
    rows = []
    shape = w1_shape(args.scale)
    for mode in [m for m in args.hf.split(",") if m and m != "none"]:
        batch = min(args.hf_batch, shape.num_prompts)
        try:
            tok_s = run_hf(model_dir, device, dtype, mode, batch, shape.prompt_len, shape.output_len)
        except Exception as e:  # a baseline that breaks must not cost the engine's own figures
            print(f"hf-{mode} failed: {e!r}"[:400], flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        rows.append(dict(baseline=f"hf-{mode}", tok_s=tok_s))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def start_engine(model_dir: str, args: argparse.Namespace, dtype: torch.dtype) -> tuple[LLM, ModelCost]:
    """The engine with its core in this process: the benchmark records the schedule from the runner, reads the
    model's size and the prefix-cache counters off the core, and switches async scheduling per workload on the core's
    config."""
    os.environ["RLSERVE_ENABLE_MULTIPROCESSING"] = "0"
    t0 = time.perf_counter()
    llm = LLM(model_dir, **engine_kwargs(args))
    startup = time.perf_counter() - t0
    runner = llm.engine_core.runner
    cost = model_cost(runner.model, runner.spec, dtype, num_kv_heads=runner.num_kv_heads, tp_size=runner.tp.size)
    print(
        f"engine start {startup:.1f}s; KV cache: {runner.num_blocks} blocks x {runner.bytes_per_block} B/block "
        f"= {runner.num_blocks * runner.bytes_per_block / 1e9:.1f} GB; "
        f"fits {runner.num_blocks * runner.block_size // 512} sequences of 512 tokens; "
        f"weights {cost.weight_bytes / 1e9:.2f} GB",
        flush=True,
    )
    return llm, cost


def parse_workloads(names: str) -> list[Workload]:
    chosen = [Workload.parse(name) for name in names.split(",")]
    if len({w.name for w in chosen}) < len(chosen):
        raise SystemExit(f"--workloads {names}: a workload named twice (--repeats times each again)")
    return chosen


def timed_run(llm: LLM, workload: Workload, prompts, params) -> tuple[dict, list | None]:
    """One timed run of a workload: its figures, and its schedule if the workload records it inline."""
    core = llm.engine_core
    llm.reset_prefix_cache()  # the warm-up's prompts are prefixes of the workload's: no free hits
    hits0, queries0, steps0 = core.kv_cache.prefix_hits, core.kv_cache.prefix_queries, core.num_steps
    with recording(llm) if workload.record_inline else nullcontext() as log:
        dt, out_tokens = run_engine(llm, prompts, params)
    run = dict(
        seconds=dt,
        output_tokens=out_tokens,
        tok_s=out_tokens / dt,
        steps=core.num_steps - steps0,
        prefix_hit_rate=(core.kv_cache.prefix_hits - hits0) / max(core.kv_cache.prefix_queries - queries0, 1),
    )
    return run, None if log is None else log.steps


def time_workloads(
    llm: LLM, chosen: list[Workload], args: argparse.Namespace
) -> tuple[dict[str, list[dict]], dict[str, list]]:
    """Every workload's --repeats timed runs, round by round, and the schedules the inline ones recorded."""
    core, vocab = llm.engine_core, llm.engine_core.runner.spec.vocab_size
    runs: dict[str, list[dict]] = {workload.name: [] for workload in chosen}
    inline_steps = {}
    warmed: set[str] = set()
    for round_index in range(args.repeats):
        for workload in chosen:  # alternating, so that a drift of the machine spreads over every workload
            core.config = dataclasses.replace(core.config, async_scheduling=workload.async_scheduling)
            prompts, sps = workloads(workload.base, vocab, args.scale, seed=0)
            if workload.base not in warmed:  # a variant runs the same shapes: one warm-up per base workload
                warmed.add(workload.base)
                warm_up(llm, prompts, sps, args.warmup)
                if args.profile and workload is chosen[0]:
                    profile_host(llm, prompts, sps)
            run, steps = timed_run(llm, workload, prompts, sps)
            if steps is not None:
                inline_steps[workload.name] = steps
            runs[workload.name].append(run)
            print(json.dumps(dict(workload=workload.name, round=round_index, **run)), flush=True)
    return runs, inline_steps


def summarize(
    llm: LLM,
    chosen: list[Workload],
    runs: dict[str, list[dict]],
    inline_steps: dict[str, list],
    cost: ModelCost,
    ceilings: Ceilings,
    scale: float,
) -> list[dict]:
    """A row per workload, against the roofline of its schedule (recorded inline or in an untimed run now)."""
    core, vocab = llm.engine_core, llm.engine_core.runner.spec.vocab_size
    rows = []
    for workload in chosen:
        core.config = dataclasses.replace(core.config, async_scheduling=workload.async_scheduling)
        steps = inline_steps.get(workload.name)
        if steps is None:
            steps, _ = schedule_of(llm, *workloads(workload.base, vocab, scale, seed=0))
        rows.append(summary_row(workload, runs[workload.name], steps, roofline_seconds(steps, cost, ceilings)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def print_table(rows: list[dict], hf_rows: list[dict]) -> None:
    print(
        f"\n{'workload':<16} {'out tok/s':>11} {'min-max':>15} {'runs':>4} {'roofline tok/s':>15} {'of roofline':>12} "
        f"{'steps':>6} {'hit rate':>9}"
    )
    for r in rows:
        print(
            f"{r['workload']:<16} {r['tok_s']:>11,.0f} {r['tok_s_min']:>7,.0f}-{r['tok_s_max']:<7,.0f} {r['runs']:>4} "
            f"{r['roofline_tok_s']:>15,.0f} {r['fraction']:>11.1%} {r['steps']:>6} {r['prefix_hit_rate']:>8.1%}"
        )
    for h in hf_rows:
        ratio = rows[0]["tok_s"] / h["tok_s"] if rows else float("nan")
        print(
            f"{h['baseline']:<8} {h['tok_s']:>11,.0f}   (rlserve {rows[0]['workload'] if rows else ''} is {ratio:.1f}x)"
        )


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model_dir = args.model_dir or str(make_model_dir(tempfile.mkdtemp(), preset=args.preset, dtype=dtype))
    ceilings = measure_ceilings(device)
    print(
        f"ceilings: bandwidth {ceilings.bandwidth / 1e12:.3f} TB/s, matmul {ceilings.matmul_flops / 1e12:.1f} TFLOP/s",
        flush=True,
    )
    # Hugging Face first, while the GPU is empty; the engine then takes the memory it sizes its cache from.
    hf_rows = hf_baselines(args, model_dir, device, dtype)
    llm, cost = start_engine(model_dir, args, dtype)
    chosen = parse_workloads(args.workloads)
    runs, inline_steps = time_workloads(llm, chosen, args)
    rows = summarize(llm, chosen, runs, inline_steps, cost, ceilings, args.scale)
    print_table(rows, hf_rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, hf=hf_rows, **dataclasses.asdict(ceilings), device=str(device)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
