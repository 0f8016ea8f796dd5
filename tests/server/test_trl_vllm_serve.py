"""TRL 1.16.0's server mode on rlserve, through the vllm import surface, with TRL's own code on both ends: the server is
`rlserve run trl vllm-serve ...` (TRL's launcher, which builds `vllm serve`'s command line and execs
`python -m vllm.entrypoints.cli.main serve ...`: rlserve's `serve` under the surface), and the trainer is TRL's
`VLLMClient` (trl/generation/vllm_client.py) in this process with the surface installed, its weight-sync group on
vLLM's wire from `vllm.distributed.weight_transfer.nccl_common.trainer_init` and `packed_tensor`'s producer: rlserve's
group classes, over gloo on the CPU. Async GRPO's sender, `WeightTransferClient`, runs against the same server.

One CPU-only fact: `VLLMClient.init_communicator` refuses a non-CUDA device by its own check (vLLM's NCCL needs one),
so the test passes "cuda" without an index (TRL then leaves the device alone); rlserve's `trainer_init` works on the
current accelerator, and on a machine without one on the CPU, as the server does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import TESTS_DIR, _stop, _wait_healthy
from process_tree import descendants, engine_core_pids, survivors
from released_frameworks import client_module
from safetensors.torch import load_file
from server_helpers import Server, free_port

from rlserve import vllm_surface
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import weight_checksums

TIMEOUT_S = 60.0
PROMPTS = ["weights", "Hello"]
EXTENSION = "vllm_extension:VllmImportingExtension"


def _import_under_surface(package: str, module: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A TRL module imported afresh with the surface installed (TRL picks its vLLM code paths at import), and
    dropped after the test so that later tests import TRL's module as they expect."""
    name = f"{package}.{module}"
    monkeypatch.delitem(sys.modules, name, raising=False)
    imported = client_module(package, module)
    monkeypatch.setitem(sys.modules, name, imported)
    return imported


def _new_checkpoint(tmp_path: Path, seed: int) -> dict[str, torch.Tensor]:
    """A checkpoint of the served shapes that the server has not had (one seed per test)."""
    return load_file(make_model_dir(tmp_path / "new", seed=seed, initializer_range=0.2) / "model.safetensors")


def _engine_holds(server: Server, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        body = {"action": "compare", "baseline": weight_checksums(weights.items())}
        return http.post("/weight_checker", json=body).json()


@pytest.fixture(scope="module")
def trl_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pytest.importorskip("trl", reason="pip install --no-deps -r requirements-frameworks.txt")
    trl = Path(sys.executable).with_name("trl")  # TRL's console script, beside the interpreter pip installed it for
    assert trl.exists(), f"trl is importable but its console script is not at {trl}"
    port = free_port()
    argv = ["vllm-serve", "--model", str(server_model_dir), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", "float32", "--max_model_len", "256"]
    # Unknown flags are forwarded to `vllm serve` by TRL: a small KV cache, and a worker extension importing vllm.
    argv += ["--num-kv-blocks", "64", "--worker-extension-cls", EXTENSION]
    command = [sys.executable, "-m", "rlserve.cli", "run", "--", str(trl), *argv]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_SERVER_DEV_MODE", "RLSERVE_API_KEY")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))  # the extension
    log = tmp_path_factory.mktemp("trl") / "trl-vllm-serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    children: list[int] = []
    try:
        _wait_healthy(server)
        children = descendants(proc.pid)
        yield server
    finally:
        _stop(server)
    assert not survivors(children), f"left running: {survivors(children)}\n{server.log_tail()}"


@pytest.fixture
def surface() -> Iterator[None]:
    vllm_surface.install()
    try:
        yield
    finally:
        vllm_surface.uninstall()


# TRL's own warning: the surface reports vLLM 0.33.0 (the API rlserve implements), above the 0.31.0 TRL has tested.
@pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions")
def test_trl_vllm_serve_runs_on_rlserve(
    trl_server: Server, surface: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's VLLMClient: generate, init_communicator, update_named_param for every parameter (inside its
    `weight_update` grouping), generate again, close_communicator. The engine then holds exactly the new
    checkpoint (its checksums) and greedy outputs change; the engine core resolved the worker extension's
    `import vllm` to rlserve."""
    assert engine_core_pids(trl_server.proc.pid), "the server is rlserve's: its engine core is a fork-server child"
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")  # TRL puts get_ip() in the group's master_address: loopback
    vllm_client = _import_under_surface("trl.generation", "vllm_client", monkeypatch)
    client = vllm_client.VLLMClient(base_url=trl_server.url, group_port=free_port(), connection_timeout=TIMEOUT_S)
    assert client.get_world_size() == 1

    before = client.generate(PROMPTS, max_tokens=8, temperature=0.0)
    assert [len(ids) for ids in before["completion_ids"]] == [8, 8]
    assert len(before["logprobs"][0]) == 8  # TRL's parse of the sampled tokens' logprobs

    client.init_communicator(device="cuda")  # see the module's docstring
    new_weights = _new_checkpoint(tmp_path, seed=12)
    with client.weight_update():
        for name, tensor in new_weights.items():
            client.update_named_param(name, tensor)
    after = client.generate(PROMPTS, max_tokens=8, temperature=0.0)
    client.close_communicator()
    assert client.communicator is None

    with httpx.Client(base_url=trl_server.url, timeout=TIMEOUT_S) as http:
        rpc = http.post("/collective_rpc", json={"method": "vllm_classes"}).json()
    assert _engine_holds(trl_server, new_weights) == {"match": True, "mismatches": []}
    assert after["prompt_ids"] == before["prompt_ids"] and after["completion_ids"] != before["completion_ids"]
    assert rpc["results"] == [
        {
            "vllm.__version__": vllm_surface.VLLM_VERSION,
            "PyNcclCommunicator": "rlserve.weight_transfer.pynccl.PyNcclCommunicator",
            "StatelessProcessGroup": "rlserve.weight_transfer.stateless_group.StatelessProcessGroup",
        }
    ]


@pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions")
def test_trl_async_grpo_weight_transfer_client_updates_rlserve(
    trl_server: Server, surface: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL async GRPO's `WeightTransferClient`, the trainer's sender as its trainer drives it (init, pause, send,
    resume, destroy): its own group from `get_ip` / `get_open_port`, `trainer_init` and the packed producer."""
    pytest.importorskip("accelerate").PartialState()  # TRL's logger needs accelerate's state (one CPU process)
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    vllm_client = _import_under_surface("trl.experimental.async_grpo", "vllm_client", monkeypatch)
    weight_transfer = _import_under_surface("trl.experimental.async_grpo", "weight_transfer", monkeypatch)
    new_weights = _new_checkpoint(tmp_path, seed=13)
    names = sorted(new_weights)
    info = {
        "names": names,
        "dtype_names": [str(new_weights[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(new_weights[n].shape) for n in names],
    }
    sender = weight_transfer.WeightTransferClient(vllm_client.VLLMClient(trl_server.url, TIMEOUT_S), info, 60)
    sender.init_weight_transfer()
    sender.pause()
    sender.send_weights((n, new_weights[n]) for n in names)
    sender.resume()
    sender.destroy()
    assert _engine_holds(trl_server, new_weights) == {"match": True, "mismatches": []}
