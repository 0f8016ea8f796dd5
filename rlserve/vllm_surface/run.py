"""`rlserve run [--] COMMAND ...`: COMMAND in place of this process (exec: same pid, signals and exit status), with
rlserve's vllm surface active in it and in every Python process it starts."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping

from rlserve.vllm_surface import ENV_VAR, VllmInstalledError, check_no_vllm, surface_environment

DESCRIPTION = (
    "Run COMMAND with `import vllm...` resolving to rlserve (its vllm import surface) in it and in every Python "
    f"process it starts ({ENV_VAR}=1 and a sitecustomize on PYTHONPATH), e.g. `rlserve run trl vllm-serve --model "
    "DIR` or `rlserve run vllm serve DIR` (without a `vllm` on PATH: vLLM's command line as the surface provides it, "
    "`python -m vllm.entrypoints.cli.main`). Refused while a real vLLM is importable."
)
EXIT_USAGE = 2
# The shell's statuses for a command it cannot find, and for one it cannot execute.
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments")


def resolve_command(command: list[str], environ: Mapping[str, str]) -> list[str]:
    """`vllm ...` where no `vllm` executable is on PATH: the surface's `vllm` on this interpreter, so that the
    command lines vLLM's and the frameworks' docs give (TRL's `trl vllm-serve` prints one) run as written."""
    if command[0] == "vllm" and shutil.which("vllm", path=environ.get("PATH")) is None:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", *command[1:]]
    return command


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("rlserve run: no COMMAND given (usage: rlserve run [--] COMMAND [ARG ...])", file=sys.stderr)
        return EXIT_USAGE
    try:
        check_no_vllm()
    except VllmInstalledError as e:
        print(f"rlserve run: {e}", file=sys.stderr)
        return EXIT_USAGE
    command = resolve_command(command, os.environ)
    try:
        os.execvpe(command[0], command, surface_environment(os.environ))
    except OSError as e:
        print(f"rlserve run: {command[0]}: {e.strerror or e}", file=sys.stderr)
        return EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_NOT_EXECUTABLE


def main(argv: list[str]) -> int:
    """The command on its own, without the rest of rlserve's command line (whose parser imports the engine)."""
    parser = argparse.ArgumentParser(prog="rlserve run", description=DESCRIPTION)
    add_arguments(parser)
    return cmd_run(parser.parse_args(argv))


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run", help="run a command with `vllm` imports resolving to rlserve", description=DESCRIPTION
    )
    add_arguments(parser)
    parser.set_defaults(func=cmd_run)
