"""The RL frameworks' released packages that the tests drive `rlserve serve` with (requirements-frameworks.txt,
installed with --no-deps: their full dependencies are GPU training stacks), imported as they are: a module of such a
package is loaded from its installed file without running the package's own `__init__` (its parents' are run), which
may import the framework's trainer (tests/framework_imports.py says why and how)."""

from __future__ import annotations

import sys

import pytest
from framework_imports import import_skipping_inits, typed_dict_pydantic_accepts


def client_module(package: str, module: str):
    """`package.module` of an installed framework, `package`'s own `__init__` not run (its parents' are); skips the
    test when the framework is not installed (`pip install --no-deps -r requirements-frameworks.txt`)."""
    parent_name = package.rpartition(".")[0]
    if parent_name not in sys.modules:
        with typed_dict_pydantic_accepts():
            pytest.importorskip(parent_name, reason="pip install --no-deps -r requirements-frameworks.txt")
    return import_skipping_inits(f"{package}.{module}", [package])
