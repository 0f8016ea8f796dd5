"""The server is a front end of the engine's public surface: no CLI imports, nothing below AsyncLLM."""

from __future__ import annotations

import ast
from pathlib import Path

import rlserve.server

SERVER_FILES = sorted(Path(rlserve.server.__file__).parent.glob("*.py"))


def imported_modules(tree: ast.AST) -> set[str]:
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return modules


def test_the_server_imports_nothing_from_the_cli() -> None:
    for path in SERVER_FILES:
        assert "rlserve.cli" not in imported_modules(ast.parse(path.read_text())), path.name


def test_the_server_does_not_reach_into_the_engine_core() -> None:
    for path in SERVER_FILES:
        tree = ast.parse(path.read_text())
        assert not any(isinstance(n, ast.Attribute) and n.attr == "engine_core" for n in ast.walk(tree)), path.name
        below = {m for m in imported_modules(tree) if m.startswith(("rlserve.engine.core", "rlserve.engine.worker"))}
        assert not below, f"{path.name} imports {below}"
