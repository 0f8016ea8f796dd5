"""W1 through the public `LLM.generate`, timed from the caller: with the engine core in its own process (the default)
or in this one (`RLSERVE_ENABLE_MULTIPROCESSING=0`), so the two can be compared in one run. throughput.py, which
reads the runner for its roofline, runs the core in process; this measures what a user of `LLM` gets.

    python benchmarks/offline_generate.py --device cuda --preset qwen3-0.6b-shape [--lora-rank 16]

--lora-rank R runs every request under one random rank-R adapter of every projection (enable_lora, one slot): the
cost of serving a LoRA policy against the base model's W1 in another run.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time

import torch
from workloads import W1_ENGINE, workloads

from rlserve import LLM, LoRARequest
from rlserve.engine.core_proc import multiprocessing_enabled
from rlserve.toy import make_lora_dir, make_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None, help="a model directory (default: build --preset)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of W1's 1,024 prompts")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs after one untimed warm-up")
    ap.add_argument("--lora-rank", type=int, default=0, help="every request under one adapter of this rank (0: none)")
    args = ap.parse_args()
    logging.basicConfig(format="%(message)s")
    logging.getLogger("rlserve.engine.core_proc").setLevel(logging.INFO)  # the core's start-up time, by phase
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model = args.model_dir or str(make_model_dir(tempfile.mkdtemp(), preset=args.preset, dtype=getattr(torch, dtype)))
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    t0 = time.perf_counter()
    lora_engine, lora_request = {}, None
    if args.lora_rank:
        adapter = make_lora_dir(tempfile.mkdtemp(), model, rank=args.lora_rank, std=0.01)
        lora_engine = dict(enable_lora=True, max_loras=1, max_lora_rank=args.lora_rank)
        lora_request = LoRARequest("policy", 1, str(adapter))
    llm = LLM(model, device=args.device, dtype=dtype, **W1_ENGINE, **lora_engine)
    mode = "own process" if multiprocessing_enabled() else "in process"
    if lora_request is not None:
        mode += f", every request under a rank-{args.lora_rank} adapter"
    print(f"engine start {time.perf_counter() - t0:.1f} s (core {mode})", flush=True)
    prompts, params = workloads("W1", vocab, args.scale, seed=0)
    rates = []
    for i in range(args.repeats + 1):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        dt = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        print(f"run {i} ({'untimed warm-up' if i == 0 else 'timed'}): {tokens / dt:,.0f} tok/s", flush=True)
        rates.append(tokens / dt)
    llm.shutdown()
    print(f"W1 LLM.generate, core {mode}: {statistics.median(rates[1:]):,.0f} output tok/s (median of {args.repeats})")


if __name__ == "__main__":
    main()
