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


# The engine's sub-packages by the process they run in, each importing only those below it: the front end (the
# caller's process) starts and drives the core, the core (its own process) drives the ranks, a rank runs the
# scheduler's batches, and the wire is what every side agrees on.
ENGINE_LAYERS: dict[str, int] = {"wire": 0, "sched": 1, "worker": 2, "core": 3, "frontend": 4}
ENGINE = ROOT / "engine"


def _engine_module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _engine_imports() -> dict[str, set[str]]:
    """Module -> the rlserve.engine modules it imports (`from package import module` names the module)."""
    modules = {_engine_module(path): path for path in ENGINE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                names = [name if name in modules else node.module for name in names]
            else:
                continue
            targets.update(name for name in names if name in modules and name != module)
    return graph


def _sub_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 else None  # rlserve.engine.<sub-package>.<module>


def test_engine_sub_packages_import_down() -> None:
    graph = _engine_imports()
    found = {_sub_package(m) for m in graph} - {None}
    assert found <= set(ENGINE_LAYERS), f"give these a place in ENGINE_LAYERS: {sorted(found - set(ENGINE_LAYERS))}"
    against = [
        f"{src} -> {dst}"
        for src, targets in graph.items()
        for dst in targets
        if _sub_package(src) != _sub_package(dst)
        and (_sub_package(src) is None or ENGINE_LAYERS[_sub_package(dst)] >= ENGINE_LAYERS[_sub_package(src)])
    ]
    assert not against, "engine imports against frontend -> core -> worker -> sched -> wire:\n" + "\n".join(against)


def test_no_import_circles_between_engine_modules() -> None:
    graph = _engine_imports()

    def reaches(start: str, goal: str) -> bool:
        seen, stack = set(), list(graph[start])
        while stack:
            current = stack.pop()
            if current == goal:
                return True
            if current not in seen:
                seen.add(current)
                stack.extend(graph[current])
        return False

    circled = sorted(m for m in graph if reaches(m, m))
    assert not circled, f"engine modules on an import circle: {circled}"
