"""SkyRL's chunked weight sync through its own worker extension, end to end on a real `rlserve serve`: the server
loads SkyRL's `NewInferenceWorkerWrap` (`--worker-extension-cls`, tests/skyrl_extension.py, with the vllm import
surface on: it imports vllm), a trainer process runs SkyRL's broadcast sender and HTTP client
(tests/server/skyrl_trainer.py), and the served weights are then the trainer's, checksum for checksum.

Two SkyRL versions, one server each:
- the `skyrl` 0.3.0 release (requirements-frameworks.txt), which CI installs: its extension calls vLLM 0.24's
  `receive_weights(update_info, load_weights=...)`;
- SkyRL HEAD at `SKYRL_COMMIT` (a9564572, the commit issues 29 and 30 name), extracted at test time from a git mirror
  of NovaSky-AI/SkyRL (RLSERVE_TEST_SKYRL_GIT_DIR; skipped without one, as in CI, which cannot fetch it): its
  extension retargets the engine with `set_weight_update_target` and calls 0.33's `receive_weights(update_info)`.
  Its package imports loguru (not in the test extra, since CI cannot run this half): skipped without it.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TESTS_DIR, _stop, _wait_healthy
from safetensors.torch import load_file
from server_helpers import MODEL_NAME, Server, launch

from rlserve.server.serve_flags import DEV_MODE_ENV
from rlserve.toy import make_model_dir
from rlserve.vllm_surface import ENV_VAR as SURFACE_ENV
from rlserve.weight_transfer.checksum import weight_checksums

SKYRL_COMMIT = "a9564572eb8e91076be43c1bd5e4615e3de17265"
SKYRL_GIT_DIR = os.environ.get("RLSERVE_TEST_SKYRL_GIT_DIR", "/work/.mirror/NovaSky-AI+SkyRL/repo")
EXTENSION = "skyrl_extension:SkyRLWorkerExtension"
TRAINER = Path(__file__).with_name("skyrl_trainer.py")
TRAINER_TIMEOUT_S = 180.0
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}


def _head_source(into: Path) -> Path:
    """SkyRL's `skyrl` package at SKYRL_COMMIT, extracted from the git mirror into `into` (which then goes first on
    PYTHONPATH); skips when the mirror, the commit or loguru is absent."""
    if not Path(SKYRL_GIT_DIR).is_dir():
        pytest.skip(f"no git mirror of NovaSky-AI/SkyRL at {SKYRL_GIT_DIR} (set RLSERVE_TEST_SKYRL_GIT_DIR)")
    git = ["git", f"--git-dir={SKYRL_GIT_DIR}"]
    if subprocess.run([*git, "cat-file", "-e", f"{SKYRL_COMMIT}^{{commit}}"], capture_output=True).returncode:
        pytest.skip(f"SkyRL commit {SKYRL_COMMIT} is not in {SKYRL_GIT_DIR}")
    if importlib.util.find_spec("loguru") is None:
        pytest.skip("SkyRL HEAD's extension module imports loguru: pip install loguru")
    archive = subprocess.run([*git, "archive", SKYRL_COMMIT, "skyrl"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


@pytest.fixture(scope="module", params=["release-0.3.0", "head-a9564572"])
def skyrl_python_path(request, tmp_path_factory: pytest.TempPathFactory) -> str:
    """PYTHONPATH for the server and the trainer: SkyRL's source first (HEAD), or none (the installed release), then
    tests/ (skyrl_extension.py)."""
    if request.param.startswith("release"):
        if importlib.util.find_spec("skyrl") is None:
            pytest.skip("pip install --no-deps -r requirements-frameworks.txt")
        source: list[str] = []
    else:
        source = [str(_head_source(tmp_path_factory.mktemp("skyrl-head")))]
    return os.pathsep.join([*source, str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.fixture(scope="module")
def skyrl_server(
    skyrl_python_path: str, server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """`rlserve serve` as SkyRL starts vLLM with its extension: dev mode, no key, the nccl backend (gloo here)."""
    args = (str(server_model_dir), "--served-model-name", MODEL_NAME, "--dtype", "float32")
    args += ("--weight-transfer-config", '{"backend": "nccl"}', "--worker-extension-cls", EXTENSION)
    env = {DEV_MODE_ENV: "1", SURFACE_ENV: "1", "PYTHONPATH": skyrl_python_path}
    server = launch(tmp_path_factory.mktemp("skyrl-extension-server"), *args, env=env)
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(server)


def _greedy(http) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": "weights", "return_token_ids": True, **GREEDY}
    return http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]


@pytest.mark.slow  # a server of its own (SkyRL's extension) and a trainer process: ~10 s on an idle machine
def test_skyrl_trainer_syncs_weights_through_skyrls_worker_extension(
    request: pytest.FixtureRequest, skyrl_server: Server, skyrl_python_path: str, tmp_path: Path
) -> None:
    new_dir = make_model_dir(tmp_path / "new", seed=31, initializer_range=0.2)
    checkpoint = new_dir / "model.safetensors"
    with skyrl_server.client() as http:
        # SkyRL's own checks answer before a sync starts: its code runs in the engine's worker.
        early = http.post("/collective_rpc", json={"method": "update_weights_nccl", "kwargs": {"update_info": {}}})
        assert early.status_code == 409  # its RuntimeError: a call out of order
        assert "skyrl_start_weight_update must be called before update_weights_nccl" in early.text
        before = _greedy(http)
        trainer = subprocess.run(
            [sys.executable, str(TRAINER), skyrl_server.url, MODEL_NAME, str(checkpoint)],
            capture_output=True,
            text=True,
            timeout=TRAINER_TIMEOUT_S,
            env={**os.environ, "PYTHONPATH": skyrl_python_path},
        )
        assert trainer.returncode == 0, trainer.stderr[-4000:] + skyrl_server.log_tail()
        assert json.loads(trainer.stdout.splitlines()[-1]) == {"world_size_per_server": 1}
        served = http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
        assert served == weight_checksums(load_file(checkpoint).items())
        assert _greedy(http) != before  # the new random checkpoint answers differently
        if "head" in request.node.callspec.id:
            # HEAD's allocator-level sleep for a weight sync needs vLLM's CuMemAllocator: refused, naming it.
            sleep = http.post("/collective_rpc", json={"method": "skyrl_sleep_for_weight_sync"})
            assert sleep.status_code == 409 and "vllm.device_allocator: rlserve does not provide" in sleep.text
