"""Cost of the output processor (token bookkeeping, detokenization, logprob entries, RequestOutput building): the
event-loop work of AsyncLLM and the server.

    python benchmarks/output_processing.py --batch 1024 --steps 60

Streaming (DELTA, CUMULATIVE): each step hands the processor one new token for every request, as the engine core does
at batch `--batch`. Final-only with logprobs (an RL rollout's usual ask): one output per request carrying all
`--steps` tokens with the sampled token's logprob, as the core hands over a finished final-only request.
"""

from __future__ import annotations

import argparse
import time

from rlserve.engine.frontend.output_processor import OutputProcessor
from rlserve.engine.wire.messages import EngineCoreOutput
from rlserve.sampling_params import RequestOutputKind, SamplingParams
from rlserve.toy import make_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    tokenizer = make_tokenizer()
    text = tokenizer("Streaming text, word after word; some of it 日本語 and 🎉. " * 8).input_ids
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(max_tokens=args.steps + 1, output_kind=kind)
        ids = [c for i in range(args.batch) for c, _ in processor.add_request(f"r{i}", None, [1, 2, 3], params)]
        steps = [
            [EngineCoreOutput(rid, [text[s % len(text)]], [None], None, "0") for rid in ids] for s in range(args.steps)
        ]
        t0 = time.perf_counter()
        for outputs in steps:
            processor.process(outputs)
        per_step = (time.perf_counter() - t0) / args.steps
        print(
            f"{kind.name.lower():<10} batch {args.batch}: {per_step * 1e3:.2f} ms per step, "
            f"{per_step / args.batch * 1e6:.2f} us per output"
        )
    for run in ("first", "again"):  # the first pays one-time costs (token texts, lazy imports)
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(max_tokens=args.steps, logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
        ids = [c for i in range(args.batch) for c, _ in processor.add_request(f"r{i}", None, [1, 2, 3], params)]
        tokens = [text[s % len(text)] for s in range(args.steps)]
        finished = [
            EngineCoreOutput(rid, tokens, [([], [], -1.5, 3)] * len(tokens), None, "0", finish_reason="length")
            for rid in ids
        ]
        t0 = time.perf_counter()
        processor.process(finished)
        seconds = time.perf_counter() - t0
        print(
            f"final-only with logprobs ({run}), {args.batch} x {args.steps} tokens: {seconds * 1e3:.1f} ms, "
            f"{seconds / (args.batch * args.steps) * 1e6:.2f} us per token"
        )


if __name__ == "__main__":
    main()
