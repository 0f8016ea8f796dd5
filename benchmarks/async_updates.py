"""W5 async updates: W1 while the weights are replaced every 16 decode steps, against W1 alone in the same process.

GPU:  python3 benchmarks/async_updates.py --device cuda
CPU:  OMP_NUM_THREADS=1 python benchmarks/async_updates.py --device cpu --preset small --scale 0.03

The engine is an `AsyncLLM` serving all of W1's requests at once, each returning its samples whole when done (as a
rollout collector takes them; `--stream` consumes cumulative outputs every step instead, which measures the
per-step output path too). A controller
watches the engine's step counter and, every `--every` steps, runs the native sequence with requests in flight:
pause(mode="keep") -> start_weight_update -> update_weights (every weight of the model) -> finish_weight_update
(version) -> resume. The trainer shares the engine's process (colocated, as with TRL's colocate mode): its tensors
reach the engine through a small in-process backend registered with the factory, so the update costs what loading
the model's weights costs; the transfer itself is W4. Two variants: `keep` (in-flight requests continue on their
KV, computed under the old weights, as PipelineRL does) and `keep+clear` (their KV is dropped and recomputed under
the new weights, rlserve's exact mode). Reported: output tok/s against W1 without updates (same process, same
prompts), the number of updates, the pause call's latency (call -> return) and how long generation stood still
(pause call -> resume returned), medians and maxima.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workloads import W1_ENGINE, workloads  # noqa: E402  (the benchmarks share W1's definition)

from rlserve import RequestOutputKind, WeightTransferConfig  # noqa: E402
from rlserve.engine.frontend.args import add_engine_arguments, engine_kwargs  # noqa: E402
from rlserve.engine.frontend.async_llm import AsyncLLM  # noqa: E402
from rlserve.toy import make_model_dir  # noqa: E402
from rlserve.weight_transfer import (  # noqa: E402
    LoadWeightsFn,
    WeightTransferEngine,
    WeightTransferEngineFactory,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

# The colocated trainer's tensors, by update id: the in-process backend's "wire".
_OUTBOX: dict[int, list[tuple[str, torch.Tensor]]] = {}


@dataclass
class LocalUpdateInfo(WeightTransferUpdateInfo):
    update_id: int = 0


class LocalWeightTransferEngine(WeightTransferEngine[WeightTransferInitInfo, LocalUpdateInfo]):
    """Trainer and engine in one process: the update hands over tensors by reference."""

    init_info_cls = WeightTransferInitInfo
    update_info_cls = LocalUpdateInfo

    def init_transfer_engine(self, init_info: WeightTransferInitInfo) -> None:
        pass

    def receive_weights(self, update_info: LocalUpdateInfo, load_weights: LoadWeightsFn) -> None:
        load_weights(_OUTBOX.pop(update_info.update_id))

    def discard_weights(self, update_info: LocalUpdateInfo) -> None:
        _OUTBOX.pop(update_info.update_id, None)

    def shutdown(self) -> None:
        pass


@dataclass
class Run:
    mode: str
    seconds: float
    output_tokens: int
    updates: int
    pause_call_ms: list[float]
    paused_ms: list[float]

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


async def run_workload(engine: AsyncLLM, prompts, params, mode: str, every: int, trainer_weights) -> Run:
    core = engine.engine_core
    pause_call_ms: list[float] = []
    paused_ms: list[float] = []
    done = asyncio.Event()

    async def consume(i: int) -> int:
        last = None
        async for out in engine.generate(prompts[i], params[i], request_id=f"{mode}-{i}"):
            last = out
        return sum(len(c.token_ids) for c in last.outputs)

    async def control() -> None:
        version = 0
        mark = core.num_steps
        while not done.is_set():
            await asyncio.sleep(0.0005)
            if core.num_steps - mark < every:
                continue
            version += 1
            t0 = time.perf_counter()
            await engine.pause_generation(mode="keep", clear_cache=mode == "keep+clear")
            pause_call_ms.append((time.perf_counter() - t0) * 1e3)
            await engine.start_weight_update()
            names = [name for name, _ in trainer_weights]
            _OUTBOX[version] = trainer_weights
            await engine.update_weights(
                dict(
                    update_info=dict(
                        names=names,
                        dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in trainer_weights],
                        shapes=[list(t.shape) for _, t in trainer_weights],
                        update_id=version,
                    )
                )
            )
            await engine.finish_weight_update(weight_version=str(version))
            await engine.resume_generation()
            paused_ms.append((time.perf_counter() - t0) * 1e3)
            mark = core.num_steps

    controller = asyncio.create_task(control()) if mode != "none" else None
    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(consume(i) for i in range(len(prompts))))
    seconds = time.perf_counter() - t0
    done.set()
    if controller is not None:
        await controller
    return Run(mode, seconds, sum(tokens), len(paused_ms), pause_call_ms, paused_ms)


def _stats(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} / {max(values):.1f}" if values else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of W1's prompts (CPU runs)")
    ap.add_argument("--every", type=int, default=16, help="engine steps between updates")
    ap.add_argument("--stream", action="store_true", help="consume cumulative outputs every step")
    add_engine_arguments(
        ap,
        defaults={"device": "cuda" if torch.cuda.is_available() else "cpu", **W1_ENGINE},
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_dir = make_model_dir(tempfile.mkdtemp(), preset=args.preset, dtype=dtype)
    WeightTransferEngineFactory.register_engine("local", LocalWeightTransferEngine)
    # The model is made in the device's dtype and the updates go through the in-process "local" backend.
    fixed = dict(dtype=str(dtype).removeprefix("torch."), weight_transfer_config=WeightTransferConfig(backend="local"))
    # The core in this process: the "local" backend hands the trainer's tensors over by reference, and the benchmark
    # reads the weights, the vocabulary size and the step count off the engine core object.
    os.environ["RLSERVE_ENABLE_MULTIPROCESSING"] = "0"
    engine = AsyncLLM(str(model_dir), **{**engine_kwargs(args), **fixed})
    # The trainer's copy of the weights, on the engine's device: a full update every time.
    trainer_weights = [(name, t.clone()) for name, t in engine.engine_core.runner.model.checkpoint_weights()]
    prompts, params = workloads("W1", engine.engine_core.vocab_size, args.scale, seed=0)
    kind = RequestOutputKind.CUMULATIVE if args.stream else RequestOutputKind.FINAL_ONLY
    params = [dataclasses.replace(p, output_kind=kind) for p in params]

    async def all_runs() -> list[Run]:
        await engine.init_weight_transfer_engine(dict(init_info={}))
        await run_workload(engine, prompts, params, "none", args.every, trainer_weights)  # warm-up, untimed
        runs = []
        for mode in ("none", "keep", "keep+clear"):
            await engine.reset_prefix_cache()
            runs.append(await run_workload(engine, prompts, params, mode, args.every, trainer_weights))
            print(f"{mode}: {runs[-1].tok_s:,.0f} tok/s, {runs[-1].updates} updates", file=sys.stderr, flush=True)
        return runs

    try:
        runs = asyncio.run(all_runs())
    finally:
        engine.shutdown()
    base = runs[0].tok_s
    print(
        f"\nW5 async updates: preset={args.preset} device={args.device} prompts={len(prompts)} every={args.every} "
        f"steps, full update of {len(trainer_weights)} tensors, outputs {kind.name.lower()}"
    )
    print(f"{'mode':<11} {'out tok/s':>10} {'vs W1':>6} {'updates':>8} {'pause call ms':>15} {'paused ms':>15}")
    for r in runs:
        print(
            f"{r.mode:<11} {r.tok_s:>10,.0f} {r.tok_s / base:>6.3f} {r.updates:>8} {_stats(r.pause_call_ms):>15} "
            f"{_stats(r.paused_ms):>15}"
        )
    print("(pause call: pause_generation call -> return; paused: that call -> resume returned; median / max)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
