"""Command line: `rlserve generate`, `rlserve serve`, `rlserve demo`, `rlserve parity`."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from rlserve.engine.args import FlagParser, add_engine_arguments, engine_kwargs
from rlserve.engine.core_proc import multiprocessing_enabled, start_fork_server


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
    parser = FlagParser(prog="rlserve", description=__doc__)  # its subcommands' parsers are FlagParsers too
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
    from rlserve.server import serve

    for module in (serve, demo, parity):
        module.register_cli(sub)
    return parser


ENGINE_COMMANDS = ("generate", "serve", "parity")


def main(argv: list[str] | None = None) -> int:
    command = (sys.argv[1:] if argv is None else argv)[:1]
    if command and command[0] in ENGINE_COMMANDS and multiprocessing_enabled():
        start_fork_server()  # its imports overlap this process's (the server's, the tokenizer's)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
