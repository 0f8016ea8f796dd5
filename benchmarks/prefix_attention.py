"""Grouped decode attention (grouped_prefix_attention, issue 34) against today's per-sequence decode, in one call.

GRPO groups share their prompt's KV blocks; the grouped path reads them once per group and step. Workloads:
- W2: 128 prompts x 512 tokens, n = 8, 256 out (benchmarks/workloads.py's);
- W2n32: the same prompts with n = 32;
- long: --long-prompts prompts of 4,096 tokens, n = 16, 256 out (a long shared system prompt or document).

One engine, started with grouped_prefix_attention on (so it holds the CUDA graphs of both paths); each workload runs
--repeats times alternating the grouped path and today's (the runner's grouping switched off: its steps then replay
today's graphs, exactly as an engine without the option), and the table gives medians and the speed-up. `grouped
steps` counts the steps that found a group, so a run where prefix caching did not share the prompt shows it.

    python benchmarks/prefix_attention.py --repeats 3 --out prefix_attention.json      # one H200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

import torch
from workloads import W1_ENGINE, run_engine, workloads

from rlserve import LLM, SamplingParams
from rlserve.engine.frontend.args import add_engine_arguments, engine_kwargs
from rlserve.engine.worker.step_inputs import StepInputs
from rlserve.toy import make_model_dir

WORKLOADS = ("W2", "W2n32", "long")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each path per workload; medians reported")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of W2's prompts (CPU smoke runs)")
    ap.add_argument("--long-prompts", type=int, default=32, help="prompts of the long workload")
    ap.add_argument("--long-prompt-len", type=int, default=4096)
    ap.add_argument("--long-output-len", type=int, default=256)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    # Room for the long workload's contexts and W1's batch (W2 holds 1,024 sequences too).
    add_engine_arguments(
        ap,
        defaults={
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            **W1_ENGINE,
            "max_model_len": 4608,
            "grouped_prefix_attention": True,
        },
    )
    args = ap.parse_args()
    unknown = sorted(set(args.workloads.split(",")) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"--workloads: {unknown} are not among {list(WORKLOADS)}")
    if not args.grouped_prefix_attention:
        raise SystemExit("--no-grouped-prefix-attention: the benchmark compares that path with today's; keep it on")
    if "dtype" not in vars(args):
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    return args


def workload(name: str, vocab: int, args: argparse.Namespace) -> tuple[list, list[SamplingParams]]:
    if name == "long":
        g = torch.Generator().manual_seed(1)
        prompts = [
            {"prompt_token_ids": torch.randint(0, vocab - 3, (args.long_prompt_len,), generator=g).tolist()}
            for _ in range(args.long_prompts)
        ]
        params = SamplingParams(n=16, temperature=1.0, max_tokens=args.long_output_len, ignore_eos=True)
        return prompts, [params] * len(prompts)
    prompts, params = workloads("W2", vocab, args.scale, seed=0)
    if name == "W2n32":
        params = [SamplingParams(n=32, temperature=1.0, max_tokens=p.max_tokens, ignore_eos=True) for p in params]
    return prompts, params


@contextmanager
def counting_grouped_steps():
    """Count the decode steps that find a group (StepInputs.prefix_groups returning some)."""
    counter = {"steps": 0}
    find = StepInputs.prefix_groups

    def counted(self, *a, **kw):
        groups = find(self, *a, **kw)
        counter["steps"] += groups is not None
        return groups

    StepInputs.prefix_groups = counted
    try:
        yield counter
    finally:
        StepInputs.prefix_groups = find


def timed_run(llm: LLM, prompts, params, grouped: bool, item_size: int) -> dict:
    runner, core = llm.engine_core.runner, llm.engine_core
    runner.prefix_item_size = item_size if grouped else None  # None: today's path, its graphs included
    llm.reset_prefix_cache()
    steps0 = core.num_steps
    with counting_grouped_steps() as counter:
        seconds, out_tokens = run_engine(llm, prompts, params)
    return dict(
        seconds=seconds,
        tok_s=out_tokens / seconds,
        steps=core.num_steps - steps0,
        grouped_steps=counter["steps"],
    )


def main() -> int:
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    model_dir = args.model_dir or str(make_model_dir(tempfile.mkdtemp(), preset=args.preset, dtype=dtype))
    os.environ["RLSERVE_ENABLE_MULTIPROCESSING"] = "0"  # the runner is switched between the paths in this process
    started = time.perf_counter()
    llm = LLM(model_dir, **engine_kwargs(args))
    print(f"engine start {time.perf_counter() - started:.1f}s", flush=True)
    runner = llm.engine_core.runner
    item_size, vocab = runner.prefix_item_size, runner.spec.vocab_size
    rows = []
    for name in args.workloads.split(","):
        prompts, params = workload(name, vocab, args)
        warm = max(1, len(prompts) // 8)
        run_engine(llm, prompts[:warm], params[:warm])  # warm-up: shapes, kernels, allocator
        runs: dict[str, list[dict]] = {"today": [], "grouped": []}
        for round_index in range(args.repeats):
            for path in ("today", "grouped"):  # alternating, so that a drift of the machine spreads over both
                run = timed_run(llm, prompts, params, path == "grouped", item_size)
                runs[path].append(run)
                print(json.dumps(dict(workload=name, path=path, round=round_index, **run)), flush=True)
        today = statistics.median(r["tok_s"] for r in runs["today"])
        grouped = statistics.median(r["tok_s"] for r in runs["grouped"])
        rows.append(
            dict(
                workload=name,
                today_tok_s=today,
                grouped_tok_s=grouped,
                speedup=grouped / today,
                grouped_steps=runs["grouped"][0]["grouped_steps"],
                steps=runs["grouped"][0]["steps"],
                runs=runs,
            )
        )
    print("| workload | today tok/s | grouped tok/s | speed-up | grouped steps |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['workload']} | {row['today_tok_s']:.0f} | {row['grouped_tok_s']:.0f} | {row['speedup']:.2f}x "
            f"| {row['grouped_steps']} of {row['steps']} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, device=args.device, preset=args.preset, repeats=args.repeats), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
