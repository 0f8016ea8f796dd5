"""An opt-in `vllm` import surface: code written for vLLM (a framework's engine-side script, a worker extension, a
trainer's weight-sync helpers) runs on rlserve unchanged, its `import vllm...` resolving to rlserve's classes by an
explicit table (`table.py`); a vLLM module or name rlserve lacks raises ImportError / AttributeError naming it.

Opt in, per process tree:
- `rlserve run [--] COMMAND ...` runs COMMAND with the surface active in it and in every Python process it starts
  (`run.py`: RLSERVE_VLLM_SURFACE=1 and a `sitecustomize` on PYTHONPATH that installs it at interpreter start);
- RLSERVE_VLLM_SURFACE=1 in an `rlserve serve`'s environment: its engine core installs the surface before importing
  a `--worker-extension-cls`;
- `install()` in a process of one's own (and `uninstall()`).

It never shadows a real vLLM: with one importable, installing raises VllmInstalledError naming where it is.
Standard library only, so that any layer (the engine core, the interpreter's start) can install it cheaply.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rlserve.vllm_surface.finder import (
    VllmInstalledError,
    VllmNotProvidedError,
    check_no_vllm,
    install,
    is_installed,
    uninstall,
)
from rlserve.vllm_surface.table import VLLM_VERSION

__all__ = [
    "ENV_VAR",
    "active",
    "STARTUP_DIR",
    "VLLM_VERSION",
    "VllmInstalledError",
    "VllmNotProvidedError",
    "check_no_vllm",
    "install",
    "install_if_requested",
    "is_installed",
    "requested",
    "surface_environment",
    "uninstall",
]

ENV_VAR = "RLSERVE_VLLM_SURFACE"
# The directory `rlserve run` puts first on PYTHONPATH: it holds only sitecustomize.py.
STARTUP_DIR = str(Path(__file__).resolve().parent / "startup")


def requested(environ: Mapping[str, str] = os.environ) -> bool:
    value = environ.get(ENV_VAR, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_VAR}: expected 1 (install rlserve's vllm surface) or 0, got {value!r}")
    return value == "1"


def active() -> bool:
    """Whether this process runs under the surface: installed here, or asked for by its environment."""
    return is_installed() or requested()


def install_if_requested() -> bool:
    """Install the surface if RLSERVE_VLLM_SURFACE=1; whether it is installed."""
    if requested():
        install()
    return is_installed()


def surface_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a process tree with the surface on: the variable set and STARTUP_DIR first on PYTHONPATH."""
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != STARTUP_DIR]
    return {**environ, ENV_VAR: "1", "PYTHONPATH": os.pathsep.join([STARTUP_DIR, *paths])}
