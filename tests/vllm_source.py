"""vLLM's own source for the tests that run vLLM's code against rlserve (conftest's `vllm_source` fixture).

For a release, in this order of preference:
1. `RLSERVE_TEST_VLLM_SRC`: directories (os.pathsep-separated); the one whose `vllm/_version.py` names the release is
   its source, the others go on the path beside it (packages installed by hand with `pip install --target`);
2. the cache of rlserve/vllm_sdist.py (~/.cache/rlserve/vllm-sdist, shared with benchmarks/vllm_rl_tests.py);
3. the release's sdist fetched from the package index into that cache (vLLM 0.33.0: 47 MB, 0.24.0: 37 MB; about 1 s
   each to download and 2 s of CPU to unpack `vllm/**/*.py` and `tests/`).
Without the index (and no cache) the tests that need it skip, saying why.

vLLM's modules that the tests import (the group, the unique id, the packing, the trainer's `trainer_init`) import a
few light packages beyond torch: LIGHT_PACKAGES, all in pyproject's test extra.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from rlserve import vllm_sdist

SOURCE_ENV = "RLSERVE_TEST_VLLM_SRC"
LIGHT_PACKAGES = ("psutil", "cbor2", "aiohttp", "openai_harmony", "pybase64")


class SourceUnavailable(Exception):
    """No source for the release here: the message says why (the tests skip with it)."""


@dataclass(frozen=True)
class VllmSource:
    version: str
    root: Path  # holds the release's `vllm/` package
    beside: tuple[str, ...] = ()  # more directories for the path: the light packages where installed by hand

    @property
    def path(self) -> list[str]:
        """What goes first on sys.path (or PYTHONPATH) for `import vllm` to be this release's code."""
        return [str(self.root), *self.beside]

    def module_file(self, module: str) -> Path | None:
        """The source file of one of the release's modules (a package's __init__.py); None if it has no such one."""
        relative = self.root.joinpath(*module.split("."))
        return next((p for p in (relative.with_suffix(".py"), relative / "__init__.py") if p.is_file()), None)


def release_of(root: Path) -> str | None:
    """The vLLM release whose source `root` holds, read from its generated vllm/_version.py."""
    version_file = root / "vllm" / "_version.py"
    if not version_file.is_file():
        return None
    for line in version_file.read_text(errors="replace").splitlines():
        if line.startswith("__version__ = version = "):
            return line.rpartition("=")[2].strip().strip("'\"")
    return None


def find_vllm_source(
    version: str,
    environ: Mapping[str, str] = os.environ,
    cache_dir: Path = vllm_sdist.CACHE_DIR,
    index_url: str = vllm_sdist.DEFAULT_INDEX,
) -> VllmSource:
    """vLLM `version`'s source, by the order above; SourceUnavailable when there is none to be had."""
    missing = [name for name in LIGHT_PACKAGES if find_spec(name) is None]
    if missing:
        raise SourceUnavailable(
            f"vLLM's modules import {', '.join(missing)}: install rlserve's test extra (pip install -e '.[test]')"
        )
    given = [Path(p) for p in environ.get(SOURCE_ENV, "").split(os.pathsep) if p]
    root = next((p for p in given if release_of(p) == version), None)
    if root is not None:
        return VllmSource(version, root, tuple(str(p) for p in given if release_of(p) is None))
    try:
        return VllmSource(version, vllm_sdist.unpacked_sdist(version, cache_dir, index_url))
    except OSError as error:
        raise SourceUnavailable(
            f"vLLM {version}'s source: not in {cache_dir} and the package index {index_url} cannot be reached "
            f"({error}); or name an unpacked source in {SOURCE_ENV}"
        ) from error
