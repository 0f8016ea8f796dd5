"""Host cost of the engine loop (scheduler, core, output processing) with the model launch replaced by an instant stub.

On the GPU this work does not overlap the forward pass, so it adds to every step; this measures it on any machine,
which makes it the CPU-side proxy to iterate on for issue 3 (W1 decodes 1,024 sequences per step).

    OMP_NUM_THREADS=1 python benchmarks/host_overhead.py --batch 1024 --output-len 128 --repeats 5

`--stream` runs the requests through `AsyncLLM` as the server's streaming completions do (a DELTA output with its
text per step and request, consumed by one asyncio task each), which adds the output processor, detokenization and
the event loop to what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import torch

from rlserve import LLM, RequestOutputKind, SamplingParams
from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.engine.worker.step_outputs import LaunchedStep
from rlserve.toy import make_model_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--with-runner", action="store_true", help="include the model runner's host work (only the forward is stubbed)"
    )
    ap.add_argument("--stream", action="store_true", help="stream DELTA outputs through AsyncLLM (see above)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    max_model_len = 4096
    model_dir = make_model_dir(tempfile.mkdtemp(), preset="tiny", max_position_embeddings=max_model_len)
    # Every sequence's blocks, and at least one sequence of max_model_len (the engine refuses a smaller cache).
    blocks = max(args.batch * ((args.prompt_len + args.output_len) // 16 + 2), max_model_len // 16)
    engine_cls = AsyncLLM if args.stream else LLM
    # The core in this process: the benchmark stubs the runner's forward (or launch) on the engine core object.
    os.environ["RLSERVE_ENABLE_MULTIPROCESSING"] = "0"
    llm = engine_cls(str(model_dir), max_num_seqs=args.batch, max_num_batched_tokens=16384, num_kv_blocks=blocks)

    runner = llm.engine_core.runner
    if args.with_runner:
        # The runner's own host work (inputs, block tables, sampling settings, sampling, read-back) is real; only the
        # decoder's forward is replaced, by hidden states of zeros.
        hidden_size = runner.spec.hidden_size
        runner.model.forward = lambda ids, positions, ctx: torch.zeros(ids.shape[0], hidden_size)
    else:

        def instant_launch(scheduled, prev):  # every request that reaches its last known token samples token 1
            rows = [
                i
                for i, s in enumerate(scheduled)
                if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens
            ]
            ones = torch.ones(len(rows), dtype=torch.long)
            index = {scheduled[i].request.request_id: j for j, i in enumerate(rows)}
            return LaunchedStep(scheduled, rows, index, [], ones, ones, None, None)

        runner.launch = instant_launch
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 250, (args.prompt_len,), generator=g).tolist()} for _ in range(args.batch)
    ]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)

    async def stream_all(run: int) -> None:
        delta = SamplingParams(max_tokens=args.output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

        async def consume(i: int) -> None:
            async for _ in llm.generate(prompts[i], delta, request_id=f"{run}-{i}"):
                pass

        await asyncio.gather(*(consume(i) for i in range(len(prompts))))

    async def timed_streams() -> list[float]:  # one event loop for all runs: AsyncLLM binds to the first
        times = []
        for run in range(args.repeats):
            t0 = time.perf_counter()
            await stream_all(run)
            times.append(time.perf_counter() - t0)
        return times

    if args.stream:
        seconds = asyncio.run(timed_streams())
        llm.shutdown()
    else:
        seconds = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
    per_step = [s / args.output_len * 1e3 for s in seconds]
    print(
        f"batch {args.batch}: host work per decode step {statistics.median(per_step):.1f} ms median "
        f"(min {min(per_step):.1f}, max {max(per_step):.1f}, {args.repeats} runs; "
        f"{statistics.median(per_step) * 1e3 / args.batch:.1f} us per request)"
    )


if __name__ == "__main__":
    main()
