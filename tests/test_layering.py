"""The package's layers hold: every import of an rlserve module points down (or sideways within its own package),
no two packages import each other, and no modules of rlserve/ or of benchmarks/ form an import circle. Walks the source
with `ast`, so imports inside functions (and under TYPE_CHECKING) count too. And no file or function outgrows what a
reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rlserve

# Lower layers never import higher ones. `rlserve/__init__.py` is the public facade and may import anything.
LAYERS: dict[str, int] = {
    "config": 0,
    "dtypes": 0,
    "log": 0,
    "hub": 0,
    "platforms": 0,
    "sampling_params": 0,
    "outputs": 0,
    "net": 0,
    "vllm_surface": 0,  # standard library only: the engine core installs it; its table names the rest as strings
    "vllm_sdist": 0,  # standard library only: vLLM releases' source fetched for the tests and benchmarks
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
BENCHMARKS = ROOT.parent / "benchmarks"


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


def _module_name(path: Path, import_root: Path) -> str:
    parts = path.relative_to(import_root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    """The dotted names one import statement loads: `from a.b import c` names `a.b.c`, which is a module or a name
    defined in `a.b` (the caller keeps the longest prefix that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the importer's package, up level - 1 packages
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def _module_imports(tree: Path, import_root: Path) -> dict[str, set[str]]:
    """Module -> the modules of `tree` it imports, named as `import` spells them with `import_root` on sys.path
    (the repository root for rlserve/; benchmarks/ itself for its scripts, which import each other by file name).
    A package's `__init__` counts where an import names it, not for every import of a module inside it: that implicit
    edge would make each package whose `__init__` re-exports its modules read as a circle."""
    paths = {_module_name(path, import_root): path for path in tree.rglob("*.py")}
    graph: dict[str, set[str]] = {module: set() for module in paths}
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _imported_names(node, module, path.name == "__init__.py"):
                while name and name not in paths:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].add(name)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's): each holds at least one circle."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        for imported in graph[module]:
            if imported not in index:
                visit(imported)
                lowest[module] = min(lowest[module], lowest[imported])
            elif imported in stack:
                lowest[module] = min(lowest[module], index[imported])
        if lowest[module] == index[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


@pytest.mark.parametrize(
    ("tree", "import_root"), [(ROOT, ROOT.parent), (BENCHMARKS, BENCHMARKS)], ids=["rlserve", "benchmarks"]
)
def test_no_import_circles_between_modules(tree, import_root):
    circles = _circles(_module_imports(tree, import_root))
    assert not circles, "modules that import each other, directly or around a circle:\n" + "\n".join(
        " <-> ".join(circle) for circle in circles
    )


MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
# Triton kernels: one @triton.jit function is one GPU program, and splitting it would change what the compiler fuses.
KERNELS = ROOT / "model" / "kernels"


def _sources() -> list[Path]:
    return sorted(path for tree in (ROOT, BENCHMARKS) for path in tree.rglob("*.py") if KERNELS not in path.parents)


def _function_lengths(path: Path) -> list[tuple[str, int, int]]:
    """(name, first line, length in lines from `def` to its last line) of every function, nested ones included."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def test_no_file_or_function_is_oversize():
    repo = ROOT.parent
    too_long = [
        f"{path.relative_to(repo)}: {lines} lines"
        for path in _sources()
        if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    too_long += [
        f"{path.relative_to(repo)}:{line} {name}: {length} lines"
        for path in _sources()
        for name, line, length in _function_lengths(path)
        if length > MAX_FUNCTION_LINES
    ]
    limits = f"files over {MAX_FILE_LINES} lines or functions over {MAX_FUNCTION_LINES}"
    assert not too_long, f"{limits} (split them into named steps):\n" + "\n".join(too_long)


# The engine's sub-packages by the process they run in, each importing only those below it: the front end (the
# caller's process) starts and drives the core, the core (its own process) drives the ranks, a rank runs the
# scheduler's batches, and the wire is what every side agrees on. (Circles inside the engine are the test above's.)
ENGINE_LAYERS: dict[str, int] = {"wire": 0, "sched": 1, "worker": 2, "core": 3, "frontend": 4}


def _sub_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "engine" else None  # rlserve.engine.<sub-package>.<module>


def test_engine_sub_packages_import_down() -> None:
    graph = {m: targets for m, targets in _module_imports(ROOT, ROOT.parent).items() if m.startswith("rlserve.engine")}
    found = {_sub_package(m) for m in graph} - {None}
    assert found <= set(ENGINE_LAYERS), f"give these a place in ENGINE_LAYERS: {sorted(found - set(ENGINE_LAYERS))}"
    against = [
        f"{src} -> {dst}"
        for src, targets in graph.items()
        for dst in targets
        if dst.startswith("rlserve.engine")
        and _sub_package(src) != _sub_package(dst)
        and (_sub_package(src) is None or ENGINE_LAYERS[_sub_package(dst)] >= ENGINE_LAYERS[_sub_package(src)])
    ]
    assert not against, "engine imports against frontend -> core -> worker -> sched -> wire:\n" + "\n".join(against)
