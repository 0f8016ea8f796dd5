"""Issue 28's engine-core findings, against one real `rlserve serve` (tiny model, loopback): what a keyed call or a
local user could do to the engine core, and what the core now does instead."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TESTS_DIR, _stop, _wait_healthy
from server_helpers import API_KEY, MODEL_NAME, Server, launch


@pytest.fixture(scope="module")
def core_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with a worker extension, under umask 000 and a temp dir of its own (where the core's socket is)."""
    root = tmp_path_factory.mktemp("core-hardening")
    (root / "tmp").mkdir()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}
    env["TMPDIR"] = str(root / "tmp")
    argv = [str(server_model_dir), "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--enable-rl-api"]
    argv += ["--worker-extension-cls", "worker_extension:CheckpointLoader", "--log-level", "warning"]
    old_umask = os.umask(0)  # inherited by the server: every file it creates is world-writable unless it says not
    try:
        server = launch(root, *argv, env=env, headers={"Authorization": f"Bearer {API_KEY}"})
    finally:
        os.umask(old_umask)
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(server)


def _complete(server: Server, **fields) -> dict:
    body = {"model": MODEL_NAME, "prompt": "core", "max_tokens": 4, "temperature": 0.0, **fields}
    with server.client() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_collective_rpc_results_never_kill_the_core(core_server: Server) -> None:
    """Issue 28 row 1: a tensor result used to kill the core (msgspec cannot encode it). Tensors come back as
    lists; an object or a method's own KeyError is a 400 naming the method; the core serves on after each."""
    with core_server.client() as http:
        tensor = http.post("/collective_rpc", json={"method": "first_weights", "args": [3]})
        assert tensor.status_code == 200, tensor.text
        [values] = tensor.json()["results"]
        assert len(values) == 3 and all(isinstance(v, float) for v in values)
        for method, args, says in (("opaque", [], "builtins.object is not plain data"), ("lookup", ["x"], "KeyError")):
            refused = http.post("/collective_rpc", json={"method": method, "args": args})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "method" and repr(method) in error["message"] and says in error["message"]
        assert http.get("/health").status_code == 200
    assert _complete(core_server)["choices"][0]["finish_reason"] == "length"
