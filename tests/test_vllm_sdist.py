"""Where the tests' vLLM source comes from (tests/vllm_source.py over rlserve/vllm_sdist.py), against a package index
served on 127.0.0.1: the sdist fetched through the PEP 691 listing, checked against its sha256, only `vllm/**/*.py`
and `tests/` unpacked, once; RLSERVE_TEST_VLLM_SRC first; a clear reason when nothing can be had."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from vllm_source import SOURCE_ENV, SourceUnavailable, find_vllm_source

from rlserve.engine.wire.process import free_port
from rlserve.vllm_sdist import is_unpacked, unpacked_sdist

VERSION = "9.9.9"
SDIST = f"vllm-{VERSION}.tar.gz"


def _version_file(version: str) -> bytes:
    return f"__version__ = version = '{version}'\n".encode()


def _sdist() -> bytes:
    members = {
        "vllm/_version.py": _version_file(VERSION),
        "vllm/distributed/utils.py": b"class StatelessProcessGroup: ...\n",
        "vllm/distributed/kernel.cu": b"// not Python: left out\n",
        "tests/test_rl.py": b"def test_rl(): ...\n",
        "tests/data.json": b"{}\n",
        "docs/index.md": b"left out\n",
    }
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"vllm-{VERSION}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@dataclass
class Index:
    url: str
    sha256: str
    requests: list[str] = field(default_factory=list)
    downloads_wait_for: threading.Barrier | None = None  # the archive is sent once this many downloads asked for it


@pytest.fixture
def index() -> Iterator[Index]:
    """An index listing one vLLM sdist; `sha256` is what its listing says (a test may change it)."""
    archive = _sdist()
    port = free_port()
    served = Index(f"http://127.0.0.1:{port}/simple", hashlib.sha256(archive).hexdigest())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            served.requests.append(self.path)
            if self.path == "/simple/vllm/":
                url = f"http://127.0.0.1:{port}/files/{SDIST}"
                body = json.dumps({"files": [{"filename": SDIST, "url": url, "hashes": {"sha256": served.sha256}}]})
                self._answer(body.encode(), "application/vnd.pypi.simple.v1+json")
            elif self.path == f"/files/{SDIST}":
                if served.downloads_wait_for is not None:
                    served.downloads_wait_for.wait(timeout=30)
                self._answer(archive, "application/octet-stream")
            else:
                self.send_error(404)

        def _answer(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield served
    server.shutdown()
    server.server_close()
    thread.join()


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_the_sdist_is_fetched_checked_and_unpacked_once(index: Index, tmp_path: Path) -> None:
    source = find_vllm_source(VERSION, environ={}, cache_dir=tmp_path, index_url=index.url)
    assert source.root == tmp_path / f"vllm-{VERSION}"
    assert _files(source.root) == {
        "vllm/_version.py",
        "vllm/distributed/utils.py",
        "tests/test_rl.py",
        "tests/data.json",
    }
    assert source.module_file("vllm.distributed.utils") == source.root / "vllm/distributed/utils.py"
    assert source.module_file("vllm.distributed.missing") is None
    assert _files(tmp_path) == {f"vllm-{VERSION}/{name}" for name in _files(source.root)}  # no archive, no scratch
    assert len(index.requests) == 2
    again = find_vllm_source(VERSION, environ={}, cache_dir=tmp_path, index_url=index.url)
    assert again == source and len(index.requests) == 2  # from the cache


def test_an_older_cache_holding_only_tests_is_replaced(index: Index, tmp_path: Path) -> None:
    (tmp_path / f"vllm-{VERSION}" / "tests").mkdir(parents=True)  # what benchmarks/vllm_rl_tests.py used to unpack
    source = find_vllm_source(VERSION, environ={}, cache_dir=tmp_path, index_url=index.url)
    assert (source.root / "vllm" / "_version.py").read_bytes() == _version_file(VERSION)


def test_an_sdist_whose_sha256_is_not_the_index_s_is_refused(index: Index, tmp_path: Path) -> None:
    index.sha256 = "0" * 64
    with pytest.raises(ValueError, match=f"{SDIST}: sha256 [0-9a-f]{{64}} is not the index's 0{{64}}"):
        find_vllm_source(VERSION, environ={}, cache_dir=tmp_path, index_url=index.url)
    assert not any(tmp_path.iterdir())


def test_a_release_the_index_lacks_is_named(index: Index, tmp_path: Path) -> None:
    with pytest.raises(LookupError, match=f"the index {index.url} has no sdist vllm-0.0.1.tar.gz"):
        find_vllm_source("0.0.1", environ={}, cache_dir=tmp_path, index_url=index.url)


def test_the_environment_comes_first_and_without_an_index_the_reason_is_given(tmp_path: Path) -> None:
    given, beside = tmp_path / "given", tmp_path / "deps"
    (given / "vllm").mkdir(parents=True)
    (given / "vllm" / "_version.py").write_bytes(_version_file("1.2.3"))
    beside.mkdir()
    environ = {SOURCE_ENV: os.pathsep.join([str(given), str(beside)])}
    unreachable = f"http://127.0.0.1:{free_port()}/simple"
    source = find_vllm_source("1.2.3", environ, cache_dir=tmp_path / "cache", index_url=unreachable)
    assert source.path == [str(given), str(beside)]
    # Another release than the one given: the cache, then the index, which cannot be reached.
    with pytest.raises(SourceUnavailable, match=f"not in {tmp_path / 'cache'} and the package index {unreachable}"):
        find_vllm_source(VERSION, environ, cache_dir=tmp_path / "cache", index_url=unreachable)


def test_two_runs_fetching_at_once_both_get_the_whole_tree(index: Index, tmp_path: Path) -> None:
    """As two pytest processes (or pytest and the benchmark) on one cache: one unpack is renamed into place, the other
    finds it there; neither sees half a tree."""
    index.downloads_wait_for = threading.Barrier(2)  # both past the cache check before either unpacks
    with ThreadPoolExecutor(2) as pool:
        roots = list(pool.map(lambda _: unpacked_sdist(VERSION, tmp_path, index.url), range(2)))
    assert roots == [tmp_path / f"vllm-{VERSION}"] * 2
    assert _files(tmp_path) == {f"vllm-{VERSION}/{name}" for name in _files(roots[0])} and is_unpacked(roots[0])
