"""vLLM releases' published source, from the package index, for what runs vLLM's own code against rlserve (the tests'
vLLM fixtures, benchmarks/vllm_rl_tests.py): nothing of vLLM is kept in rlserve, it is fetched when needed.

A release's sdist is fetched through the index's PEP 691 JSON listing, checked against the sha256 the index gives,
and its `vllm/**/*.py` and `tests/` unpacked once under a cache directory; the archive itself is not kept. Why the
sdist: vLLM's tests ship only there, and its Python source is whole there (the wheels carry the same files among some
300 MB of compiled kernels). Why not `pip download --no-binary`: pip builds vLLM's metadata first, which needs vLLM's
build toolchain.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

DEFAULT_INDEX = "https://pypi.org/simple"
CACHE_DIR = Path.home() / ".cache" / "rlserve" / "vllm-sdist"
LISTING_TIMEOUT_S = 60.0
DOWNLOAD_TIMEOUT_S = 600.0
_CHUNK_BYTES = 1 << 20


def index_files(project: str, index_url: str = DEFAULT_INDEX) -> list[dict[str, Any]]:
    """The files the index lists for `project` (PEP 691 JSON: each with filename, url, hashes, size)."""
    request = urllib.request.Request(
        f"{index_url.rstrip('/')}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=LISTING_TIMEOUT_S) as response:
        return json.load(response)["files"]


def is_unpacked(root: Path) -> bool:
    """Whether `root` holds a release's whole unpack (a directory appears only complete: see unpacked_sdist)."""
    return (root / "vllm" / "_version.py").is_file() and (root / "tests").is_dir()


def unpacked_sdist(version: str, cache_dir: Path = CACHE_DIR, index_url: str = DEFAULT_INDEX) -> Path:
    """`cache_dir/vllm-VERSION`, holding vLLM `version`'s `vllm/**/*.py` and `tests/`: fetched, checked and unpacked
    on first use. Raises LookupError when the index has no such sdist, ValueError when its bytes do not match the
    index's sha256, OSError when the index cannot be reached."""
    root = cache_dir / f"vllm-{version}"
    if is_unpacked(root):
        return root
    name = f"vllm-{version}.tar.gz"
    entry = next((f for f in index_files("vllm", index_url) if f["filename"] == name), None)
    if entry is None:
        raise LookupError(f"the index {index_url} has no sdist {name} (is {version} a vLLM release?)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Unpacked beside the cache entry and renamed into place whole, so that a run beside this one (another pytest,
    # the benchmark) never reads a half-unpacked tree.
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".vllm-{version}-") as scratch:
        archive = Path(scratch) / name
        _download(entry["url"], archive, entry["hashes"]["sha256"])
        _unpack(archive, f"vllm-{version}", Path(scratch))
        if root.exists() and not is_unpacked(root):  # an older cache's layout (only tests/)
            shutil.rmtree(root)
        try:
            os.rename(Path(scratch) / f"vllm-{version}", root)
        except OSError:
            if not is_unpacked(root):  # not a concurrent run that got there first
                raise
    return root


def _download(url: str, path: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response, path.open("wb") as out:
        while chunk := response.read(_CHUNK_BYTES):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        raise ValueError(f"{url}: sha256 {digest.hexdigest()} is not the index's {sha256}")


def _unpack(archive: Path, top: str, into: Path) -> None:
    """`top/vllm/**/*.py` and `top/tests/**` of the archive, in one streaming pass over it."""
    with tarfile.open(archive, "r|gz") as tar:
        for member in tar:
            wanted = member.name.startswith(f"{top}/tests/") or (
                member.name.startswith(f"{top}/vllm/") and member.name.endswith(".py")
            )
            if wanted:
                tar.extract(member, into, filter="data")
