"""`rlserve demo`: asynchronous GRPO against a live rlserve server, with in-flight weight updates (PipelineRL-style).

Two processes: this one is the trainer (a Hugging Face Qwen3 model in fp32, plain PyTorch GRPO); the engine is
`rlserve serve` in a subprocess. Rollouts stream from `/v1/completions` (n samples per prompt: one GRPO group per
request, many requests in flight) and carry the engine's per-token logprobs and weight versions. After every
optimizer step the trainer pushes its weights through the native API: pause(keep) -> start -> update (weights over
the `nccl` backend, gloo for CPU tensors; or `ipc` on a shared GPU) -> finish(version) -> resume. Generation never
stops for longer than that pause; requests caught by it continue under the new weights, so one sample may carry two
versions. Samples whose oldest token lags the trainer by more than `max_lag` versions are dropped.

The pieces (EngineServer, RolloutStream, WeightSync, train_on_batch) are what `examples/async_grpo.py` composes;
`run_demo` adds the per-step table, the plot, the JSON log and the verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rlserve.dtypes import dtype_name
from rlserve.engine.args import engine_flags
from rlserve.rl.client import AsyncRLServeClient
from rlserve.rl.grpo import GRPOConfig, Policy, Rollout, TokenBatch, TrainStats, group_advantages, supervised_warmup
from rlserve.rl.tasks import AdditionTask, Problem
from rlserve.toy import PRESETS, make_model_dir
from rlserve.weight_transfer import (
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    WeightTransferGroup,
)

# Exit status when the run completed but the reward did not rise by the margin (1 is left to crashes, 2 to argparse).
EXIT_NO_IMPROVEMENT = 3
# The whole demo model fits in one bucket: one broadcast per update.
PACKED_BUFFER_SIZE_BYTES = 8 << 20
ENGINE_START_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 300.0
RENDEZVOUS_TIMEOUT_S = 120.0
BACKENDS = ("nccl", "ipc")


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


# ---- the engine process ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineServer:
    """`rlserve serve` in a subprocess on a free port of 127.0.0.1, with a random API key and the RL API on.

    A context manager: leaving it (normally, on an error, or on Ctrl-C) stops the process. The server runs in a
    session of its own, so a terminal's Ctrl-C reaches only the trainer, which then stops the server in order.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        log_path: str | Path,
        device: str = "cpu",
        backend: str = "nccl",
        threads: int | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.log_path = Path(log_path)
        self.device = device
        self.backend = backend
        self.threads = threads
        self.port = free_port()
        self.api_key = secrets.token_hex(16)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> EngineServer:
        command = [
            sys.executable, "-m", "rlserve.cli", "serve", self.model_dir,
            "--host", "127.0.0.1", "--port", str(self.port), "--api-key", self.api_key, "--enable-rl-api",
            *engine_flags(
                weight_transfer_config={"backend": self.backend}, device=self.device, dtype="float32",
                # The logprobs of the distribution actually sampled: the behaviour policy of the importance ratio.
                logprobs_mode="processed_logprobs",
            ),
            "--log-level", "warning",
        ]  # fmt: skip
        env = dict(os.environ)
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    async def wait_ready(self, timeout: float = ENGINE_START_TIMEOUT_S) -> None:
        """Wait for /health; fail at once, with the server's log, if the process exits first."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.base_url, timeout=5.0) as http:
            while True:
                if self._proc is None or self._proc.poll() is not None:
                    code = None if self._proc is None else self._proc.returncode
                    raise RuntimeError(f"the engine exited (status {code}) before serving:\n{self.log_tail()}")
                try:
                    if (await http.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the engine did not serve within {timeout:g} s:\n{self.log_tail()}")
                await asyncio.sleep(0.2)

    def control(self) -> AsyncRLServeClient:
        return AsyncRLServeClient(self.base_url, api_key=self.api_key, timeout=HTTP_TIMEOUT_S)

    def http(self) -> httpx.AsyncClient:
        # Connection limits sized for many concurrent completions (httpx's default pool holds 100).
        return httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=HTTP_TIMEOUT_S,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )


# ---- weight sync ----


@dataclass(frozen=True)
class SyncTiming:
    sync_ms: float  # start_weight_update -> finish_weight_update returned: the transfer itself
    pause_ms: float  # pause called -> resume returned: how long generation stood still
    # Each call of the sequence (pause, start, transfer, finish, resume), for the JSON log: where a slow sync goes.
    phases_ms: dict[str, float]


class WeightSync:
    """Pushes the trainer's weights into the engine through the native four-phase API, around a pause(keep).

    `nccl`: the trainer (rank 0) and the engine's worker (rank 1) form a group once (`connect`); every update is one
    packed broadcast (gloo for CPU tensors), received by the engine while its `update_weights` call is pending.
    `ipc`: nothing to connect; the trainer exports CUDA handles and posts them as the update itself.
    """

    def __init__(self, engine: EngineServer, control: AsyncRLServeClient) -> None:
        self.engine = engine
        self.control = control
        self._group: WeightTransferGroup | None = None

    async def connect(self) -> None:
        if self.engine.backend == "ipc":
            await self.control.init_weight_transfer_engine({})
            return
        init_info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
        # Both sides block until the other joins: the engine's call is awaited while the trainer joins on a thread.
        _, self._group = await asyncio.gather(
            self.control.init_weight_transfer_engine(init_info),
            asyncio.to_thread(NCCLWeightTransferEngine.trainer_init, {**init_info, "timeout_s": RENDEZVOUS_TIMEOUT_S}),
        )

    async def push(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> SyncTiming:
        phases: dict[str, float] = {}

        async def timed(name: str, call: Awaitable[Any]) -> None:
            t = time.perf_counter()
            await call
            phases[name] = (time.perf_counter() - t) * 1e3

        # keep: in-flight requests freeze and continue under the new weights. clear_cache: their KV is recomputed
        # under the new weights, so every token's logprob is exactly what the trainer computes for its version
        # (PipelineRL keeps the stale KV instead: a small, unmeasured mismatch in exchange for no recompute).
        await timed("pause", self.control.pause(mode="keep", clear_cache=True))
        try:
            await timed("start", self.control.start_weight_update())
            await timed("transfer", self._transfer(weights))
            await timed("finish", self.control.finish_weight_update(weight_version=str(version)))
        finally:
            await timed("resume", self.control.resume())
        sync_ms = phases["start"] + phases["transfer"] + phases["finish"]
        return SyncTiming(sync_ms=sync_ms, pause_ms=sync_ms + phases["pause"] + phases["resume"], phases_ms=phases)

    async def _transfer(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        if self.engine.backend == "ipc":
            args = IPCTrainerSendWeightsArgs(
                send_mode="http", url=self.engine.base_url, api_key=self.engine.api_key, packed=True,
                packed_buffer_size_bytes=PACKED_BUFFER_SIZE_BYTES,
            )  # fmt: skip
            await asyncio.to_thread(IPCWeightTransferEngine.trainer_send_weights, iter(weights), args)
            return
        if self._group is None:
            raise RuntimeError("WeightSync.push before connect()")
        update_info = {
            "names": [name for name, _ in weights],
            "dtype_names": [dtype_name(t.dtype) for _, t in weights],
            "shapes": [list(t.shape) for _, t in weights],
            "packed": True,
            "packed_buffer_size_bytes": PACKED_BUFFER_SIZE_BYTES,
        }
        args = NCCLTrainerSendWeightsArgs(
            group=self._group, packed=True, packed_buffer_size_bytes=PACKED_BUFFER_SIZE_BYTES
        )
        await asyncio.gather(
            self.control.update_weights(update_info),
            asyncio.to_thread(NCCLWeightTransferEngine.trainer_send_weights, iter(weights), args),
        )

    def close(self) -> None:
        if self._group is not None:
            self._group.shutdown()
            self._group = None


# ---- rollouts ----


@dataclass(frozen=True)
class Group:
    """One prompt's samples: the unit GRPO normalises rewards over."""

    problem: Problem
    rollouts: list[Rollout]


@dataclass(frozen=True)
class RolloutBatch:
    groups: list[Group]
    num_dropped: int  # samples dropped for lagging more than max_lag versions behind the trainer
    wait_ms: float  # how long the trainer waited for them


class RolloutStream:
    """Keeps `concurrency` GRPO groups generating at all times and buffers up to `buffer` finished ones.

    Each worker loops: draw a prompt, POST /v1/completions with n=group_size, queue the scored group. The queue is
    bounded, so when the trainer falls behind the workers wait with finished groups in hand instead of running
    further ahead of the weights (which bounds the lag).
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        task: AdditionTask,
        tokenizer: PreTrainedTokenizerBase,
        *,
        group_size: int,
        concurrency: int,
        seed: int,
        buffer: int | None = None,
        temperature: float = 1.0,
    ) -> None:
        self.http = http
        self.task = task
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.concurrency = concurrency
        self.temperature = temperature
        self._rng = random.Random(seed)
        self._seed = seed
        self._num_requests = 0
        # By default a quarter of the in-flight groups may wait finished: the trainer rarely waits long, and samples
        # lag about one version (one-step off-policy, as in PipelineRL).
        buffer = max(1, concurrency // 4) if buffer is None else buffer
        if concurrency < 1 or buffer < 1:
            raise ValueError(f"concurrency and buffer must be >= 1, got {concurrency} and {buffer}")
        self._queue: asyncio.Queue[Group] = asyncio.Queue(maxsize=buffer)
        self._workers: list[asyncio.Task] = []
        self._failed: asyncio.Future | None = None

    async def __aenter__(self) -> RolloutStream:
        self._failed = asyncio.get_running_loop().create_future()
        self._workers = [asyncio.create_task(self._work()) for _ in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []

    async def _work(self) -> None:
        try:
            while True:
                group = await self.generate(self.task.sample(self._rng))
                await self._queue.put(group)
        except Exception as e:  # the trainer waits in take(): hand it the failure instead of a silent hang
            if not self._failed.done():
                self._failed.set_exception(e)

    async def generate(self, problem: Problem) -> Group:
        prompt_ids = self.tokenizer(problem.prompt).input_ids
        self._num_requests += 1
        body = {
            "prompt": prompt_ids,
            "n": self.group_size,
            "max_tokens": self.task.max_completion_tokens,
            "temperature": self.temperature,
            "logprobs": 0,  # the sampled token's logprob only
            "return_token_ids": True,
            # Seeded per request: a request's samples do not depend on what else is in the engine's batch.
            "seed": self._seed * 1_000_003 + self._num_requests * self.group_size,
        }
        response = await self.http.post("/v1/completions", json=body)
        if response.is_error:
            raise RuntimeError(f"/v1/completions -> {response.status_code}: {response.text}")
        rollouts = [
            Rollout(
                prompt_ids=prompt_ids,
                completion_ids=choice["token_ids"],
                logprobs=choice["logprobs"]["token_logprobs"],
                versions=[int(v) for v in choice["weight_versions"]],
                reward=self.task.reward(problem, choice["text"], choice["finish_reason"]),
            )
            for choice in sorted(response.json()["choices"], key=lambda c: c["index"])
        ]
        return Group(problem, rollouts)

    async def take(self, num_groups: int, trainer_version: int, max_lag: int) -> RolloutBatch:
        """The next `num_groups` groups in order of arrival, without their samples older than `max_lag` versions
        (a group left with no sample does not count)."""
        if self._failed is None:
            raise RuntimeError("RolloutStream.take outside `async with stream:`")
        start = time.perf_counter()
        groups: list[Group] = []
        dropped = 0
        while len(groups) < num_groups:
            getter = asyncio.ensure_future(self._queue.get())
            await asyncio.wait([getter, self._failed], return_when=asyncio.FIRST_COMPLETED)
            if self._failed.done():
                getter.cancel()
                self._failed.result()  # raises the worker's error
            group = getter.result()
            fresh = [r for r in group.rollouts if trainer_version - r.oldest_version <= max_lag]
            dropped += len(group.rollouts) - len(fresh)
            if fresh:
                groups.append(Group(group.problem, fresh))
        return RolloutBatch(groups, dropped, (time.perf_counter() - start) * 1e3)


# ---- one training step ----


@dataclass(frozen=True)
class StepStats:
    reward: float
    lag_mean: float
    lag_max: int
    num_samples: int
    train: TrainStats


def train_on_batch(policy: Policy, batch: RolloutBatch, pad_id: int) -> StepStats:
    """One GRPO step on a batch of groups: per-group advantages, then the policy's clipped update."""
    rollouts = [r for g in batch.groups for r in g.rollouts]
    # Groups may have lost samples to the lag filter, so each is normalised on its own.
    advantages = torch.cat(
        [
            group_advantages(torch.tensor([[r.reward for r in g.rollouts]]), policy.config.std_eps)[0]
            for g in batch.groups
        ]
    )
    lags = [policy.version - r.oldest_version for r in rollouts]
    device = next(policy.model.parameters()).device
    train = policy.train_step(TokenBatch.from_rollouts(rollouts, pad_id, device), advantages)
    return StepStats(
        reward=sum(r.reward for r in rollouts) / len(rollouts),
        lag_mean=sum(lags) / len(lags),
        lag_max=max(lags),
        num_samples=len(rollouts),
        train=train,
    )


# ---- models ----


def load_trainer_model(model_dir: str | Path, device: str = "cpu") -> torch.nn.Module:
    """The trainer's copy: Hugging Face's Qwen3ForCausalLM in fp32, whose parameter names are checkpoint names."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)


def warm_up(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, task: AdditionTask, steps: int, seed: int
) -> None:
    """Supervised warm-up on the task, so RL starts from a model that is sometimes right (GRPO learns nothing from
    groups that are all wrong)."""
    eos = [tokenizer.eos_token_id]

    def example(rng: random.Random) -> tuple[list[int], list[int]]:
        problem = task.sample(rng)
        return tokenizer(problem.prompt).input_ids, tokenizer(problem.answer).input_ids + eos

    supervised_warmup(model, example, steps, pad_id=tokenizer.pad_token_id, seed=seed)


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


def plot(records: Sequence[StepRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [r.reward for r in records], marker=".", color="tab:blue")
    top.set_ylabel("reward (batch mean)")
    top.set_ylim(0, 1)
    top.grid(alpha=0.3)
    top.set_title("rlserve demo: async GRPO with in-flight weight updates")
    bottom.plot(steps, [r.mismatch_kl for r in records], marker=".", color="tab:red")
    bottom.set_ylabel("engine/trainer mismatch KL (k3)")
    bottom.set_xlabel("step (= weight version after the update)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
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
                model_dir, log_path=log_path, device=config.device, backend=config.backend, threads=threads
            ) as server:
                result.summary["engine_url"] = server.base_url
                await _train(config, server, model_dir, result)
        result.summary.update(summarize(result.steps))
    finally:
        result.summary["wall_s"] = time.perf_counter() - t_start
        (out / "log.json").write_text(json.dumps(asdict(result), indent=2))
    plot(result.steps, out / "reward.png")
    s = result.summary
    print(
        f"reward: start {s['start_reward']:.3f} (mean of the first {s['window']} steps) -> end {s['end_reward']:.3f} "
        f"(last {s['window']}): {'rose' if result.passed else 'did NOT rise'} (margin {s['margin']:.3f}); "
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
    model = load_trainer_model(model_dir, config.device)
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


def cmd_demo(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # model saving/loading bars would interleave with the table
    try:
        config = DemoConfig(
            steps=args.steps, model_size=args.model_size, device=args.device, backend=args.backend, seed=args.seed,
            max_lag=args.max_lag, group_size=args.group_size, prompts_per_step=args.prompts_per_step, lr=args.lr,
            warmup_steps=args.warmup_steps, out=args.out,
        )  # fmt: skip
    except ValueError as e:
        print(f"rlserve demo: {e}", file=sys.stderr)
        return 2
    # A `kill` must clean up like Ctrl-C does: stop the engine process on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
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
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (= weight updates)")
    p.add_argument("--model-size", default=d.model_size, choices=sorted(PRESETS), help="rlserve.toy preset")
    p.add_argument("--device", default=d.device, help="cpu or cuda[:N], for trainer and engine alike")
    p.add_argument("--backend", default=d.backend, choices=BACKENDS, help="weight transfer (ipc: shared GPU)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-lag", type=int, default=d.max_lag, help="drop samples older than this many versions")
    p.add_argument("--group-size", type=int, default=d.group_size, help="samples per prompt (GRPO group)")
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step, help="groups per optimizer step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="supervised steps before RL")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: runs/demo-<timestamp>)")
    p.set_defaults(func=cmd_demo)
