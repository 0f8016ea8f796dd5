"""Host cost of the engine loop (scheduler, core, output processing) with the model launch replaced by an instant stub.

On the GPU this work does not overlap the forward pass, so it adds to every step; this measures it on any machine,
which makes it the CPU-side proxy to iterate on for issue 3 (W1 decodes 1,024 sequences per step).

    OMP_NUM_THREADS=1 python benchmarks/host_overhead.py --batch 1024 --output-len 128 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from rlserve import LLM, SamplingParams
from rlserve.model.runner import LaunchedStep
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
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = make_model_dir(tempfile.mkdtemp(), preset="tiny", max_position_embeddings=4096)
    blocks = args.batch * ((args.prompt_len + args.output_len) // 16 + 2)
    llm = LLM(str(model_dir), max_num_seqs=args.batch, max_num_batched_tokens=16384, num_kv_blocks=blocks)

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
    per_step = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        per_step.append((time.perf_counter() - t0) / args.output_len * 1e3)
    print(
        f"batch {args.batch}: host work per decode step {statistics.median(per_step):.1f} ms median "
        f"(min {min(per_step):.1f}, max {max(per_step):.1f}, {args.repeats} runs; "
        f"{statistics.median(per_step) * 1e3 / args.batch:.1f} us per request)"
    )


if __name__ == "__main__":
    main()
