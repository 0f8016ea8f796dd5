"""prime-rl's and PipelineRL's server routes on a real `rlserve serve`, driven as their clients drive them:

- prime-rl 559b4477 `src/prime_rl/utils/client.py`: `init_nccl_broadcast` (POST /init_broadcaster with host, port,
  rank_offset, inference_world_size, timeout, quantize_in_weight_transfer; raise_for_status), `update_weights`
  (POST /pause?mode=keep&clear_cache=false, write `weight_dir/NCCL_READY`, POST /update_weights {"weight_dir"},
  POST /resume), `load_lora_adapter` (POST /load_lora_adapter {lora_name, lora_path}), and the server's GET
  /liveness; its trainer waits for NCCL_READY, then broadcasts (tests/server/framework_senders.py);
- PipelineRL 58d39345 `pipelinerl/finetune_loop.py` `WeightUpdateManager`: POST /receive_weight_update with
  `WeightUpdateRequest.model_dump()` (no auth header) on a thread while rank 0 broadcasts every parameter, then
  raise_for_status; the server joins its group at start from `--weight-update-group-init-method` /
  `--weight-update-group-world-size` / `--actor-llm-idx`, as its `run_vllm1` entrypoint does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from conftest import _start, _stop, _wait_healthy
from framework_launch_lines import prime_rl_flags
from framework_senders import (
    StatelessTrainer,
    pipelinerl_parameters_info,
    prime_rl_broadcast_state_dict,
    prime_rl_broadcast_weights,
    prime_rl_kernel_format,
)
from safetensors.torch import load_file
from server_helpers import API_KEY, HTTP_TIMEOUT_S, Server, free_port, launch

from rlserve.model.fp8 import Fp8Scheme, quantize_checkpoint
from rlserve.rl.client import RLServeClient
from rlserve.toy import make_lora_dir, make_model_dir
from rlserve.weight_transfer import compare_checksums, weight_checksums

TIMEOUT_S = 60
NCCL_READY = "NCCL_READY"


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    model_dir = make_model_dir(tmp_path_factory.mktemp("fw-new") / "toy", seed=11, initializer_range=0.2)
    return load_file(model_dir / "model.safetensors")


# --- prime-rl ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one directory the framework servers may load adapters from (--allowed-weight-dirs)."""
    return tmp_path_factory.mktemp("fw-adapters")


@pytest.fixture(scope="module")
def prime_server(
    server_model_dir: Path, adapter_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """prime-rl's server: its own launch line (framework_launch_lines.prime_rl_flags: no weight-transfer config, its
    /init_broadcaster picks the backend) with what rlserve needs beside it: the RL API and its key, and here LoRA
    on with adapters from `adapter_root` only, loaded at run time (SkyRL's route needs that as vLLM's does)."""
    args = ("--enable-rl-api", "--api-key", API_KEY, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
    args += ("--allowed-weight-dirs", str(adapter_root), "--enable-runtime-lora-updating")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    server = launch(tmp_path_factory.mktemp("fw-logs"), *prime_rl_flags(str(server_model_dir)), *args, headers=headers)
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(server)


def test_prime_rl_launch_line_takes_effect(prime_server: Server) -> None:
    """Its flags reach the server: processed logprobs, auto tool choice with hermes, the fp32 LM head of its
    --additional-config; its --data-parallel-rpc-port and --max-cpu-loras are named no-ops in the log."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "tools": tools}
    with prime_server.client() as admin:
        response = admin.post("/v1/chat/completions", json={**body, "tool_choice": "auto"})
        assert response.status_code == 200, response.text
        answer = response.json()
        assert len(answer["choices"][0]["logprobs"]["content"]) == answer["usage"]["completion_tokens"]
        info = admin.get("/server_info").json()
    log = prime_server.log_tail(20000)
    assert "--data-parallel-rpc-port: accepted, no effect" in log and "--max-cpu-loras: accepted, no effect" in log
    assert "processed_logprobs" in json.dumps(info) and "float32" in json.dumps(info), info


@pytest.fixture(scope="module")
def prime_trainer(prime_server: Server) -> Iterator[StatelessTrainer]:
    """prime-rl's NCCLWeightBroadcast (rank 0 of inference_world_size + 1) and its orchestrator's
    init_nccl_broadcast (one server, rank_offset 0), at once: each blocks until both have joined."""
    port = free_port()
    body = {
        "host": "127.0.0.1",
        "port": port,
        "rank_offset": 0,
        "inference_world_size": 1,
        "timeout": TIMEOUT_S,
        "quantize_in_weight_transfer": False,
    }
    with prime_server.client() as admin, ThreadPoolExecutor(1) as pool:
        joined = pool.submit(admin.post, "/init_broadcaster", json=body)
        trainer = StatelessTrainer(port, world_size=2, timeout_s=TIMEOUT_S)
        response = joined.result(timeout=TIMEOUT_S)
    response.raise_for_status()
    assert response.json() == {"status": "ok"}
    yield trainer
    trainer.shutdown()


def _prime_rl_update(server: Server, weight_dir: Path, send) -> httpx.Response:
    """prime-rl's orchestrator `update_weights` with its trainer's `broadcast_weights` (waits for NCCL_READY)."""

    def trainer_side() -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not (weight_dir / NCCL_READY).exists():  # sync_wait_for_path
            assert time.monotonic() < deadline, "NCCL_READY never written"
            time.sleep(0.05)
        send()

    with server.client() as admin, ThreadPoolExecutor(1) as pool:
        sent = pool.submit(trainer_side)
        admin.post("/pause", params={"mode": "keep", "clear_cache": "false"}).raise_for_status()
        try:
            weight_dir.mkdir(parents=True, exist_ok=True)
            (weight_dir / NCCL_READY).touch()
            response = admin.post("/update_weights", json={"weight_dir": weight_dir.as_posix()})
        finally:
            admin.post("/resume").raise_for_status()
        sent.result(timeout=TIMEOUT_S)
    return response


def test_prime_rl_init_broadcaster_refuses_fp8_transfer_by_name(prime_server: Server) -> None:
    body = {"host": "127.0.0.1", "port": free_port(), "rank_offset": 0, "inference_world_size": 1, "timeout": 5}
    with prime_server.client() as admin:
        response = admin.post("/init_broadcaster", json={**body, "quantize_in_weight_transfer": True})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "quantize_in_weight_transfer"
        assert "--quantization fp8" in response.json()["error"]["message"]  # this engine serves bf16
        keyless = httpx.post(prime_server.url + "/init_broadcaster", json=body, timeout=HTTP_TIMEOUT_S)
        assert keyless.status_code == 401


def test_prime_rl_nccl_mode_update_weights(
    prime_server: Server, prime_trainer: StatelessTrainer, new_weights: dict, tmp_path: Path
) -> None:
    with RLServeClient(prime_server.url, api_key=API_KEY, timeout=HTTP_TIMEOUT_S) as rl:
        assert compare_checksums(rl.weight_checksums(), weight_checksums(new_weights.items()))["mismatches"]
        # Without the orchestrator's marker the trainer never sends: refused at once, not a wait for its timeout.
        with prime_server.client() as admin:
            unmarked = admin.post("/update_weights", json={"weight_dir": str(tmp_path)})
        assert unmarked.status_code == 409 and unmarked.json()["error"]["param"] == "weight_dir", unmarked.text

        response = _prime_rl_update(
            prime_server, tmp_path / "step_1", lambda: prime_rl_broadcast_weights(prime_trainer, new_weights)
        )
        assert response.status_code == 200, response.text
        assert compare_checksums(weight_checksums(new_weights.items()), rl.weight_checksums())["match"]
        assert not rl.is_paused()


def test_prime_rl_refused_state_dict_keeps_the_stream_in_step(
    prime_server: Server, prime_trainer: StatelessTrainer, new_weights: dict, tmp_path: Path
) -> None:
    """A state dict the model refuses (a wrong shape) is received and dropped with the rest of the stream: the update
    is a 400 naming the tensor, nothing changed (the engine serves on), and the next update on the group lands."""
    name = "model.embed_tokens.weight"
    with RLServeClient(prime_server.url, api_key=API_KEY, timeout=HTTP_TIMEOUT_S) as rl:
        before = rl.weight_checksums()

        def send_refused() -> None:
            prime_rl_broadcast_state_dict_count(prime_trainer, 2)
            prime_rl_broadcast_state_dict(prime_trainer, {name: torch.zeros(3, 5)})
            prime_rl_broadcast_state_dict(prime_trainer, {"model.norm.weight": torch.zeros_like(new_weights[name][0])})

        refused = _prime_rl_update(prime_server, tmp_path / "step_2", send_refused)
        assert refused.status_code == 400 and name in refused.json()["error"]["message"], refused.text
        assert rl.weight_checksums() == before
        with prime_server.client() as admin:
            completion = admin.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert completion.status_code == 200, completion.text
        again = _prime_rl_update(
            prime_server, tmp_path / "step_3", lambda: prime_rl_broadcast_weights(prime_trainer, new_weights)
        )
        assert again.status_code == 200, again.text
        assert compare_checksums(weight_checksums(new_weights.items()), rl.weight_checksums())["match"]


def prime_rl_broadcast_state_dict_count(trainer: StatelessTrainer, count: int) -> None:
    trainer.broadcast(torch.tensor([count], dtype=torch.long))


@pytest.fixture(scope="module")
def fp8_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fw-fp8")
    return make_model_dir(root / "old", preset="tiny-fp8", seed=0), make_model_dir(
        root / "new", preset="tiny-fp8", seed=1
    )


@pytest.mark.slow  # its own FP8 server: a start-up (~5 s idle) and three streams
def test_prime_rl_quantized_transfer_loads_the_trainers_fp8_layers(
    fp8_model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """quantize_in_weight_transfer into an engine serving block-wise FP8: the trainer's kernel-format layers (fused
    fp8 projections with their block scales, framework_senders.prime_rl_kernel_format) land as they are, equal to the
    engine's own quantization of the same weights; a fused tensor of the wrong size in the first state dict is a 400
    naming it with nothing changed, and the stream stays in step for the next update."""
    old, new = fp8_model_dirs
    new_weights = load_file(new / "model.safetensors")
    server = _start(old, tmp_path / "fp8.log", "--enable-rl-api", "--quantization", "fp8", api_key=API_KEY)
    trainer = None
    try:
        _wait_healthy(server)
        port = free_port()
        body = {"host": "127.0.0.1", "port": port, "rank_offset": 0, "inference_world_size": 1, "timeout": TIMEOUT_S}
        with server.client() as admin, ThreadPoolExecutor(1) as pool:
            joined = pool.submit(admin.post, "/init_broadcaster", json={**body, "quantize_in_weight_transfer": True})
            trainer = StatelessTrainer(port, world_size=2, timeout_s=TIMEOUT_S)
            assert joined.result(timeout=TIMEOUT_S).json() == {"status": "ok"}
        kernel = prime_rl_kernel_format(new_weights)
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        assert kernel[qkv].dtype == torch.float8_e4m3fn and "model.layers.0.mlp.gate_up_proj.weight_scale_inv" in kernel
        with RLServeClient(server.url, api_key=API_KEY, timeout=HTTP_TIMEOUT_S) as rl:
            before = rl.weight_checksums()

            def send_refused() -> None:
                prime_rl_broadcast_state_dict_count(trainer, 2)
                prime_rl_broadcast_state_dict(
                    trainer, {qkv: kernel[qkv][:-128], qkv + "_scale_inv": kernel[qkv + "_scale_inv"]}
                )
                prime_rl_broadcast_state_dict(trainer, {"model.norm.weight": new_weights["model.norm.weight"]})

            refused = _prime_rl_update(server, tmp_path / "step_1", send_refused)
            assert refused.status_code == 400 and qkv in refused.json()["error"]["message"], refused.text
            assert rl.weight_checksums() == before
            response = _prime_rl_update(
                server, tmp_path / "step_2", lambda: prime_rl_broadcast_weights(trainer, kernel)
            )
            assert response.status_code == 200, response.text
            expected = weight_checksums(quantize_checkpoint(new_weights.items(), Fp8Scheme("fp8")))
            assert compare_checksums(expected, rl.weight_checksums())["match"]
        with server.client() as admin:
            completion = admin.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert completion.status_code == 200, completion.text
    finally:
        if trainer is not None:
            trainer.shutdown()
        _stop(server)


def test_prime_rl_liveness_and_lora_reload(
    prime_server: Server, server_model_dir: Path, adapter_root: Path, tmp_path: Path
) -> None:
    assert httpx.get(prime_server.url + "/liveness", timeout=HTTP_TIMEOUT_S).json() == {"status": "ok"}
    with prime_server.client() as admin:
        for step in (1, 2):  # a fixed name, a new path per step: a reload in place
            path = make_lora_dir(adapter_root / f"step_{step}", server_model_dir, rank=8, seed=step)
            response = admin.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": path.as_posix()})
            assert response.status_code == 200 and response.json() == {"status": "ok"}, response.text
            cards = {card["id"]: card for card in admin.get("/v1/models").json()["data"]}
            assert cards["policy"]["root"] == path.as_posix()
        outside = make_lora_dir(tmp_path / "outside", server_model_dir, rank=8, seed=3)
        refused = admin.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": outside.as_posix()})
        assert refused.status_code == 403 and refused.json()["error"]["param"] == "lora_path", refused.text


def test_skyrl_lora_reload_and_fetch_weights_refusal(
    prime_server: Server, server_model_dir: Path, adapter_root: Path
) -> None:
    """SkyRL a9564572: RemoteInferenceClient.update_lora_from_disk posts /skyrl/v1/load_lora_adapter {lora_name,
    lora_path} (a reload in place keeps the adapter's id); fetch_weights posts /fetch_weights {target_version}, which
    its server hands to its worker extension: without one defining fetch_weights, a 400 naming why."""
    with prime_server.client() as admin:
        ids = []
        for step in (1, 2):
            path = make_lora_dir(adapter_root / f"skyrl_{step}", server_model_dir, rank=8, seed=10 + step)
            body = {"lora_name": "skyrl-policy", "lora_path": path.as_posix()}
            response = admin.post("/skyrl/v1/load_lora_adapter", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["status"] == "ok" and response.json()["lora_name"] == "skyrl-policy"
            ids.append(response.json()["lora_int_id"])
        assert ids[0] == ids[1]
        admin.post("/v1/unload_lora_adapter", json={"lora_name": "skyrl-policy"}).raise_for_status()
        refused = admin.post("/fetch_weights", json={"target_version": 3})
        assert refused.status_code == 400 and "fetch_weights" in refused.json()["error"]["message"], refused.text
        missing = admin.post("/fetch_weights", json={})
        assert missing.status_code == 400 and "target_version" in missing.text


# --- PipelineRL -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipelinerl(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, object]]:
    """PipelineRL's trainer (rank 0 of 2) and a server started with PipelineRL's flags, which joins as rank 1."""
    port = free_port()
    log = tmp_path_factory.mktemp("fw-logs") / "pipelinerl.log"
    args = ("--enable-rl-api", "--rl-api-auth", "none", "--actor-llm-idx", "0")
    args += ("--weight-update-group-init-method", f"tcp://127.0.0.1:{port}", "--weight-update-group-world-size", "2")
    with ThreadPoolExecutor(1) as pool:
        trainer_future = pool.submit(StatelessTrainer, port, 2, TIMEOUT_S)
        server = _start(server_model_dir, log, *args, api_key=None)
        try:
            _wait_healthy(server)
            trainer = trainer_future.result(timeout=TIMEOUT_S)
        except BaseException:
            _stop(server)
            raise
    try:
        yield server, trainer
    finally:
        trainer.shutdown()
        _stop(server)


def test_pipelinerl_receive_weight_update(pipelinerl: tuple[Server, StatelessTrainer], new_weights: dict) -> None:
    server, trainer = pipelinerl
    parameters_info = pipelinerl_parameters_info(new_weights)
    message = {"kind": "weight_update_request", "version": 7, "parameters_info": parameters_info, "timestamp": 1.0}
    with ThreadPoolExecutor(1) as pool:
        posted = pool.submit(httpx.post, server.url + "/receive_weight_update", json=message, timeout=TIMEOUT_S)
        for tensor in new_weights.values():  # send_weight_update: in parameters_info order
            trainer.broadcast(tensor)
        response = posted.result(timeout=TIMEOUT_S)
    response.raise_for_status()
    assert response.json() == {"status": "ok"}
    with RLServeClient(server.url, timeout=HTTP_TIMEOUT_S) as rl:
        assert compare_checksums(weight_checksums(new_weights.items()), rl.weight_checksums())["match"]
        assert rl.get_weight_version() == "7"
        assert not rl.is_paused()


def test_pipelinerl_bad_dtype_is_a_400_before_any_pause(pipelinerl: tuple[Server, StatelessTrainer]) -> None:
    server, _ = pipelinerl
    info = [{"name": "model.norm.weight", "shape": [4], "dtype": "torch.complex_thing"}]
    response = httpx.post(
        server.url + "/receive_weight_update", json={"version": 8, "parameters_info": info}, timeout=TIMEOUT_S
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "parameters_info", response.text
    with RLServeClient(server.url, timeout=HTTP_TIMEOUT_S) as rl:
        assert not rl.is_paused()
