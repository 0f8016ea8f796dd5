"""Run by Python's `site` at the start of every interpreter with this directory on its path, which `rlserve run` puts
first on PYTHONPATH: with RLSERVE_VLLM_SURFACE=1 it installs rlserve's vllm surface before any user code runs, in
the command and in every Python process below it (subprocesses, multiprocessing's spawn and forkserver children)
that inherits the environment. An error here (a real vLLM installed) is printed by `site`, and that interpreter
runs without the surface.

It then runs the `sitecustomize` this one hides, if any: the next on the path."""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_hidden_sitecustomize() -> None:
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _install() -> None:
    if importlib.util.find_spec("rlserve") is None:
        # A command whose interpreter does not find rlserve by itself (a script run from another directory than a
        # source tree's): this file's own tree provides it, last on the path so it overrides nothing.
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))
    from rlserve.vllm_surface import install_if_requested

    install_if_requested()


try:
    _install()
finally:
    _run_hidden_sitecustomize()
