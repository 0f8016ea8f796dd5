"""The RL frameworks' released packages that the tests drive `rlserve serve` with (requirements-frameworks.txt,
installed with --no-deps: their full dependencies are GPU training stacks), imported as they are.

Two facts of those releases need handling at import time; neither changes their code:
- A package's `__init__` may import its trainer (trl's `experimental/async_grpo/__init__.py` imports the trainer,
  hence `datasets` and `accelerate.Accelerator`; skyrl's `weight_sync/__init__.py` imports its CUDA-IPC strategy and
  the trainer's config, hence `omegaconf`) although the client modules under it import only light packages (the test
  extra has them). `client_module` loads a module of such a package from its installed file without running the
  package's `__init__`.
- skyrl 0.3.0 declares Requires-Python >=3.11, but its pydantic models are built on `typing.TypedDict`, which pydantic
  refuses below Python 3.12; while its modules are imported on 3.11, `typing_extensions.TypedDict` (what pydantic asks
  for there) stands in, and `typing` is restored afterwards.
"""

from __future__ import annotations

import importlib
import sys
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import typing_extensions


@contextmanager
def _typed_dict_pydantic_accepts() -> Iterator[None]:
    if sys.version_info >= (3, 12):
        yield
        return
    original = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict
    try:
        yield
    finally:
        typing.TypedDict = original


def client_module(package: str, module: str) -> types.ModuleType:
    """`package.module` of an installed framework, `package`'s own `__init__` not run (its parents' are); skips the
    test when the framework is not installed (`pip install --no-deps -r requirements-frameworks.txt`)."""
    parent_name, _, leaf = package.rpartition(".")
    with _typed_dict_pydantic_accepts():
        parent = pytest.importorskip(parent_name, reason="pip install --no-deps -r requirements-frameworks.txt")
        if package not in sys.modules:
            stand_in = types.ModuleType(package)
            stand_in.__path__ = [str(Path(parent.__path__[0]) / leaf)]
            sys.modules[package] = stand_in
        return importlib.import_module(f"{package}.{module}")
