"""The package's layers hold: every import of an rlserve module points down (or sideways within its own package),
and no two packages import each other. Walks the source with `ast`, so imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import rlserve

# Lower layers never import higher ones. `rlserve/__init__.py` is the public facade and may import anything.
LAYERS: dict[str, int] = {
    "config": 0,
    "dtypes": 0,
    "log": 0,
    "hub": 0,
    "sampling_params": 0,
    "outputs": 0,
    "net": 0,
    "vllm_surface": 0,  # standard library only: the engine core installs it; its table names the rest as strings
    "weight_transfer": 1,
    "lora": 1,  # the adapter request and format, which the model's layers and the engine both read
    "model": 2,
    "toy": 3,  # builds models of the architectures `model` supports
    "engine": 3,
    "server": 4,
    "rl": 4,
    "ray": 4,
    "cli": 5,
    "distributed": 5,
    "vllm_cli": 6,  # `vllm serve` for the vllm surface: rlserve's command line
}
ROOT = Path(rlserve.__file__).parent


def _package_of(path: Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def _imports() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the files where that edge appears."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "__init__.py":
            continue
        source = _package_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "rlserve" and len(parts) > 1 and parts[1] != source:
                    edges.setdefault((source, parts[1]), []).append(str(path.relative_to(ROOT)))
    return edges


def test_every_package_has_a_layer():
    packages = {_package_of(p) for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py"}
    assert packages <= set(LAYERS), f"give these a layer in LAYERS: {sorted(packages - set(LAYERS))}"


def test_imports_point_down():
    upward = [
        f"{src} -> {dst} (in {', '.join(sorted(set(files)))})"
        for (src, dst), files in _imports().items()
        if LAYERS[dst] > LAYERS[src] or (LAYERS[dst] == LAYERS[src] and LAYERS[src] > 0)
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_no_import_cycles_between_packages():
    graph: dict[str, set[str]] = {}
    for src, dst in _imports():
        graph.setdefault(src, set()).add(dst)

    def on_a_cycle(package: str) -> bool:
        seen, stack = set(), list(graph.get(package, ()))
        while stack:
            current = stack.pop()
            if current == package:
                return True
            if current not in seen:
                seen.add(current)
                stack.extend(graph.get(current, ()))
        return False

    cycles = sorted(p for p in graph if on_a_cycle(p))
    assert not cycles, f"packages in an import cycle: {cycles}"


def test_front_ends_use_the_engines_public_surface():
    """server/ and rl/ drive LLM/AsyncLLM, never the core object behind them (which lives in another process)."""
    reaching = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for package in ("server", "rl")
        for path in (ROOT / package).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("engine_core", "runner", "scheduler", "kv_cache")
    ]
    assert not reaching, f"front ends reaching into the engine core: {reaching}"
