"""W6 parity: the engine's logprobs of its own sampled rollouts against a trainer forward on the same tokens.

GPU:  python benchmarks/parity.py --device cuda --out parity.json
CPU:  python benchmarks/parity.py --device cpu --preset small --num-prompts 8 --prompt-len 32 --max-tokens 32

The model is `qwen3-0.6b-shape` (BENCHMARKS.md) in bf16 with random weights from seed 0, its logits scaled x8 through
the final RMSNorm weight (the same logits as an LM head scaled x8) so that next-token distributions are peaked like a
trained model's; the script measures and prints how peaked. 64 prompts of 256 random tokens, 256 sampled tokens each
(temperature 1.0, EOS ignored, seeded per request), engine logprobs in `processed_logprobs` mode. The trainer is
Hugging Face transformers in fp32, one forward per sequence. Modes (W6):
  bf16            the bf16 engine as configured by default (bf16 LM head)
  fp32 LM head    the bf16 engine with lm_head_dtype="float32"
  deterministic   the bf16 engine in batch-invariant mode against rlserve's batch-invariant trainer-side forward in
                  bf16 (`--scenarios` batch_invariant; its reference is that forward, not the HF trainer)
  fp8             the bf16 engine with FP8 projections (`--scenarios fp8`, `--fp8-method`), as loaded and after ten
                  weight updates of bf16 weights it quantizes, the last back to the trainer's weights (rows equal: no
                  drift from requantization)
`--scenarios` takes any of the parity scenarios (raw_vs_processed, prefix_cache, batch_invariant, fp8) for the same
model and device.
FP8 vs bf16 (W6 FP8 row): python benchmarks/parity.py --device cuda --scenarios lm_head,fp8 --out parity-fp8.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from rlserve.dtypes import TORCH_DTYPES
from rlserve.rl.parity import HEAD_SCALES, SCENARIOS, make_peaked_model_dir, peakedness, random_prompts, run_parity
from rlserve.rl.parity_report import format_table, row_setups
from rlserve.rl.trainer_logprobs import ParityStats

MODE_NAMES = {
    "lm_head/bf16": "bf16",
    "lm_head/fp16": "fp16",
    "lm_head/fp32": "fp32 LM head",
    "batch_invariant": "deterministic",
    "fp8/load": "fp8",
    "fp8/10_updates": "fp8 after 10 updates",
}


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--head-scale", type=float, default=None, help="logit scale (default: the preset's in HEAD_SCALES)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="engine dtype")
    ap.add_argument("--trainer", default="hf", choices=["hf", "rlserve"])
    ap.add_argument("--trainer-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--scenarios", default="lm_head,batch_invariant", help=f"comma-separated subset of {','.join(SCENARIOS)}"
    )
    ap.add_argument("--fp8-method", default="fp8", choices=["fp8", "fbgemm_fp8"], help="the fp8 scenario's layout")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    head_scale = HEAD_SCALES[args.preset] if args.head_scale is None else args.head_scale
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{device_name}  torch {torch.__version__}  commit {_commit()}", flush=True)
    t0 = time.perf_counter()
    model_dir = make_peaked_model_dir(
        Path(tempfile.mkdtemp(prefix="rlserve-w6-")) / args.preset, args.preset, head_scale, TORCH_DTYPES[args.dtype]
    )
    prompts = random_prompts(model_dir, args.num_prompts, args.prompt_len, seed=0)
    # Eight prompts are enough to characterise the distribution; the full batch would only cost time.
    peak = peakedness(model_dir, prompts[:8], args.device)
    print(
        f"model: {args.preset} {args.dtype}, random weights (seed 0), logits x{head_scale:g} via the final RMSNorm "
        f"weight; next-token entropy {peak.entropy:.2f} nats (flat: {peak.uniform_entropy:.2f}), top-1 probability "
        f"{peak.top1:.2f}",
        flush=True,
    )
    print(
        f"{args.num_prompts} prompts x {args.prompt_len} random tokens -> {args.max_tokens} sampled tokens, "
        f"temperature {args.temperature}; trainer {args.trainer} {args.trainer_dtype}",
        flush=True,
    )
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    results = run_parity(
        model_dir,
        prompts,
        scenarios=scenarios,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        device=args.device,
        dtype=args.dtype,
        trainer=args.trainer,
        trainer_dtype=args.trainer_dtype,
        fp8_method=args.fp8_method,
    )
    rows: dict[str, ParityStats | None] = {MODE_NAMES.get(name, name): s for name, s in results.items()}
    print(format_table(results, row_setups(args.dtype, args.trainer, args.trainer_dtype, args.temperature)), flush=True)
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    if args.out:
        record = dict(
            workload="W6",
            date=datetime.date.today().isoformat(),
            commit=_commit(),
            device=device_name,
            torch=torch.__version__,
            command=" ".join(sys.argv),
            config=vars(args) | {"head_scale": head_scale},
            peakedness=asdict(peak),
            results={name: None if s is None else asdict(s) for name, s in rows.items()},
        )
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
