"""Pause latency across data-parallel ranks: seconds from `pause_generation(mode="keep")` to its return, against the
number of ranks N and, in lockstep, the sync interval K.

CPU:  OMP_NUM_THREADS=1 python benchmarks/dp_pause_latency.py --device cpu
GPU:  python benchmarks/dp_pause_latency.py --device cuda --ranks 1 2 --preset qwen3-0.6b-shape

For each configuration an `AsyncLLM` with N engine-core processes serves a random-weight model
(`rlserve.toy.make_model_dir`, built once, not timed). Two measurements, `--repeats` times each, median and max:
- idle: nothing runs; pause, then resume.
- busy: two greedy streams per rank run (EOS ignored, long enough to outlast the pause); once every stream has its
  first tokens, pause(keep), then resume (the streams go on), and the next repeat pauses again.
Independent ranks pause as soon as each reads the call; lockstep ranks answer once an all-gather has seen every rank
paused, which comes at the wave's next sync (every K steps) or, idle, after a wave of K dummy steps.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from rlserve import SamplingParams
from rlserve.engine.frontend.async_llm import AsyncLLM


def build_model(preset: str) -> str:
    from rlserve.toy import make_model_dir

    return str(make_model_dir(tempfile.mkdtemp(prefix="rlserve-dp-pause-"), preset=preset))


async def measure(engine: AsyncLLM, ranks: int, repeats: int) -> tuple[list[float], list[float]]:
    idle = []
    for _ in range(repeats):
        started = time.perf_counter()
        await engine.pause_generation(mode="keep")
        idle.append(time.perf_counter() - started)
        await engine.resume_generation()
    progress = [0] * (2 * ranks)

    async def stream(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        async for out in engine.generate({"prompt_token_ids": [11 + i, 3, 5]}, params, request_id=f"busy{i}"):
            progress[i] = len(out.outputs[0].token_ids)

    streams = [asyncio.create_task(stream(i)) for i in range(len(progress))]
    busy = []
    try:
        for _ in range(repeats):
            floor = list(progress)
            while any(p <= f for p, f in zip(progress, floor, strict=True)):
                await asyncio.sleep(0.005)
            started = time.perf_counter()
            await engine.pause_generation(mode="keep")
            busy.append(time.perf_counter() - started)
            await engine.resume_generation()
    finally:
        await engine.pause_generation(mode="abort")
        await asyncio.gather(*streams, return_exceptions=True)
        await engine.resume_generation()
    return idle, busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--sync-intervals", type=int, nargs="+", default=[1, 4, 32], help="K values in lockstep")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    model = build_model(args.preset)
    print("| N | mode | K | idle pause ms (median / max) | busy pause ms (median / max) |")
    print("|---|---|---|---|---|")
    for ranks in args.ranks:
        modes: list[int | None] = [None] + (list(args.sync_intervals) if ranks > 1 else [])
        for k in modes:
            lockstep = {} if k is None else {"data_parallel_lockstep": True, "data_parallel_sync_interval": k}
            engine = AsyncLLM(model, device=args.device, data_parallel_size=ranks, num_kv_blocks=256, **lockstep)
            try:
                idle, busy = asyncio.run(measure(engine, ranks, args.repeats))
            finally:
                engine.shutdown()
            cells = [f"{1000 * statistics.median(v):.1f} / {1000 * max(v):.1f}" for v in (idle, busy)]
            mode = "independent" if k is None else "lockstep"
            print(f"| {ranks} | {mode} | {k if k is not None else '–'} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
