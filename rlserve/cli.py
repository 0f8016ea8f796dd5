"""rlserve: an LLM inference engine for RL post-training. `rlserve demo` shows it at work (async GRPO on a model it
builds, nothing downloaded); `rlserve COMMAND --help` describes each command."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from rlserve import __version__
from rlserve.engine.frontend.args import FlagParser, add_engine_arguments, engine_kwargs
from rlserve.engine.frontend.launcher import multiprocessing_enabled, start_fork_server, stop_fork_server
from rlserve.hub import ModelNotFoundError


def _quiet_model_saving() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar for writing one small file is noise


def cmd_generate(args: argparse.Namespace) -> int:
    if args.model is not None:
        return _generate(args, args.model)
    from rlserve.toy import make_model_dir

    _quiet_model_saving()
    with tempfile.TemporaryDirectory(prefix="rlserve-toy-") as workdir:  # removed on the way out, as every run's
        model = str(make_model_dir(workdir, preset="small"))
        print(f"no --model given: built a small random Qwen3 model in {model} (removed at exit)", file=sys.stderr)
        return _generate(args, model)


def _generate(args: argparse.Namespace, model: str) -> int:
    from rlserve import LLM, SamplingParams

    llm = LLM(model, **engine_kwargs(args))
    try:
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
    finally:
        llm.shutdown()
    for out in outputs[: len(prompts)]:
        for sample in out.outputs:
            record = dict(
                prompt=out.prompt, text=sample.text, token_ids=sample.token_ids, finish_reason=sample.finish_reason
            )
            if sample.logprobs is not None:
                record["logprobs"] = [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)]
                # vLLM's dicts hold the sampled token and the N most likely, each with its rank: the N, by rank.
                record["top_logprobs"] = [
                    [
                        dict(token_id=t, token=lp.decoded_token, logprob=lp.logprob)
                        for t, lp in sorted(position.items(), key=lambda item: item[1].rank)
                        if lp.rank <= args.logprobs
                    ]
                    for position in sample.logprobs
                ]
            print(json.dumps(record))
    return 0


def cmd_toy_model(args: argparse.Namespace) -> int:
    from rlserve.toy import make_model_dir, preset_architecture

    _quiet_model_saving()
    try:
        path = make_model_dir(args.dir, args.architecture, preset=args.preset, seed=args.seed)
    except ValueError as e:
        print(f"rlserve toy-model: {e}", file=sys.stderr)
        return 2
    architecture = args.architecture or preset_architecture(args.preset)
    print(f"wrote a random {architecture} ({args.preset}) with a byte-level tokenizer to {path}")
    print(f"try: rlserve generate --model {path} --prompt Hello   or   rlserve serve {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="rlserve", description=__doc__)  # its subcommands' parsers are FlagParsers too
    parser.add_argument("--version", action="version", version=f"rlserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="offline generation from the command line")
    gen.add_argument(
        "--model", default=None, help="model directory or Hugging Face hub id (default: build a small random model)"
    )
    gen.add_argument("--prompt", action="append", help="a prompt; repeat the flag for several (default: Hello)")
    gen.add_argument("--repeat", type=int, default=1, help="send the prompts this many times (a long offline run)")
    gen.add_argument("--n", type=int, default=1, help="samples per prompt")
    gen.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set with this mass")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: all)")
    gen.add_argument("--max-tokens", type=int, default=32, help="most tokens sampled per sample")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of the requests (default: none, random)")
    gen.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="print each sampled token's logprob and the N most likely tokens' (default: none)",
    )
    gen.add_argument("--ignore-eos", action="store_true", help="keep sampling past the end-of-text token")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    # Imported here, not at the top: the toy module brings torch and transformers (seconds), and an engine command
    # starts its fork server before the parser is built so that those imports overlap the fork server's.
    from rlserve.model.models import SUPPORTED_ARCHITECTURES
    from rlserve.toy import PRESETS

    toy = sub.add_parser(
        "toy-model",
        help="write a small random model directory (rlserve.toy): a model to serve without downloading one",
        description="A randomly initialised model with a byte-level tokenizer, saved as a Hugging Face checkpoint "
        "(config.json, safetensors, tokenizer): every command takes it as a model. It generates noise, but fast.",
    )
    toy.add_argument("dir", help="directory to write (created if missing)")
    toy.add_argument("--preset", default="small", choices=list(PRESETS), help="model shape (rlserve.toy.PRESETS)")
    toy.add_argument(
        "--architecture",
        default=None,
        choices=list(SUPPORTED_ARCHITECTURES),
        help="model class (default: the preset's: Qwen3MoeForCausalLM for the -moe presets, else Qwen3ForCausalLM)",
    )
    toy.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    toy.set_defaults(func=cmd_toy_model)

    # The other commands register their own arguments.
    from rlserve.rl import demo, parity_report
    from rlserve.server import serve
    from rlserve.vllm_surface import run

    for module in (serve, demo, parity_report, run):
        module.register_cli(sub)
    return parser


ENGINE_COMMANDS = ("generate", "serve", "parity")


def main(argv: list[str] | None = None) -> int:
    command = (sys.argv[1:] if argv is None else argv)[:1]
    if command == ["run"]:  # parsed on its own: building the whole parser imports the engine, which it does not need
        from rlserve.vllm_surface import run

        return run.main((sys.argv[1:] if argv is None else argv)[1:])
    # Its imports overlap this process's (the server's, the tokenizer's); every core has stopped when the command
    # returns, and the fork server with them (if this call started it).
    started = command and command[0] in ENGINE_COMMANDS and multiprocessing_enabled() and start_fork_server()
    try:
        return _run(argv)
    finally:
        if started:
            stop_fork_server()


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except ModelNotFoundError as e:  # a wrong name or path: the message says what to do, a traceback would not
        print(f"rlserve {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
