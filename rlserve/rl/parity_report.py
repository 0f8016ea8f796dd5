"""`rlserve parity`: runs rlserve.rl.parity's scenarios and prints their rows as a table, each with what the dtypes of
its two sides let it be expected to show, and whether it does (the exit status says whether every row did)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rlserve.dtypes import TORCH_DTYPES
from rlserve.hub import resolve_model
from rlserve.model.fp8 import FP8_METHODS
from rlserve.rl.parity import (
    DEFAULT_SCENARIOS,
    FP8_PRESET,
    FP8_UPDATES,
    HEAD_SCALES,
    SCENARIOS,
    SHORT_DTYPE_NAMES,
    lm_head_scenario_dtype,
    make_peaked_model_dir,
    peakedness,
    random_prompts,
    run_parity,
)
from rlserve.rl.trainer_logprobs import ParityStats

COLUMNS = (
    "scenario", "engine", "reference", "mean|Δ|", "max|Δ|", "k3 KL", "mean ratio", "outside [0.9,1.1]", "ESS",
    "tokens", "expected", "as expected",
)  # fmt: skip
# max|Δ| below which an engine and a reference in fp32 agree to float noise, and above which a row shows a real gap.
FP32_NOISE = 1e-3


@dataclass(frozen=True)
class RowSetup:
    """What one row compares, and what it should show."""

    engine: str  # the engine's dtype (and its LM head's, where it differs)
    reference: str  # what scored the same tokens
    expected: str  # "=0" bit for bit, "~0" float noise, ">0" a real gap, "?" none


def row_setups(dtype: str, trainer: str, trainer_dtype: str, temperature: float) -> dict[str, RowSetup]:
    """Each row's dtypes as run_parity runs it, and its expectation: only an fp32 engine against an fp32 reference can
    be held to ~0 (16-bit rounding is a gap of its own)."""
    engine, half = SHORT_DTYPE_NAMES[dtype], SHORT_DTYPE_NAMES[lm_head_scenario_dtype(dtype)]
    reference = f"{trainer}-{SHORT_DTYPE_NAMES[trainer_dtype]}"
    same = "~0" if dtype == trainer_dtype == "float32" else "?"
    return {
        "raw_vs_processed/raw": RowSetup(engine, reference, ">0" if temperature != 1.0 else same),
        "raw_vs_processed/processed": RowSetup(engine, reference, same),
        f"lm_head/{half}": RowSetup(half, reference, "?"),
        "lm_head/fp32": RowSetup(f"{half}+fp32-head", reference, "?"),
        "prefix_cache/reset": RowSetup(engine, reference, same),
        "prefix_cache/off": RowSetup(engine, reference, same),
        "prefix_cache/stale": RowSetup(engine, reference, ">0"),
        "batch_invariant": RowSetup(engine, f"rlserve-bi-{engine}", "=0"),
        "moe_replay/off": RowSetup(half, f"rlserve-{SHORT_DTYPE_NAMES[trainer_dtype]}", "?"),
        "moe_replay/on": RowSetup(half, f"rlserve-{SHORT_DTYPE_NAMES[trainer_dtype]}+replay", "?"),
        "fp8/load": RowSetup(f"{half}+fp8", reference, "?"),
        "fp8/10_updates": RowSetup(f"{half}+fp8", reference, "?"),
    }


def as_expected(expected: str, stats: ParityStats) -> str:
    """yes / NO for a row with an expectation, - for one without."""
    if expected == "=0":
        holds = stats.max_abs_diff == 0.0
    elif expected == "~0":
        holds = stats.max_abs_diff < FP32_NOISE
    elif expected == ">0":
        holds = stats.max_abs_diff > FP32_NOISE
    else:
        return "-"
    return "yes" if holds else "NO"


def format_table(results: dict[str, ParityStats], setups: dict[str, RowSetup]) -> str:
    """One row per result, with the dtypes each side really used and whether the row shows what it should."""
    rows = [COLUMNS] + [
        (
            name,
            setups[name].engine,
            setups[name].reference,
            f"{s.mean_abs_diff:.3e}",
            f"{s.max_abs_diff:.3e}",
            f"{s.k3_kl:.3e}",
            f"{s.mean_ratio:.6f}",
            f"{s.frac_outside:.4f}",
            f"{s.ess:.6f}",
            str(s.num_tokens),
            setups[name].expected,
            as_expected(setups[name].expected, s),
        )
        for name, s in results.items()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    return "\n".join(lines)


LEGEND = (
    "Δ = trainer - engine logprob of each sampled token; k3 KL estimates KL(engine || reference); mean ratio, outside "
    "and ESS are of the importance ratios exp(Δ). expected: =0 bit for bit, ~0 float noise (max|Δ| < {noise:g}), >0 a "
    "real gap the row demonstrates, ? none (16-bit rounding: the size is the finding). NO marks a row that is not "
    "as expected, and makes the exit status 1."
)

SCENARIO_WHAT = {
    "raw_vs_processed": "raw vs processed logprobs (2 engines)",
    "lm_head": "16-bit LM head vs fp32 LM head (2 engines)",
    "prefix_cache": "prefix cache across a weight update: reset, off, stale (2 engines)",
    "batch_invariant": "batch-invariant engine vs its trainer-side forward (1 engine)",
    "moe_replay": "16-bit MoE engine vs rlserve's forward routing itself / replaying the engine's routing (1 engine)",
    "fp8": f"16-bit engine with FP8 projections, as loaded and after {FP8_UPDATES} weight updates (1 engine)",
}


def cmd_parity(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the trainer's loading bars would interleave with the progress lines
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        print(f"rlserve parity: unknown scenario(s) {unknown}; known: {list(SCENARIOS)}", file=sys.stderr)
        return 2
    if args.model is not None:
        print(f"model: {args.model} (used as is)")
        model = resolve_model(args.model)
        return _parity(args, scenarios, dict.fromkeys(scenarios, model))
    with tempfile.TemporaryDirectory(prefix="rlserve-parity-") as workdir:  # removed on the way out
        # A model per kind of scenario: moe_replay's has experts, fp8's whole 128x128 blocks, the others' neither.
        kinds = {"moe_replay": ("moe-model", "small-moe", "Qwen3-MoE (moe_replay)"), "fp8": ("fp8-model", FP8_PRESET)}
        built: dict[str, tuple[str, str]] = {}  # preset -> (directory, description)
        models = {}
        for scenario in scenarios:
            folder, preset, *what = kinds.get(scenario, ("model", "small", "Qwen3"))
            if preset not in built:
                path = str(make_peaked_model_dir(Path(workdir) / folder, preset, args.head_scale))
                built[preset] = path, what[0] if what else f"Qwen3 {preset} ({scenario})"
            models[scenario] = built[preset][0]
        shapes = " and ".join(what for _, what in built.values())
        print(
            f"model: a random small {shapes} (removed at exit), logits x{args.head_scale:g} (final RMSNorm weight, "
            "i.e. an LM head scaled by that factor) so that the distribution is peaked"
        )
        return _parity(args, scenarios, models)


def _parity(args: argparse.Namespace, scenarios: list[str], models: dict[str, str]) -> int:
    """`models`: the model directory of each scenario."""
    model = models[scenarios[0]]
    prompts = random_prompts(model, args.num_prompts, args.prompt_len, seed=args.seed)
    peak = peakedness(model, prompts, args.device)
    print(
        f"next-token distributions: mean entropy {peak.entropy:.2f} nats (flat: {peak.uniform_entropy:.2f}), "
        f"mean top-1 probability {peak.top1:.2f}"
    )
    print(
        f"{args.num_prompts} prompts x {args.prompt_len} random tokens, {args.max_tokens} sampled tokens each, "
        f"temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}; engine {args.dtype} on "
        f"{args.device} (the lm_head rows: {lm_head_scenario_dtype(args.dtype)}); reference: trainer {args.trainer} "
        f"in {args.trainer_dtype} scoring the sampled (processed) distribution, and for batch_invariant rlserve's "
        f"batch-invariant forward in {args.dtype}"
    )
    results: dict[str, ParityStats] = {}
    for i, scenario in enumerate(scenarios, 1):
        print(f"[{i}/{len(scenarios)}] {scenario}: {SCENARIO_WHAT[scenario]} ...", end=" ", flush=True)
        t0 = time.perf_counter()
        # One scenario a call: each starts from the checkpoint's weights (prefix_cache updates its reference's).
        results |= run_parity(
            models[scenario],
            prompts,
            scenarios=[scenario],
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            device=args.device,
            dtype=args.dtype,
            trainer=args.trainer,
            trainer_dtype=args.trainer_dtype,
            seed=args.seed,
            fp8_method=args.fp8_method,
        )
        print(f"{time.perf_counter() - t0:.1f} s", flush=True)
    setups = row_setups(args.dtype, args.trainer, args.trainer_dtype, args.temperature)
    print(format_table(results, setups))
    print(LEGEND.format(noise=FP32_NOISE))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "func"} | {"model": model}
        results_json = {
            name: asdict(s) | asdict(setups[name]) | {"as_expected": as_expected(setups[name].expected, s)}
            for name, s in results.items()
        }
        record = dict(config=config, peakedness=asdict(peak), results=results_json)
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(as_expected(setups[n].expected, s) != "NO" for n, s in results.items()) else 1


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "parity", help="engine vs trainer logprobs: raw/processed, LM head dtype, prefix cache across an update"
    )
    p.add_argument(
        "--model", default=None, help="model directory or hub id (default: build a small peaked random model)"
    )
    p.add_argument(
        "--head-scale", type=float, default=HEAD_SCALES["small"], help="logit scale of the model built without --model"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", choices=list(TORCH_DTYPES), help="engine dtype")
    p.add_argument("--trainer", default="hf", choices=["hf", "rlserve"], help="transformers or rlserve's model")
    p.add_argument("--trainer-dtype", default="float32", choices=list(TORCH_DTYPES), help="trainer dtype")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per scenario")
    p.add_argument("--prompt-len", type=int, default=32, help="random tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens sampled per prompt")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (not 1: raw != processed)")
    p.add_argument("--top-k", type=int, default=-1, help="top-k of the sampling (-1: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of the sampling")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, the sampling and the weight update")
    p.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)} (without --model, moe_replay runs on a small Qwen3-MoE "
        f"and fp8 on the {FP8_PRESET} preset)",
    )
    p.add_argument(
        "--fp8-method",
        default="fp8",
        choices=list(FP8_METHODS),
        help="the fp8 scenario's quantization: fp8 (128x128 blocks) or fbgemm_fp8 (per-channel)",
    )
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON (default: none)")
    p.set_defaults(func=cmd_parity)
