"""The meta-path finder that resolves `vllm` and `vllm.<path>` to rlserve by `table.MODULES`.

Each vLLM module is a module object of its own (named `vllm.<path>`), whose names resolve on first access to the
rlserve objects the table gives: the objects are rlserve's, so `isinstance`, pickling (by rlserve's module names) and
identity work across code that imports either name.

Every module it makes is a package (an empty `__path__`), except the `Entry` ones that `python -m` runs: for
`from vllm.x import Name`, CPython imports `vllm.x.Name` as a submodule when `Name` is not an attribute, which
reaches this finder, and the finder's error names the vLLM API. On a plain module, CPython's own message ("cannot
import name ... (unknown location)") would replace it. That error is a ModuleNotFoundError, as a missing optional
module is (`except ModuleNotFoundError` fallbacks work), whose `name` is None: with the missing path there, the
import system would take it for the absent submodule of a `from` import and replace the message all the same.

A name set on a vLLM module from outside (a test's `monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", ...)`)
is set wherever rlserve's modules bind the object it replaces, so rlserve's code, which looks it up as a global of its
own module, calls the replacement, as vLLM's code would (`_SurfaceModule`). The spec of a module the table maps to an
rlserve module names that module's file as its origin.

The finder goes last on `sys.meta_path`: a real vLLM that appears on `sys.path` later wins over it rather than being
shadowed (and `install` refuses while one is importable).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlserve.vllm_surface.table import MODULES, PACKAGES, VLLM_VERSION, Entry, Refused

_TABLE_NOTE = (
    f"rlserve's vllm import surface provides vLLM {VLLM_VERSION}'s names listed in rlserve/vllm_surface/table.py"
)


class VllmNotProvidedError(ModuleNotFoundError):
    """A vLLM module or name that rlserve does not provide, imported through the surface."""


class VllmInstalledError(RuntimeError):
    """A real vLLM is importable: the surface would shadow it."""


def not_provided(api: str) -> str:
    return f"{api}: rlserve does not provide this vLLM API ({_TABLE_NOTE})"


def _resolve(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _refused_class(module: str, name: str, why: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{module}.{name}: {why}")

    return type(name, (), {"__init__": __init__, "__module__": module, "__doc__": f"Not provided by rlserve: {why}"})


class _Names:
    """The names of one vLLM module and how each resolves."""

    def __init__(self, path: str) -> None:
        self.path = path
        mapping = MODULES.get(path, {})
        if isinstance(mapping, Entry):
            mapping = mapping.module
        self.target_module = mapping if isinstance(mapping, str) else None
        self.targets: dict[str, str | Refused] = mapping if isinstance(mapping, dict) else {}

    def public(self) -> list[str]:
        if self.target_module is not None:
            return list(getattr(importlib.import_module(self.target_module), "__all__", ()))
        return list(self.targets)

    def resolve(self, name: str) -> Any:
        if self.target_module is not None:
            module = importlib.import_module(self.target_module)
            if name in getattr(module, "__all__", ()):
                return getattr(module, name)
            lazy = vars(module).get("__getattr__")  # names the module provides on demand (PEP 562)
            if lazy is not None:
                try:
                    return lazy(name)
                except AttributeError:
                    pass
            raise AttributeError(not_provided(f"{self.path}.{name}"), name=name, obj=module)
        target = self.targets.get(name)
        if target is None:
            raise AttributeError(not_provided(f"{self.path}.{name}"))
        if isinstance(target, Refused):
            return _refused_class(self.path, name, target.why)
        return _resolve(target)


class _SurfaceModule(types.ModuleType):
    """A vLLM module of the surface: setting one of its names rebinds, in every rlserve module, the names bound to
    the object it replaces (and setting it back restores them), so a patch reaches the code that uses the name."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("__"):
            try:
                replaced = getattr(self, name)
            except AttributeError:
                replaced = _UNSET
            if replaced is not _UNSET:
                _rebind_in_rlserve(name, replaced, value)
        super().__setattr__(name, value)


_UNSET = object()


def _rebind_in_rlserve(name: str, replaced: Any, value: Any) -> None:
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".", 1)[0] == "rlserve" and vars(module).get(name, _UNSET) is replaced:
            setattr(module, name, value)


def _populate(module: types.ModuleType, names: _Names) -> None:
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # the import system's and tools' probes (__file__, __wrapped__...)
            raise AttributeError(f"module {names.path!r} has no attribute {name!r}")
        value = names.resolve(name)
        vars(module)[name] = value  # later lookups find it without this function (not a patch: no rebinding)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *names.public()})

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    module.__dir__ = __dir__  # type: ignore[method-assign]
    if names.targets or names.target_module is not None:
        module.__all__ = names.public()
    if names.path == "vllm":
        module.__version__ = VLLM_VERSION


class VllmSurfaceDistribution(importlib.metadata.Distribution):
    """The `vllm` distribution as `importlib.metadata` reports it while the surface is installed: frameworks gate
    their vLLM code on `importlib.metadata.version("vllm")` (verl refuses to load its vLLM rollout without one), and
    this answers the surface's VLLM_VERSION. It has no files and no entry points."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\nSummary: {_TABLE_NOTE}\n"
        return None

    def locate_file(self, path: str | os.PathLike[str]) -> Path:
        raise FileNotFoundError(f"{path}: rlserve's vllm surface installs no files")


class VllmSurfaceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the table's vLLM modules; refuses, by name, any other `vllm.*` import. Also the finder of
    the `vllm` distribution's metadata (`VllmSurfaceDistribution`)."""

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> list[importlib.metadata.Distribution]:
        name = context.name if context is not None else None
        if name is None or re.sub(r"[-_.]+", "_", name).lower() == "vllm":
            return [VllmSurfaceDistribution()]
        return []

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        if isinstance(MODULES.get(fullname), Entry):
            return importlib.machinery.ModuleSpec(fullname, self, origin=f"rlserve vllm surface: {fullname}")
        if fullname in MODULES or fullname in PACKAGES:
            spec = importlib.machinery.ModuleSpec(fullname, self, origin=_origin(fullname), is_package=True)
            spec.submodule_search_locations = []
            return spec
        raise VllmNotProvidedError(not_provided(fullname))

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _SurfaceModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        _populate(module, _Names(module.__name__))

    def get_code(self, fullname: str) -> types.CodeType | None:
        """`python -m vllm.<entry>`: runpy runs this code as `__main__`, the rlserve module's own."""
        entry = MODULES.get(fullname)
        if not isinstance(entry, Entry):
            return None
        spec = importlib.util.find_spec(entry.module)
        if spec is None or not isinstance(spec.loader, importlib.abc.InspectLoader):
            raise ImportError(f"{fullname}: its rlserve module {entry.module} cannot be found", name=fullname)
        return spec.loader.get_code(entry.module)

    def is_package(self, fullname: str) -> bool:
        return not isinstance(MODULES.get(fullname), Entry)


def _origin(fullname: str) -> str | None:
    """The file of the rlserve module the table maps `fullname` to (found, not imported), else None."""
    target = MODULES.get(fullname)
    if not isinstance(target, str):
        return None
    spec = importlib.util.find_spec(target)
    return spec.origin if spec is not None else None


_FINDER = VllmSurfaceFinder()


def is_installed() -> bool:
    return any(isinstance(finder, VllmSurfaceFinder) for finder in sys.meta_path)


def check_no_vllm() -> None:
    """Raise VllmInstalledError if a real vLLM is imported or importable (checked while the surface is not
    installed in this interpreter)."""
    loaded = sys.modules.get("vllm")
    if loaded is not None and not isinstance(getattr(loaded, "__loader__", None), VllmSurfaceFinder):
        raise VllmInstalledError(
            f"vllm is already imported here (from {getattr(loaded, '__file__', None) or loaded!r}): rlserve's vllm "
            "surface would shadow it. Run without the surface (unset RLSERVE_VLLM_SURFACE) to use that vLLM"
        )
    if is_installed():
        return
    spec = importlib.util.find_spec("vllm")
    if spec is not None:
        where = spec.origin or ", ".join(spec.submodule_search_locations or ()) or repr(spec.loader)
        raise VllmInstalledError(
            f"a vllm package is importable here ({where}): rlserve's vllm surface would shadow it. Uninstall it "
            "(or take it off sys.path) to run this code on rlserve, or run without the surface to use that vLLM"
        )


def install() -> None:
    """Resolve `vllm` imports to rlserve in this interpreter from now on (idempotent). Raises VllmInstalledError if
    a real vLLM is importable."""
    check_no_vllm()
    if not is_installed():
        sys.meta_path.append(_FINDER)


def uninstall() -> None:
    """Undo `install`: the finder leaves `sys.meta_path` and the surface's modules leave `sys.modules` (objects
    already imported from them stay what they are: rlserve's)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, VllmSurfaceFinder)]
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        if isinstance(getattr(sys.modules[name], "__loader__", None), VllmSurfaceFinder):
            del sys.modules[name]
