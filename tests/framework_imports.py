"""Importing an RL framework's modules as they are (its released package, or its source tree at a commit) where the
packages above them import more than those modules need. Used by the tests (released_frameworks.py) and by the
processes they start (a server's worker extension, a trainer script), so no pytest here.

Two facts of those frameworks need handling at import time; neither changes their code:
- A package's `__init__` may import its trainer (trl's `experimental/async_grpo/__init__.py` imports the trainer,
  hence `datasets` and `accelerate.Accelerator`; skyrl's `backends/__init__.py` imports its backend base, hence
  `cloudpathlib` at SkyRL HEAD; its `weight_sync/__init__.py` the CUDA-IPC strategy and the trainer's config, hence
  `omegaconf`) although the modules under it import only light packages. `import_skipping_inits` loads a module with
  the `__init__` of the packages named not run: each is a bare package over its directory.
- skyrl 0.3.0 declares Requires-Python >=3.11, but its pydantic models are built on `typing.TypedDict`, which pydantic
  refuses below Python 3.12; while its modules are imported on 3.11, `typing_extensions.TypedDict` (what pydantic asks
  for there) stands in, and `typing` is restored afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import typing
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typing_extensions


@contextmanager
def typed_dict_pydantic_accepts() -> Iterator[None]:
    if sys.version_info >= (3, 12):
        yield
        return
    original = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict
    try:
        yield
    finally:
        typing.TypedDict = original


def import_skipping_inits(module: str, bare_packages: Iterable[str]) -> types.ModuleType:
    """`module`, with each of `bare_packages` (outermost first) that is not imported yet made a bare package over its
    directory, its `__init__` not run. The directory is found under the package's parent (the first on `sys.path`
    for a top-level one, whose own `__init__` is then not run either)."""
    for package in bare_packages:
        if package in sys.modules:
            continue
        parent_name, _, leaf = package.rpartition(".")
        if parent_name:
            where = Path(importlib.import_module(parent_name).__path__[0]) / leaf
        else:
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                raise ModuleNotFoundError(f"no package {package!r} on sys.path", name=package)
            where = Path(spec.submodule_search_locations[0])
        bare = types.ModuleType(package)
        bare.__path__ = [str(where)]
        sys.modules[package] = bare
    with typed_dict_pydantic_accepts():
        return importlib.import_module(module)


# skyrl's packages above the modules the tests use (its worker extension, HTTP client and weight-sync sender), loaded
# without their `__init__`.
SKYRL_PACKAGES = (
    "skyrl",
    "skyrl.backends",
    "skyrl.backends.skyrl_train",
    "skyrl.backends.skyrl_train.inference_servers",
    "skyrl.backends.skyrl_train.weight_sync",
)


def skyrl_module(module: str) -> types.ModuleType:
    """`module` of the skyrl first on sys.path (SkyRL's source at a commit, or the installed release)."""
    return import_skipping_inits(module, SKYRL_PACKAGES)
