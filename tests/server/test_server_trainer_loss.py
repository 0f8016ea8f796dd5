"""A trainer that dies mid-update, an engine woken from sleep level 2 without weights, an update abandoned by hand
(issue 20.1, 20.7): a real `rlserve serve`, a real trainer process killed with SIGKILL inside an `nccl` (gloo) update.

Without --weight-update-snapshot the abandoned update leaves weights from two versions: completions and /health answer
503 naming the fix until a full update writes every tensor. With it, the previous weights come back and serving goes
on. Every wait is bounded by the server's --weight-transfer-timeout-s (small here).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import _stop, _wait_healthy
from safetensors.torch import load_file
from server_helpers import API_KEY, MODEL_NAME, Server, free_port, launch

from rlserve.dtypes import dtype_name
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import (
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    WeightTransferGroup,
    compare_checksums,
    weight_checksums,
)

TRANSFER_TIMEOUT_S = 5.0  # the server's --weight-transfer-timeout-s
HTTP_TIMEOUT_S = 60.0
SENT_BEFORE_DEATH = 5
TRAINER = Path(__file__).with_name("dying_trainer.py")
COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def new_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("trainer-loss") / "toy", seed=7, initializer_range=0.2)


def _serve(tmp: Path, model_dir: Path, *extra: str) -> Iterator[Server]:
    server = launch(
        tmp,
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--api-key",
        API_KEY,
        "--enable-rl-api",
        "--weight-transfer-config",
        json.dumps({"backend": "nccl"}),
        "--weight-transfer-timeout-s",
        str(TRANSFER_TIMEOUT_S),
        *extra,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def server(server_model_dir: Path, new_weights_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    allowed = ("--allowed-weight-dirs", str(new_weights_dir.parent))
    yield from _serve(tmp_path_factory.mktemp("lossy"), server_model_dir, *allowed)


@pytest.fixture(scope="module")
def snapshot_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(tmp_path_factory.mktemp("snapshot"), server_model_dir, "--weight-update-snapshot")


def _update_info(weights: dict) -> dict:
    names = sorted(weights)
    return {
        "names": names,
        "dtype_names": [dtype_name(weights[n].dtype) for n in names],
        "shapes": [list(weights[n].shape) for n in names],
        # One tensor per bucket: the engine writes each as it arrives, so a trainer dying part-way leaves some written.
        "packed_buffer_size_bytes": 1,
        "packed_num_buffers": 1,
    }


def _in_thread(call) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


def _join(http: httpx.Client, port: int, trainer) -> httpx.Response:
    """The engine's side of the rendezvous, while `trainer()` joins as rank 0."""
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    thread, joined = _in_thread(lambda: http.post("/init_weight_transfer_engine", json={"init_info": init_info}))
    group = trainer()
    thread.join(HTTP_TIMEOUT_S)
    assert joined and joined[0].status_code == 200, joined
    return group


def _update_then_kill_trainer(http: httpx.Client, new_weights_dir: Path) -> httpx.Response:
    """A trainer process joins, starts an update, sends SENT_BEFORE_DEATH tensors and is SIGKILLed; returns the
    engine's answer to the update_weights call it was in."""
    checkpoint = new_weights_dir / "model.safetensors"
    port = free_port()
    cmd = [sys.executable, str(TRAINER), str(port), str(checkpoint), str(SENT_BEFORE_DEATH)]
    trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "ready"
        _join(http, port, lambda: trainer.stdout.readline())
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        assert http.post("/start_weight_update").status_code == 200
        update = {"update_info": _update_info(load_file(checkpoint))}
        thread, updated = _in_thread(lambda: http.post("/update_weights", json=update))
        assert trainer.stdout.readline().strip() == "sent"
        time.sleep(0.2)  # the engine writes what was sent
        trainer.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        thread.join(TRANSFER_TIMEOUT_S + 10)
        assert updated, "update_weights still hangs after the trainer was killed"
        assert time.monotonic() - killed < TRANSFER_TIMEOUT_S + 10
        return updated[0]
    finally:
        trainer.kill()
        trainer.wait(10)


def _send_full_update(http: httpx.Client, new_weights_dir: Path, version: str) -> None:
    """A new trainer (this process): init, start, every tensor, finish, resume."""
    weights = load_file(new_weights_dir / "model.safetensors")
    port = free_port()
    info = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "timeout_s": HTTP_TIMEOUT_S}
    group: WeightTransferGroup = _join(http, port, lambda: NCCLWeightTransferEngine.trainer_init(info))
    try:
        assert http.post("/start_weight_update").status_code == 200
        thread, updated = _in_thread(lambda: http.post("/update_weights", json={"update_info": _update_info(weights)}))
        args = NCCLTrainerSendWeightsArgs(group=group)
        NCCLWeightTransferEngine.trainer_send_weights(((n, weights[n]) for n in sorted(weights)), args)
        thread.join(HTTP_TIMEOUT_S)
        assert updated and updated[0].status_code == 200, updated
        assert http.post("/finish_weight_update", json={"weight_version": version}).status_code == 200
        assert http.post("/resume").status_code == 200
    finally:
        group.shutdown()


def _refused(response: httpx.Response, cause: str) -> None:
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert cause in message and "weight update" in message and "reload" in message, message


def _incomplete_gauge(http: httpx.Client) -> float:
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith("rlserve_weights_incomplete{"))
    return float(line.rsplit(" ", 1)[1])


def test_a_trainer_killed_mid_update_is_detected_and_a_new_one_restores_serving(
    server: Server, new_weights_dir: Path
) -> None:
    new_checksums = weight_checksums(load_file(new_weights_dir / "model.safetensors").items())
    with server.client() as http:
        before = http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
        answer = _update_then_kill_trainer(http, new_weights_dir)
        assert answer.status_code == 409 and "abandoned (incomplete)" in answer.json()["error"]["message"], answer.text

        # Generation is refused with the reason, streams included; the state is visible; nothing hangs.
        cause = "a weight update was abandoned"
        _refused(http.post("/v1/completions", json=COMPLETION), cause)
        _refused(http.post("/v1/completions", json={**COMPLETION, "stream": True}), cause)
        _refused(http.get("/health"), cause)
        assert http.get("/is_paused").json() == {"is_paused": False}  # the dead trainer's keep-pause is lifted
        assert _incomplete_gauge(http) == 1.0
        mixed = http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
        assert compare_checksums(before, mixed)["mismatches"] and compare_checksums(new_checksums, mixed)["mismatches"]
        # The broken group is closed: a new trainer must init first.
        assert "init_weight_transfer_engine" in http.post("/start_weight_update").json()["error"]["message"]

        _send_full_update(http, new_weights_dir, "step-2")
        assert http.get("/health").status_code == 200 and _incomplete_gauge(http) == 0.0
        served = http.post("/v1/completions", json={**COMPLETION, "return_token_weight_versions": True})
        assert served.status_code == 200 and served.json()["choices"][0]["token_weight_versions"] == ["step-2"] * 4
        assert http.post("/weight_checker", json={"action": "compare", "baseline": new_checksums}).json()["match"]


def test_abandon_by_hand_and_sleep_level_2(server: Server, new_weights_dir: Path) -> None:
    """An operator abandons an update whose trainer went quiet between calls; sleep(2) + wake_up serves nothing
    until a reload."""
    with server.client() as http:
        assert "no weight update in progress" in http.post("/abandon_weight_update").json()["error"]["message"]
        _send_full_update(http, new_weights_dir, "step-3")  # an open group for the next start
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        assert http.post("/start_weight_update").status_code == 200
        abandoned = http.post("/abandon_weight_update")
        assert abandoned.json() == {"message": "Weight update abandoned", "weights": "unchanged"}, abandoned.text
        assert http.get("/is_paused").json() == {"is_paused": False} and http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200

        assert http.post("/sleep", params={"level": 2}).status_code == 200
        assert http.post("/wake_up").json() == {"status": "awake", "tags": None}
        _refused(http.post("/v1/completions", json=COMPLETION), "sleep(level=2)")
        _refused(http.get("/health"), "sleep(level=2)")
        reload = {"weight_dir": str(new_weights_dir)}
        assert http.post("/update_weights", json=reload).status_code == 200
        health = http.get("/health")
        assert health.status_code == 200, health.text
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_with_a_snapshot_the_previous_weights_come_back(snapshot_server: Server, new_weights_dir: Path) -> None:
    with snapshot_server.client() as http:
        before = http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
        served_before = http.post("/v1/completions", json={**COMPLETION, "return_token_ids": True}).json()
        answer = _update_then_kill_trainer(http, new_weights_dir)
        assert answer.status_code == 409 and "abandoned (restored)" in answer.json()["error"]["message"], answer.text
        assert http.post("/weight_checker", json={"action": "compare", "baseline": before}).json()["match"]
        assert http.get("/health").status_code == 200 and http.get("/is_paused").json() == {"is_paused": False}
        served = http.post("/v1/completions", json={**COMPLETION, "return_token_ids": True})
        assert served.status_code == 200
        assert served.json()["choices"][0]["token_ids"] == served_before["choices"][0]["token_ids"]


def test_init_without_a_trainer_fails_after_the_timeout(server: Server) -> None:
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
    with server.client() as http:
        started = time.monotonic()
        answer = http.post("/init_weight_transfer_engine", json={"init_info": init_info})
        took = time.monotonic() - started
        assert answer.status_code == 409 and "did not complete within 5 s" in answer.json()["error"]["message"]
        assert TRANSFER_TIMEOUT_S <= took < TRANSFER_TIMEOUT_S + 10
        assert http.get("/health").status_code == 200
