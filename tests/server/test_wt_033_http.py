"""vLLM 0.33's trainer-side classes against a real `rlserve serve` over HTTP (gloo on CPU): a two-rank trainer whose
parameters are DTensor shards, a plain one, the sparse backend (equal to the full update, refused whole when
invalid), and start_draft_weight_update refused."""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import _serve
from server_helpers import API_KEY, Server, free_port
from sharded_trainer import TIMEOUT_S, sharded_trainer, trainer_model

from rlserve.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
from rlserve.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
from rlserve.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLTrainerInitInfo, SparseWeightPatch
from rlserve.rl.client import RLServeError
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import compare_checksums, weight_checksums
from rlserve.weight_transfer.sparse_nccl import SparseDelta


def _client(server: Server) -> HTTPVLLMWeightSyncClient:
    return HTTPVLLMWeightSyncClient(server.url, timeout=TIMEOUT_S, api_key=API_KEY)


def test_trainer_engines_update_a_server_over_http(server: Server, server_model_dir: Path, tmp_path: Path) -> None:
    client = _client(server)
    original = trainer_model(server_model_dir)
    new_dir = make_model_dir(tmp_path / "new", initializer_range=0.2, seed=5)
    new = weight_checksums(trainer_model(new_dir).state_dict().items())

    ctx = multiprocessing.get_context("spawn")
    args = (server.url, str(new_dir), free_port(), free_port())
    ranks = [ctx.Process(target=sharded_trainer, args=(rank, *args)) for rank in range(2)]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(TIMEOUT_S * 2)
        assert [p.exitcode for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
    assert compare_checksums(new, client.weight_checksums())["match"]

    # A plain (unsharded) trainer in this process puts the shared server's weights back.
    init_info = NCCLTrainerInitInfo("127.0.0.1", free_port(), client.get_world_size() + 1, timeout_s=TIMEOUT_S)
    engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=ModuleSource(original))
    engine.send_weights()
    engine.shutdown()
    client.shutdown_weight_transfer_engine()
    assert compare_checksums(weight_checksums(original.state_dict().items()), client.weight_checksums())["match"]

    with server.client() as http:
        response = http.post("/start_draft_weight_update")
    assert response.status_code == 409 and "no speculative draft model" in response.text


@pytest.fixture(scope="module")
def sparse_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server-logs") / "sparse.log"
    args = ("--enable-rl-api", "--weight-transfer-config", json.dumps({"backend": "sparse_nccl"}))
    yield from _serve(server_model_dir, log, *args, api_key=API_KEY)


def test_sparse_updates_over_http(sparse_server: Server, server_model_dir: Path) -> None:
    client = _client(sparse_server)
    init_info = SparseNCCLTrainerInitInfo("127.0.0.1", free_port(), 2, timeout_s=TIMEOUT_S)
    engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client)
    delta = SparseDelta(trainer_model(server_model_dir).state_dict().items())
    gen = torch.Generator().manual_seed(0)
    new = {n: torch.where(torch.rand(t.shape, generator=gen) < 0.02, t + 1e-3, t) for n, t in delta.previous.items()}
    patches = delta.patches(new.items())
    engine.send_weights(patches)
    delta.commit(patches)
    assert compare_checksums(weight_checksums(new.items()), client.weight_checksums())["match"]

    before = client.weight_checksums()
    moved = {n: t + 1e-3 for n, t in new.items()}
    patches = delta.patches(moved.items())
    last = patches[-1]
    patches[-1] = SparseWeightPatch(last.name, last.indices.clone().fill_(-1), last.values, last.full_shape)
    with pytest.raises(RLServeError) as refused:
        engine.send_weights(patches)
    assert refused.value.status_code == 400 and "out of bounds" in str(refused.value.body)
    with sparse_server.client() as http:
        assert http.post("/abandon_weight_update").json()["weights"] == "unchanged"
    assert client.weight_checksums() == before
    engine.shutdown()
