"""vLLM's own pydantic response models, from a vLLM release's wheel on the package index, loaded without installing
vLLM (its package imports torch's CUDA stack, its compiled extension and some hundred other packages).

How, and why this way:

- **Only the needed files, read out of the published wheel.** A wheel is a zip archive; its central directory sits at
  the end, so HTTP range requests read the directory and then each wanted member (about 0.5 MB of directory and a few
  tens of kB per file, where the whole wheel is 270-340 MB). `zipfile` checks each member's CRC-32 as it reads it.
  The files land in a cache directory (`~/.cache/rlserve/vllm-wheel/VERSION/`), so a second run reads nothing.
- **Only the class definitions and what they reference, executed as vLLM wrote them.** For a requested name, the
  module's top-level statements are indexed by the names they bind; the statement that binds the name is kept, then
  every top-level statement binding a name it references (in class bodies, annotations, defaults, validators), and so
  on. `from vllm.X import Y` is followed into X's file the same way; any other import runs as written (pydantic,
  typing, openai's types). The kept statements run, in source order, in one namespace per module, so the classes are
  vLLM's own: their fields, types, defaults, `extra` policy and validators.
- **Nothing is stood in for.** Statements that bind only names nothing kept reads (the request models and their
  vLLM-internal imports: `vllm.config`, `SamplingParams`, the renderers, ...) are never run. A name asked for that the
  module does not bind is a `LookupError` naming both; a name a kept statement reads that its module does not bind is
  left to Python (a builtin, a local, else a `NameError` when it runs); `if TYPE_CHECKING:` blocks are not run.
"""

from __future__ import annotations

import ast
import io
import sys
import types
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlserve.vllm_sdist import DEFAULT_INDEX, index_files

CACHE_DIR = Path.home() / ".cache" / "rlserve" / "vllm-wheel"
HTTP_TIMEOUT_S = 60.0
READ_CHUNK = 1 << 20  # one range request reads at least this much: the central directory comes in one or two


class _HTTPRangeFile(io.RawIOBase):
    """A seekable read-only view of a remote file, each read one HTTP range request."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.position = url, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def readinto(self, buffer: Any) -> int:
        wanted = min(len(buffer), self.size - self.position)
        if wanted <= 0:
            return 0
        byte_range = f"bytes={self.position}-{self.position + wanted - 1}"
        request = urllib.request.Request(self.url, headers={"Range": byte_range})
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            if response.status != 206:
                raise OSError(f"{self.url}: the server answered {response.status} to a range request, not 206")
            data = response.read()
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


def _wheel_url(version: str, index_url: str) -> tuple[str, int]:
    """The URL and size of vLLM `version`'s wheel (any platform's: the Python files are the same in each)."""
    files = index_files("vllm", index_url)
    prefix = f"vllm-{version}-cp"  # no build tag: the release's first upload
    wheel = next((f for f in files if f["filename"].startswith(prefix) and f["filename"].endswith(".whl")), None)
    if wheel is None:
        raise LookupError(f"the index {index_url} has no wheel of vllm {version}")
    return wheel["url"], wheel["size"]


@dataclass
class ReleaseFiles:
    """vLLM `version`'s Python files, read from its wheel on first use and kept under `cache_dir`."""

    version: str
    cache_dir: Path = CACHE_DIR
    index_url: str = DEFAULT_INDEX
    _wheel: zipfile.ZipFile | None = field(default=None, init=False, repr=False)

    def module_source(self, module: str) -> tuple[str, bool]:
        """The source of a `vllm...` module (its .py file, or its package's __init__.py), and whether it is a
        package."""
        base = module.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            cached = self.cache_dir / self.version / path
            if cached.is_file():
                return cached.read_text(), path.endswith("__init__.py")
        wheel = self._open_wheel()
        names = set(wheel.namelist())
        path = next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in names), None)
        if path is None:
            raise LookupError(f"vllm {self.version} has no module {module}")
        source = wheel.read(path)
        cached = self.cache_dir / self.version / path
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".part")
        partial.write_bytes(source)
        partial.replace(cached)  # whole files only: another run may read the cache at the same time
        return source.decode(), path.endswith("__init__.py")

    def _open_wheel(self) -> zipfile.ZipFile:
        if self._wheel is None:
            url, size = _wheel_url(self.version, self.index_url)
            self._wheel = zipfile.ZipFile(io.BufferedReader(_HTTPRangeFile(url, size), READ_CHUNK))
        return self._wheel


def _is_type_checking_block(statement: ast.stmt) -> bool:
    test = statement.test if isinstance(statement, ast.If) else None
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _bound_names(statement: ast.stmt) -> set[str]:
    """The module-level names a top-level statement binds."""
    if isinstance(statement, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return {statement.name}
    if isinstance(statement, ast.Import | ast.ImportFrom):
        return {(alias.asname or alias.name).split(".")[0] for alias in statement.names}
    if isinstance(statement, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        return {node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)}
    if isinstance(statement, ast.If | ast.Try) and not _is_type_checking_block(statement):
        return {name for inner in ast.iter_child_nodes(statement) if isinstance(inner, ast.stmt)
                for name in _bound_names(inner)}  # fmt: skip
    return set()


def _referenced_names(statement: ast.stmt) -> set[str]:
    """Every name a statement reads, in its class body, annotations, defaults and function bodies (a function's own
    locals included: they are dropped by the caller when the module does not bind them)."""
    names = {node.id for node in ast.walk(statement) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    # String annotations ("CompletionLogProbs | None"): pydantic evaluates them in the module's namespace. A string
    # that is prose (a description) fails to parse or names nothing the module binds, and costs nothing.
    for node in ast.walk(statement):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                expression = ast.parse(node.value, mode="eval")
            except SyntaxError:
                continue
            names |= {n.id for n in ast.walk(expression) if isinstance(n, ast.Name)}
    return names


@dataclass
class _Module:
    """One vLLM module, partly executed: the statements run so far, in one namespace."""

    name: str
    package: str  # what its relative imports start from
    statements: list[ast.stmt]
    binders: dict[str, list[int]]  # name -> indices of the top-level statements binding it
    namespace: dict[str, Any]
    executed: set[int] = field(default_factory=set)


class ReleaseProtocol:
    """Names from vLLM `version`'s modules, each built from its module's AST as described above."""

    def __init__(self, files: ReleaseFiles) -> None:
        self.files = files
        self._modules: dict[str, _Module] = {}

    @property
    def module_prefix(self) -> str:
        return "vllm_release_" + self.files.version.replace(".", "_")

    def close(self) -> None:
        """Drop this release's modules from sys.modules."""
        for module in self._modules:
            sys.modules.pop(f"{self.module_prefix}.{module}", None)
        self._modules.clear()

    def get(self, module: str, name: str) -> Any:
        """`from module import name`, run from the release's source: the name's definition and what it needs."""
        loaded = self._module(module)
        if name not in loaded.binders:
            raise LookupError(f"vllm {self.files.version}: {module} binds no top-level name {name!r}")
        self._run(loaded, *self._closure(loaded, {name}))
        return loaded.namespace[name]

    def _module(self, module: str) -> _Module:
        if module not in self._modules:
            source, is_package = self.files.module_source(module)
            tree = ast.parse(source, filename=f"vllm-{self.files.version}/{module}")
            package = module if is_package else module.rpartition(".")[0]
            binders: dict[str, list[int]] = {}
            for index, statement in enumerate(tree.body):
                bound = _bound_names(statement)
                if isinstance(statement, ast.ImportFrom) and statement.names[0].name == "*":
                    bound = self._exported(_import_source(package, statement))
                for name in bound:
                    binders.setdefault(name, []).append(index)
            # A module object in sys.modules: dataclasses and pydantic resolve string annotations through
            # sys.modules[cls.__module__]. Its name says which release it holds; close() removes it.
            loaded = types.ModuleType(f"{self.module_prefix}.{module}")
            sys.modules[loaded.__name__] = loaded
            self._modules[module] = _Module(module, package, tree.body, binders, loaded.__dict__)
        return self._modules[module]

    def _exported(self, module: str) -> set[str]:
        """What `from module import *` binds: its `__all__` where it lists it, else its public top-level names."""
        loaded = self._module(module)
        for index in loaded.binders.get("__all__", ()):
            statement = loaded.statements[index]
            if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.List | ast.Tuple):
                return {element.value for element in statement.value.elts if isinstance(element, ast.Constant)}
        return {name for name in loaded.binders if not name.startswith("_")}

    def _closure(self, module: _Module, names: set[str]) -> tuple[set[int], set[str]]:
        """The statements binding `names` and, transitively, every module-level name they read: their indices, and
        the names they were kept for."""
        wanted: set[int] = set()
        needed, pending = set(names), list(names)
        while pending:
            for index in module.binders.get(pending.pop(), ()):
                if index in wanted:
                    continue
                wanted.add(index)
                new = {n for n in _referenced_names(module.statements[index]) if n in module.binders} - needed
                needed |= new
                pending += new
        future = {
            i for i, s in enumerate(module.statements) if isinstance(s, ast.ImportFrom) and s.module == "__future__"
        }
        return wanted | future, needed

    def _run(self, module: _Module, indices: set[int], needed: set[str]) -> None:
        filename = f"vllm-{self.files.version}/{module.name}"
        for index in sorted(indices):
            statement = module.statements[index]
            if isinstance(statement, ast.ImportFrom) and _is_vllm(statement):
                self._import_from_vllm(module, statement, needed)  # only the names kept statements read
                continue
            if index in module.executed:
                continue
            module.executed.add(index)
            code = compile(ast.Module(body=[statement], type_ignores=[]), filename, "exec")
            exec(code, module.namespace)  # noqa: S102 - vLLM's own statement: what this loader is for

    def _import_from_vllm(self, module: _Module, statement: ast.ImportFrom, needed: set[str]) -> None:
        source = _import_source(module.package, statement)
        if statement.names[0].name == "*":
            names = {name: name for name in self._exported(source)}
        else:
            names = {alias.asname or alias.name: alias.name for alias in statement.names}
        for bound, name in names.items():
            if bound in needed and bound not in module.namespace:
                module.namespace[bound] = self.get(source, name)


def _is_vllm(statement: ast.ImportFrom) -> bool:
    return statement.level > 0 or (statement.module or "").split(".")[0] == "vllm"


def _import_source(package: str, statement: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` statement of a module in `package` reads."""
    if not statement.level:
        return statement.module or ""
    parts = package.split(".")
    parts = parts[: len(parts) - (statement.level - 1)]
    return ".".join([*parts, *filter(None, [statement.module])])
