"""vLLM's trainer-side sender updates a real `rlserve serve`: the trainer is another process running vLLM's own
`StatelessProcessGroup`, `ncclUniqueId` and `pack_tensors` (`vllm_trainer.py`, with the release's source from the
`vllm_source` fixture: fetched from the package index when not cached), driving the server over HTTP with vLLM's field
names; the bytes go over gloo.

Both releases, each with its request shape: vLLM 0.24.0's code with 0.24's requests (`trainer_init` /
`trainer_send_weights`: the packed fields in every update_info) and 0.33.0's code with 0.33's
(`NCCLTrainerWeightTransferEngine`: the packed fields at the handshake; an empty update_info reuses the last
metadata). The new weights come from another random checkpoint, so a transfer that did not land cannot pass.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import httpx
import pytest
from safetensors.torch import load_file
from server_helpers import MODEL_NAME, Server, free_port
from torch.distributed import TCPStore
from vllm_source import VllmSource
from vllm_trainer import replay_rank0_store

from rlserve.dtypes import dtype_name
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import compare_checksums, weight_checksums
from rlserve.weight_transfer.nccl_library import NCCL_UNIQUE_ID_BYTES, unique_id_from_bytes
from rlserve.weight_transfer.stateless_group import decode_store_value, encode_store_value

TRAINER = Path(__file__).resolve().parents[1] / "vllm_trainer.py"
RENDEZVOUS_TIMEOUT_S = 120.0
# Small buckets: the toy checkpoint spans several, an embedding larger than the budget among them.
SMALL_BUFFER_BYTES = 4096
PROMPT = "the trainer sent"
PROTOCOL_WORDS = ("joined", "sent", "pickled")


@pytest.fixture(scope="module")
def new_weights_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("vllm-trainer-weights") / "toy", seed=11) / "model.safetensors"


class Trainer:
    """The trainer process running `source`'s vLLM code: joined on start, then one `send` per update."""

    def __init__(self, port: int, source: VllmSource) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TRAINER), str(port), "2", os.pathsep.join(source.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def expect(self, word: str) -> str:
        """The trainer's next protocol line, which must start with `word`: the rest of it. Log lines (vLLM's logger
        writes to stdout) are passed over."""
        assert self.proc.stdout is not None
        got = _readline(self.proc.stdout, RENDEZVOUS_TIMEOUT_S)
        while got and got.split()[0] not in PROTOCOL_WORDS:
            got = _readline(self.proc.stdout, RENDEZVOUS_TIMEOUT_S)
        assert got.split()[:1] == [word], f"trainer said {got!r}, exit code {self.proc.poll()}"
        return got.removeprefix(word).strip()

    def pickled_unique_id(self, raw: bytes) -> bytes:
        """What vLLM's own rank 0 writes to its store for the unique id `raw`."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"pickle {raw.hex()}\n")
        self.proc.stdin.flush()
        return bytes.fromhex(self.expect("pickled"))

    def send(self, path: Path, packed: bool, buffer_bytes: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"send {path} {int(packed)} {buffer_bytes}\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def _readline(stream: IO[str], timeout_s: float) -> str:
    """One line, or '' if none came within the timeout (a hung trainer fails the test instead of hanging it)."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream.readline)
        try:
            return future.result(timeout_s).strip()
        except TimeoutError:
            return ""


@pytest.fixture
def trainer_at(server: Server) -> Iterator:
    """trainer_at(source, **init_info) -> a trainer process running `source`'s vLLM code, joined to the server
    through /init_weight_transfer_engine; vLLM's own group formed it (checked by where its class was defined)."""
    started: list[Trainer] = []

    def start(source: VllmSource, **init_fields: object) -> Trainer:
        port = free_port()
        trainer = Trainer(port, source)
        started.append(trainer)
        init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        with _rendezvous_client(server) as http:
            response = http.post("/init_weight_transfer_engine", json={"init_info": {**init_info, **init_fields}})
        assert response.status_code == 200, response.text
        assert trainer.expect("joined") == str(source.module_file("vllm.distributed.utils"))
        return trainer

    yield start
    for trainer in started:
        trainer.stop()


def _rendezvous_client(server: Server) -> httpx.Client:
    """A client whose calls may wait for the trainer (a rendezvous, a transfer)."""
    return httpx.Client(base_url=server.url, headers=server.headers, timeout=RENDEZVOUS_TIMEOUT_S)


def _update_info(path: Path) -> dict:
    weights = load_file(path)
    names = sorted(weights)
    return {
        "names": names,
        "dtype_names": [dtype_name(weights[n].dtype) for n in names],
        "shapes": [list(weights[n].shape) for n in names],
    }


def _update(
    server: Server, trainer: Trainer, path: Path, update_info: dict, packed: bool, buffer_bytes: int, v033: bool = False
) -> None:
    """vLLM's round: /start_weight_update, then /update_weights while the trainer broadcasts, then /finish. `v033`:
    the bodies vLLM 0.33's HTTPVLLMWeightSyncClient posts (none for start and finish: clients.py)."""
    start_body = None if v033 else {"is_checkpoint_format": True}
    with _rendezvous_client(server) as http, ThreadPoolExecutor(1) as pool:
        assert http.post("/start_weight_update", json=start_body).status_code == 200
        updated = pool.submit(http.post, "/update_weights", json={"update_info": update_info})
        trainer.send(path, packed, buffer_bytes)
        response = updated.result(RENDEZVOUS_TIMEOUT_S)
        assert response.status_code == 200, response.text
        trainer.expect("sent")
        assert http.post("/finish_weight_update", json=None if v033 else {}).status_code == 200


def _logprobs(server: Server) -> list[float]:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "logprobs": 1}
    with server.client() as http:
        return http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]


def _checksums(server: Server) -> dict[str, str]:
    with server.client() as http:
        return http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]


def _assert_serves(server: Server, path: Path) -> None:
    assert compare_checksums(weight_checksums(load_file(path).items()), _checksums(server))["match"]


def _assert_unique_id_pickles_as_vllms(trainer: Trainer) -> None:
    """rlserve's rank 0 (its trainer classes, the group extensions build) writes the unique id as vLLM's own rank 0
    does, byte for byte, so a vLLM worker reads it; and rlserve's restricted decoder reads vLLM's."""
    raw = os.urandom(NCCL_UNIQUE_ID_BYTES)
    vllm_bytes = trainer.pickled_unique_id(raw)
    assert encode_store_value(unique_id_from_bytes(raw)) == vllm_bytes
    assert bytes(decode_store_value(vllm_bytes)) == raw


@pytest.mark.slow
def test_vllm_024_and_033_trainers_update_rlserve(
    server: Server, server_model_dir: Path, new_weights_path: Path, trainer_at, vllm_source
) -> None:
    original_path = server_model_dir / "model.safetensors"
    original_logprobs = _logprobs(server)
    update_info = _update_info(new_weights_path)
    sizes = [load_file(new_weights_path)[n].nbytes for n in update_info["names"]]
    assert max(sizes) > SMALL_BUFFER_BYTES and sum(sizes) > 4 * SMALL_BUFFER_BYTES  # several buckets, one oversized

    # 0.24: one group, the packed fields in each update_info; first tensor by tensor, then packed.
    trainer = trainer_at(vllm_source("0.24.0"))
    _assert_unique_id_pickles_as_vllms(trainer)
    _update(server, trainer, new_weights_path, update_info, packed=False, buffer_bytes=0)
    _assert_serves(server, new_weights_path)
    new_logprobs = _logprobs(server)
    assert new_logprobs != original_logprobs
    _update(server, trainer, original_path, _update_info(original_path), packed=False, buffer_bytes=0)
    _assert_serves(server, original_path)
    packed = {"packed": True, "packed_buffer_size_bytes": SMALL_BUFFER_BYTES, "packed_num_buffers": 2}
    _update(server, trainer, new_weights_path, {**update_info, **packed}, packed=True, buffer_bytes=SMALL_BUFFER_BYTES)
    _assert_serves(server, new_weights_path)
    assert _logprobs(server) == new_logprobs

    # 0.33: a new group whose handshake carries the packed fields; the second round's empty update_info reuses the
    # metadata (the same names back to the original checkpoint).
    trainer = trainer_at(vllm_source("0.33.0"), **packed)
    _assert_unique_id_pickles_as_vllms(trainer)
    empty = {"names": [], "dtype_names": [], "shapes": []}
    for path, info in ((original_path, update_info), (new_weights_path, empty), (original_path, empty)):
        _update(server, trainer, path, info, packed=True, buffer_bytes=SMALL_BUFFER_BYTES, v033=True)
        _assert_serves(server, path)
    assert _logprobs(server) == original_logprobs


class _RunsCode:
    """A pickle that would run `mkdir` when unpickled by plain pickle."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        import os

        return (os.mkdir, (str(self.path),))


def test_a_store_payload_that_runs_code_is_refused_without_running(server: Server, tmp_path: Path) -> None:
    """A trainer whose first broadcast is a pickle with a `__reduce__` payload: the server refuses the init with a
    400 naming the refusal, the payload never ran, and the server keeps serving."""
    marker = tmp_path / "payload-ran"
    port = free_port()

    def serve_store() -> TCPStore:
        store = replay_rank0_store("127.0.0.1", port, 2)  # returns once the server connected
        store.set("broadcast_from/0/0", pickle.dumps(_RunsCode(marker)))
        return store

    with ThreadPoolExecutor(1) as pool, _rendezvous_client(server) as http:
        store_side = pool.submit(serve_store)
        init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        response = http.post("/init_weight_transfer_engine", json={"init_info": init_info})
        store = store_side.result(RENDEZVOUS_TIMEOUT_S)
    assert response.status_code == 400, response.text
    assert "refused posix.mkdir" in response.json()["error"]["message"]
    assert not marker.exists()
    del store  # the trainer's end closes
    assert _logprobs(server)  # still serving
