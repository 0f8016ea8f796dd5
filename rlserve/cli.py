"""Command line: `rlserve generate`, `rlserve serve`, `rlserve demo`, `rlserve parity`."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (default: from memory)"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    parser.add_argument("--max-logprobs", type=int, default=20)
    parser.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"],
    )
    parser.add_argument("--lm-head-dtype", default=None, choices=["float32"])
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="read each step back before scheduling the next (no overlap of host and device work)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="compute every request the same way whatever the batch: logprobs equal rlserve's trainer-side forward "
        "(rlserve.rl.train_forward) bit for bit; slower",
    )
    parser.add_argument(
        "--worker-extension-cls",
        default=None,
        help="'package.module:Class' whose methods join the worker, for /collective_rpc (vLLM's option)",
    )
    parser.add_argument(
        "--weight-transfer-config",
        type=json.loads,
        default=None,
        help='JSON, e.g. \'{"backend": "nccl"}\'; enables live weight updates',
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    from rlserve.config import WeightTransferConfig

    wt = args.weight_transfer_config
    return dict(
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode,
        lm_head_dtype=args.lm_head_dtype,
        enforce_eager=args.enforce_eager,
        async_scheduling=not args.no_async_scheduling,
        # Only when asked: otherwise the default applies, or vLLM's VLLM_BATCH_INVARIANT=1 (see make_engine_config).
        **({"batch_invariant": True} if args.batch_invariant else {}),
        worker_extension_cls=args.worker_extension_cls,
        weight_transfer_config=WeightTransferConfig(**wt) if wt else None,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from rlserve import LLM, SamplingParams

    model = args.model
    if model is None:
        from rlserve.toy import make_model_dir

        model = str(make_model_dir(tempfile.mkdtemp(prefix="rlserve-toy-"), preset="small"))
        print(f"no --model given: built a small random Qwen3 model in {model}", file=sys.stderr)
    llm = LLM(model, **engine_kwargs(args))
    prompts = args.prompt or ["Hello"]
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        logprobs=args.logprobs,
        ignore_eos=args.ignore_eos,
    )
    outputs = llm.generate(prompts * args.repeat, params, use_tqdm=not args.quiet)
    for out in outputs[: len(prompts)]:
        for sample in out.outputs:
            record = dict(
                prompt=out.prompt, text=sample.text, token_ids=sample.token_ids, finish_reason=sample.finish_reason
            )
            if sample.logprobs is not None:
                record["logprobs"] = [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)]
            print(json.dumps(record))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation from the command line")
    gen.add_argument("--model", default=None, help="Hugging Face model directory (default: build a small random model)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat the flag for several)")
    gen.add_argument("--repeat", type=int, default=1, help="send the prompts this many times (a long offline run)")
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--logprobs", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    # The other commands register their own arguments.
    from rlserve.rl import demo, parity
    from rlserve.server import app

    for module in (app, demo, parity):
        module.register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
