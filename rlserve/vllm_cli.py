"""vLLM's command line as rlserve serves it, for the `vllm` import surface (`python -m vllm.entrypoints.cli.main`,
which TRL's `trl vllm-serve` runs): `serve` is `rlserve serve`, which takes `vllm serve`'s flags; vLLM's other
subcommands are refused by name."""

from __future__ import annotations

import sys

import rlserve
from rlserve.cli import main as rlserve_main
from rlserve.vllm_surface import VLLM_VERSION

__all__ = ["main"]

# vLLM 0.33.0's subcommands besides `serve` (vllm/entrypoints/cli/main.py).
OTHER_SUBCOMMANDS = (
    "chat",
    "complete",
    "launch",
    "bench",
    "collect-env",
    "download-kernels",
    "preload",
    "run-batch",
    "snapshot",
)
USAGE = "usage: vllm serve MODEL [vllm serve's flags]  (rlserve's vllm surface: `rlserve serve --help` lists them)"
EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    if command in (None, "-h", "--help"):
        print(USAGE)
        return 0 if command else EXIT_USAGE
    if command in ("-v", "--version"):
        print(f"{VLLM_VERSION} (rlserve {rlserve.__version__}'s vllm surface)")
        return 0
    if command != "serve":
        known = "vLLM's" if command in OTHER_SUBCOMMANDS else "not a vLLM"
        print(f"vllm {command}: {known} subcommand, not provided by rlserve; {USAGE}", file=sys.stderr)
        return EXIT_USAGE
    return rlserve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
