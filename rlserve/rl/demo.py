"""`rlserve demo`: asynchronous GRPO against a live rlserve server, with in-flight weight updates (PipelineRL-style).

Two processes: this one is the trainer (a Hugging Face Qwen3 model in fp32, plain PyTorch GRPO; with --batch-invariant
rlserve's own decoder, whose one forward per step gives the engine's logprobs bit for bit); the engine is
`rlserve serve` in a subprocess. Rollouts stream from `/v1/completions` (n samples per prompt: one GRPO group per
request, many requests in flight) and carry the engine's per-token logprobs and weight versions. After every
optimizer step the trainer pushes its weights through the native API: pause(keep) -> start -> update (weights over
the `nccl` backend, gloo for CPU tensors; or `ipc` on a shared GPU) -> finish(version) -> resume. Generation never
stops for longer than that pause; requests caught by it continue under the new weights, so one sample may carry two
versions. Samples whose oldest token lags the trainer by more than `max_lag` versions are dropped.

The pieces are what `examples/async_grpo.py` composes: `EngineServer` (rlserve.rl.engine_server), `WeightSync`
(rlserve.rl.weight_sync), `RolloutStream` (rlserve.rl.rollout_stream), `train_on_batch` (rlserve.rl.train_step) and
the trainer's model with its warm-up (rlserve.rl.trainer_model). `run_demo` adds the per-step table, the plot, the
JSON log and the verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from rlserve.rl.engine_server import EngineServer
from rlserve.rl.grpo import GRPOConfig, Policy
from rlserve.rl.rollout_stream import RolloutBatch, RolloutStream
from rlserve.rl.tasks import AdditionTask
from rlserve.rl.train_step import StepStats, train_on_batch
from rlserve.rl.trainer_model import load_trainer_model, warm_up
from rlserve.rl.weight_sync import BACKENDS, SyncTiming, WeightSync
from rlserve.toy import PRESETS, make_model_dir

# Exit status when the run completed but the reward did not rise by the margin (1 is left to crashes, 2 to argparse).
EXIT_NO_IMPROVEMENT = 3


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 200
    model_size: str = "tiny"
    device: str = "cpu"
    backend: str = "nccl"
    seed: int = 0
    max_lag: int = 2
    group_size: int = 8
    prompts_per_step: int = 32
    lr: float = 1e-3
    warmup_steps: int = 70  # supervised steps before RL: sampled reward starts around 0.2-0.3
    batch_invariant: bool = False  # engine and trainer (rlserve's decoder) in batch-invariant mode: mismatch exactly 0
    out: Path | None = None  # None: runs/demo-<timestamp>

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (GRPO compares samples within a group), got {self.group_size}")
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {self.max_lag}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.model_size not in PRESETS:
            raise ValueError(f"model_size must be one of {sorted(PRESETS)}, got {self.model_size!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        cuda = torch.device(self.device).type == "cuda"
        if self.backend == "ipc" and not cuda:
            raise ValueError("backend 'ipc' shares CUDA memory: it needs --device cuda")
        if self.backend == "nccl" and cuda:
            raise ValueError("NCCL refuses two ranks on one GPU: with --device cuda use --backend ipc")


# ---- the demo ----


@dataclass(frozen=True)
class StepRecord:
    step: int
    reward: float
    weight_version: int
    lag_mean: float
    lag_max: int
    sync_ms: float
    pause_ms: float
    sync_phases_ms: dict[str, float]
    mismatch_kl: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    clip_fraction: float
    loss: float
    grad_norm: float
    num_groups: int
    num_samples: int
    num_dropped: int
    wait_ms: float
    train_ms: float


@dataclass
class DemoResult:
    config: dict[str, Any]
    steps: list[StepRecord] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.summary.get("reward_rose"))


_COLUMNS = (
    f"{'step':>5} {'reward':>7} {'ver':>4} {'lag mean/max':>12} {'sync ms':>8} {'pause ms':>9} "
    f"{'mismatch KL':>12} {'ratio mean [min, max]':>23} {'clip':>6} {'dropped':>7}"
)


# Printed once, above the table.
LEGEND = """\
Each row is one optimizer step, then one weight update of the engine:
  reward        mean reward of the step's samples (1: the right sum, then stop; 0.5: the right sum without stopping)
  ver           the weight version the trainer reached with this step, pushed to the engine
  lag mean/max  versions by which the weights that sampled a token trailed the trainer's (samples over --max-lag
                are dropped: the dropped column)
  sync ms       the weight transfer alone: start -> update -> finish
  pause ms      how long the engine stood still: pause -> sync -> resume, the price of the update for generation
  mismatch KL   engine vs trainer on the same tokens under the same weights (k3 estimate of the KL): ~0 in fp32
  ratio         importance ratios exp(trainer - engine logprob) over the step's tokens, mean [min, max]: 1 on
                policy, away from 1 for tokens sampled by older weights (lag)
  clip          share of tokens whose ratio PPO's clip (1 +- 0.2) cut off from the gradient"""


def format_row(r: StepRecord) -> str:
    ratio = f"{r.ratio_mean:.3f} [{r.ratio_min:.3f}, {r.ratio_max:.3f}]"
    return (
        f"{r.step:>5} {r.reward:>7.3f} {r.weight_version:>4} {r.lag_mean:>7.2f}/{r.lag_max:<4} {r.sync_ms:>8.1f} "
        f"{r.pause_ms:>9.1f} {r.mismatch_kl:>12.2e} {ratio:>23} {r.clip_fraction:>6.1%} {r.num_dropped:>7}"
    )


def improvement_margin(groups_start: int, groups_end: int) -> float:
    """How far the end reward must exceed the start reward to count as a rise, not noise.

    Each group's mean reward lies in [0, 1], so its standard deviation is at most 0.5, and groups are independent
    (prompts are drawn independently; samples of one group are not, so the group is the unit). The difference of
    the two windows' means then has a standard deviation of at most 0.5 * sqrt(1/g1 + 1/g2); two of those make a
    run that learned nothing pass with probability of about 2% at worst. Defaults (3 steps x 32 groups a window):
    0.144.
    """
    return 2 * 0.5 * math.sqrt(1 / groups_start + 1 / groups_end)


def summarize(records: Sequence[StepRecord]) -> dict[str, Any]:
    window = max(1, min(3, len(records) // 2))
    first, last = records[:window], records[-window:]
    start = sum(r.reward for r in first) / window
    end = sum(r.reward for r in last) / window
    margin = improvement_margin(sum(r.num_groups for r in first), sum(r.num_groups for r in last))
    return dict(
        window=window,
        start_reward=start,
        end_reward=end,
        margin=margin,
        reward_rose=end - start > margin,
        dropped_samples=sum(r.num_dropped for r in records),
        mismatch_kl_max=max(r.mismatch_kl for r in records),
        sync_ms_mean=sum(r.sync_ms for r in records) / len(records),
        pause_ms_mean=sum(r.pause_ms for r in records) / len(records),
    )


def verdict(summary: dict[str, Any]) -> str:
    """The reward test in words: what was required, what was measured, and the outcome (the exit status)."""
    s = summary
    rise = s["end_reward"] - s["start_reward"]
    measured = (
        f"reward: start {s['start_reward']:.3f} (mean of the first {s['window']} steps) -> end {s['end_reward']:.3f} "
        f"(last {s['window']}): a change of {rise:+.3f}; a rise counts when it exceeds {s['margin']:.3f} (two "
        "standard errors of the difference, so that noise alone passes about 2% of the time)"
    )
    if s["reward_rose"]:
        return f"{measured}. PASS: the reward rose"
    too_short = " (too few steps to tell: the default is 200)" if s["window"] < 3 else ""
    return f"{measured}. NOT SHOWN: no rise beyond noise{too_short}; exit status {EXIT_NO_IMPROVEMENT}"


def settings_caption(config: dict[str, Any]) -> str:
    c = config
    return (
        f"{c['steps']} steps, model {c['model_size']} on {c['device']}, {c['prompts_per_step']} prompts x "
        f"{c['group_size']} samples per step, lr {c['lr']:g}, max lag {c['max_lag']}, {c['warmup_steps']} warm-up "
        f"steps, weight transfer {c['backend']}, seed {c['seed']}{', batch-invariant' if c['batch_invariant'] else ''}"
    )


# k3 estimates of a KL can be exactly 0 (engine and trainer agree to the bit): drawn at this floor, below any nonzero
# estimate in fp32, instead of vanishing from the log axis.
KL_FLOOR = 1e-16


def plot(records: Sequence[StepRecord], path: Path, caption: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    top.plot(steps, [r.reward for r in records], marker=".", color="tab:blue")
    top.set_ylabel("reward (batch mean)")
    top.set_ylim(0, 1)
    top.grid(alpha=0.3)
    top.set_title("rlserve demo: async GRPO with in-flight weight updates")
    middle.plot(steps, [r.pause_ms for r in records], marker=".", color="tab:orange", label="pause (no generation)")
    middle.plot(steps, [r.sync_ms for r in records], marker=".", color="tab:green", label="sync (weight transfer)")
    middle.set_ylabel("ms per update")
    middle.set_ylim(bottom=0)
    middle.legend(loc="upper right", fontsize="small")
    middle.grid(alpha=0.3)
    kls = [r.mismatch_kl for r in records]
    bottom.plot(steps, [kl if kl > 0 else KL_FLOOR for kl in kls], marker=".", color="tab:red")
    bottom.set_yscale("log")
    zeros = f"; 0 drawn at {KL_FLOOR:g}" if min(kls, default=1) <= 0 else ""
    bottom.set_ylabel(f"mismatch KL, log scale\n(engine vs trainer, same\ntokens and weights; k3{zeros})")
    bottom.set_xlabel("step (= weight version after the update)")
    bottom.grid(alpha=0.3, which="both")
    fig.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize="small", wrap=True)
    fig.tight_layout(rect=(0, 0.04, 1, 1))  # room for the caption
    fig.savefig(path, dpi=120)
    plt.close(fig)


def default_out_dir() -> Path:
    return Path("runs") / f"demo-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


async def run_demo(config: DemoConfig) -> DemoResult:
    """The whole demo: engine up, warm-up, `config.steps` RL steps, then the log, the plot and the verdict. The log
    is written even when a step fails, with what was done so far."""
    t_start = time.perf_counter()
    out = config.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    result = DemoResult(config={**asdict(config), "out": str(out)})
    # Trainer and engine share the cores; each takes half, since oversubscribed OpenMP spin-waits make small
    # matmuls many times slower.
    threads = max(1, (os.cpu_count() or 2) // 2)
    torch.set_num_threads(threads)
    torch.manual_seed(config.seed)
    print(f"rlserve demo: {config.steps} steps of async GRPO on single-digit addition; output in {out}")
    try:
        with tempfile.TemporaryDirectory(prefix="rlserve-demo-") as workdir:
            model_dir = make_model_dir(Path(workdir) / "model", preset=config.model_size, seed=config.seed)
            log_path = out / "engine.log"
            with EngineServer(
                model_dir, log_path=log_path, device=config.device, backend=config.backend, threads=threads,
                batch_invariant=config.batch_invariant,
            ) as server:  # fmt: skip
                result.summary["engine_url"] = server.base_url
                await _train(config, server, model_dir, result)
        result.summary.update(summarize(result.steps))
    finally:
        result.summary["wall_s"] = time.perf_counter() - t_start
        (out / "log.json").write_text(json.dumps(asdict(result), indent=2))
    plot(result.steps, out / "reward.png", settings_caption(result.config))
    print(verdict(result.summary))
    s = result.summary
    print(
        f"engine at weight version {s['engine_weight_version']}; {s['dropped_samples']} samples dropped for lag; "
        f"{s['wall_s']:.0f} s"
    )
    print(f"plot: {out / 'reward.png'}  log: {out / 'log.json'}  engine log: {log_path}")
    return result


async def _train(config: DemoConfig, server: EngineServer, model_dir: Path, result: DemoResult) -> None:
    task = AdditionTask()
    # The engine starts (imports, model load) while the trainer warms up: both take seconds.
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_trainer_model(model_dir, config.device, config.batch_invariant)
    warm_up(model, tokenizer, task, config.warmup_steps, config.seed)
    result.summary["warmup_s"] = time.perf_counter() - t0
    await server.wait_ready()
    result.summary["engine_ready_s"] = time.perf_counter() - t0
    print(
        f"warm-up: {config.warmup_steps} supervised steps in {result.summary['warmup_s']:.1f} s; "
        f"engine serving after {result.summary['engine_ready_s']:.1f} s"
    )
    policy = Policy(model, GRPOConfig(lr=config.lr, keep_versions=config.max_lag + 1))
    async with server.control() as control, server.http() as http:
        sync = WeightSync(server, control)
        try:
            await sync.connect()
            await sync.push(list(policy.named_weights()), version=policy.version)  # the warmed-up weights: v0
            stream = RolloutStream(
                http, task, tokenizer, group_size=config.group_size, concurrency=config.prompts_per_step,
                seed=config.seed,
            )  # fmt: skip
            async with stream:
                print(LEGEND)
                print(_COLUMNS)
                for step in range(1, config.steps + 1):
                    batch = await stream.take(config.prompts_per_step, policy.version, config.max_lag)
                    t_train = time.perf_counter()
                    # On a thread, so the event loop keeps feeding the engine while the trainer computes.
                    stats = await asyncio.to_thread(train_on_batch, policy, batch, tokenizer.pad_token_id)
                    train_ms = (time.perf_counter() - t_train) * 1e3
                    timing = await sync.push(list(policy.named_weights()), version=policy.version)
                    record = _record(step, policy.version, stats, batch, timing, train_ms)
                    result.steps.append(record)
                    print(format_row(record), flush=True)
            engine_version = await control.get_weight_version()
        finally:
            sync.close()
    result.summary.update(engine_weight_version=engine_version, trainer_weight_version=policy.version)
    if engine_version != str(policy.version):
        raise RuntimeError(f"the engine reports weight version {engine_version!r}, the trainer is at {policy.version}")


def _record(
    step: int, version: int, stats: StepStats, batch: RolloutBatch, timing: SyncTiming, train_ms: float
) -> StepRecord:
    loss = stats.train.loss_stats
    return StepRecord(
        step=step,
        reward=stats.reward,
        weight_version=version,
        lag_mean=stats.lag_mean,
        lag_max=stats.lag_max,
        sync_ms=timing.sync_ms,
        pause_ms=timing.pause_ms,
        sync_phases_ms=timing.phases_ms,
        mismatch_kl=stats.train.mismatch_kl,
        ratio_mean=loss.ratio_mean,
        ratio_min=loss.ratio_min,
        ratio_max=loss.ratio_max,
        clip_fraction=loss.clip_fraction,
        loss=stats.train.loss,
        grad_norm=stats.train.grad_norm,
        num_groups=len(batch.groups),
        num_samples=stats.num_samples,
        num_dropped=batch.num_dropped,
        wait_ms=batch.wait_ms,
        train_ms=train_ms,
    )


# ---- CLI ----


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_demo(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # model saving/loading bars would interleave with the table
    try:
        config = DemoConfig(
            steps=args.steps, model_size=args.model_size, device=args.device, backend=args.backend, seed=args.seed,
            max_lag=args.max_lag, group_size=args.group_size, prompts_per_step=args.prompts_per_step, lr=args.lr,
            warmup_steps=args.warmup_steps, batch_invariant=args.batch_invariant, out=args.out,
        )  # fmt: skip
    except ValueError as e:
        print(f"rlserve demo: {e}", file=sys.stderr)
        return 2
    # Ctrl-C and `kill` raise KeyboardInterrupt where the main thread is, and the engine process is stopped on the
    # way out. Not asyncio.run's own SIGINT handling: it only cancels the main task, and a cancellation that a library
    # below absorbs (seen under load) leaves the demo running.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = asyncio.run(run_demo(config))
    except KeyboardInterrupt:
        print("rlserve demo: interrupted; the engine was stopped", file=sys.stderr)
        return 130
    return 0 if result.passed else EXIT_NO_IMPROVEMENT


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    d = DemoConfig()
    p = subparsers.add_parser(
        "demo",
        help="async GRPO against a live engine, with in-flight weight updates: the reward rises in minutes on a CPU",
        description=__doc__,
    )
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (= weight updates)")
    p.add_argument("--model-size", default=d.model_size, choices=sorted(PRESETS), help="rlserve.toy preset")
    p.add_argument("--device", default=d.device, help="cpu or cuda[:N], for trainer and engine alike")
    p.add_argument("--backend", default=d.backend, choices=BACKENDS, help="weight transfer (ipc: shared GPU)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the model, the prompts and the sampling")
    p.add_argument("--max-lag", type=int, default=d.max_lag, help="drop samples older than this many versions")
    p.add_argument("--group-size", type=int, default=d.group_size, help="samples per prompt (GRPO group)")
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step, help="groups per optimizer step")
    p.add_argument("--lr", type=float, default=d.lr, help="the trainer's learning rate (Adam)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="supervised steps before RL")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="engine in batch-invariant mode, trainer rlserve's decoder in it: one forward gives the engine's logprobs "
        "bit for bit (mismatch KL exactly 0, on-policy ratios exactly 1) and the loss's gradients",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory (default: runs/demo-<timestamp>)")
    p.set_defaults(func=cmd_demo)
