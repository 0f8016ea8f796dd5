"""W1 through the public `LLM.generate`, timed from the caller: with the engine core in its own process (the default)
or in this one (`RLSERVE_ENABLE_MULTIPROCESSING=0`), so the two can be compared in one run. throughput.py, which
reads the runner for its roofline, runs the core in process; this measures what a user of `LLM` gets.

    python benchmarks/offline_generate.py --device cuda --preset qwen3-0.6b-shape [--lora-rank 16]
    python benchmarks/offline_generate.py --device cuda --engines tuned,defaults,batch-invariant --rounds 3

--engines: the engine set-ups to compare, in one run: `tuned` (W1's settings, benchmarks/workloads.py W1_ENGINE),
`defaults` (`LLM(model)` with nothing but the device and dtype: what a user gets), `batch-invariant` (tuned, in
batch-invariant mode). --rounds R starts every set-up's engine R times, the set-ups alternating round by round (so
that a drift of the machine spreads over all of them), each engine one untimed warm-up run and --repeats timed runs.
Reported per set-up: the median of its timed runs, their range and count, and its ratio to the first set-up's.

--lora-rank R runs every request under one random rank-R adapter of every projection (enable_lora, one slot): the
cost of serving a LoRA policy against the base model's W1 in another run.

--quantization takes a comma-separated list (none for the model dtype): every engine set-up runs once per method, as
its own set-up (`tuned/fp8`), alternating with the others: FP8 against bf16 on the Qwen3-8B shape, with random
weights and nothing read from disk (--load-format dummy writes only the config):

    python benchmarks/offline_generate.py --device cuda --preset qwen3-8b-shape --load-format dummy \
        --quantization none,fp8,fbgemm_fp8 --rounds 3 --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from workloads import W1_ENGINE, workloads

from rlserve import LLM, LoRARequest
from rlserve.engine.frontend.launcher import multiprocessing_enabled
from rlserve.log import configure_logging
from rlserve.toy import make_config_dir, make_lora_dir, make_model_dir

ENGINES = {"tuned": W1_ENGINE, "defaults": {}, "batch-invariant": {**W1_ENGINE, "batch_invariant": True}}


def time_engine(
    model: str, engine: dict, args, dtype: str, lora: tuple[dict, LoRARequest | None], prompts, params
) -> list[float]:
    """Start an engine, run W1 once untimed and --repeats times timed; its timed runs' output tok/s."""
    lora_engine, lora_request = lora
    t0 = time.perf_counter()
    llm = LLM(model, device=args.device, dtype=dtype, **engine, **lora_engine)
    mode = "own process" if multiprocessing_enabled() else "in process"
    if lora_request is not None:
        mode += f", every request under a rank-{args.lora_rank} adapter"
    print(f"engine start {time.perf_counter() - t0:.1f} s (core {mode}; {json.dumps(engine)})", flush=True)
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
    del llm
    gc.collect()  # one engine's weights and KV cache on the device at a time
    return rates[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None, help="a model directory (default: build --preset)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of W1's 1,024 prompts")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per engine after one untimed warm-up")
    ap.add_argument("--engines", default="tuned", help=f"comma list of {', '.join(ENGINES)} (see above)")
    ap.add_argument("--rounds", type=int, default=1, help="engines started per set-up, alternating (see above)")
    ap.add_argument("--lora-rank", type=int, default=0, help="every request under one adapter of this rank (0: none)")
    ap.add_argument("--quantization", default="none", help="comma-separated: none, fp8, fbgemm_fp8 (see above)")
    ap.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights, only a config written"
    )
    ap.add_argument("--out", default=None, help="write every set-up's timed runs as JSON here")
    args = ap.parse_args()
    names = args.engines.split(",")
    unknown = [name for name in names if name not in ENGINES]
    if unknown or len(set(names)) < len(names):
        raise SystemExit(f"--engines {args.engines}: each of {', '.join(ENGINES)} at most once (unknown: {unknown})")
    # rlserve's info logs, in the core's process too: its start-up by phase, the batch limits chosen for the device.
    configure_logging("info")
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.model_dir:
        model = args.model_dir
    elif args.load_format == "dummy":  # the config and tokenizer only: the engine makes up the weights
        model = str(make_config_dir(Path(tempfile.mkdtemp()) / args.preset, args.preset, getattr(torch, dtype)))
    else:
        model = str(make_model_dir(tempfile.mkdtemp(), preset=args.preset, dtype=getattr(torch, dtype)))
    lora: tuple[dict, LoRARequest | None] = ({}, None)
    if args.lora_rank:
        adapter = make_lora_dir(tempfile.mkdtemp(), model, rank=args.lora_rank, std=0.01)
        lora = dict(enable_lora=True, max_loras=1, max_lora_rank=args.lora_rank), LoRARequest("policy", 1, str(adapter))
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    prompts, params = workloads("W1", vocab, args.scale, seed=0)
    methods = args.quantization.split(",")
    setups = {
        name if methods == ["none"] else f"{name}/{method}": {
            **ENGINES[name],
            "quantization": None if method == "none" else method,
            "load_format": args.load_format,
        }
        for name in names
        for method in methods
    }
    runs: dict[str, list[float]] = {label: [] for label in setups}
    for round_index in range(args.rounds):
        for label, engine in setups.items():
            print(f"== round {round_index + 1}/{args.rounds}: {label}", flush=True)
            runs[label] += time_engine(model, engine, args, dtype, lora, prompts, params)
            if args.out:  # after every engine, so that a run cut off by a time limit leaves what it measured
                with open(args.out, "w") as f:
                    json.dump({n: dict(engine=setups[n], tok_s=runs[n]) for n in setups if runs[n]}, f, indent=1)
    mode = "own process" if multiprocessing_enabled() else "in process"
    labels = list(setups)
    first = statistics.median(runs[labels[0]])
    for label in labels:
        median = statistics.median(runs[label])
        print(
            f"W1 LLM.generate, {label}, core {mode}: {median:,.0f} output tok/s (median of {len(runs[label])}, "
            f"{min(runs[label]):,.0f}-{max(runs[label]):,.0f}; {median / first:.3f}x {labels[0]})"
        )


if __name__ == "__main__":
    main()
