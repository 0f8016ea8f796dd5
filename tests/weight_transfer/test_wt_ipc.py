"""The `ipc` backend end to end on one GPU: a trainer process shares its tensors, the test process plays the engine.

Update infos travel over a pipe as JSON bytes (as they would in an HTTP body), never pickled.
"""

from __future__ import annotations

import json
import multiprocessing
from multiprocessing.connection import Connection

import pytest
import torch

from rlserve.config import WeightTransferConfig
from rlserve.weight_transfer import (
    IPCStagingBuffer,
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    compare_checksums,
    weight_checksums,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TIMEOUT_S = 60.0
SYNCS = 5  # repeated syncs must not grow the trainer's memory (one export, one release per sync)


def _weights(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": ((300, 64), torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": ((64, 64), torch.bfloat16),
        "model.layers.0.input_layernorm.weight": ((7,), torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": ((96, 64), torch.float32),
        "model.layers.0.mlp.down_proj.bias": ((), torch.float32),
        "model.norm.weight": ((64,), torch.float16),
    }
    return {name: torch.randn(shape, generator=gen).to(dtype).to(device) for name, (shape, dtype) in shapes.items()}


def _trainer(conn: Connection, packed: bool, buffer_bytes: int, keep: bool) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)

    def send(update_info: dict) -> None:
        conn.send_bytes(json.dumps(update_info).encode())
        reply = conn.recv_bytes()
        if reply != b"ok":
            raise RuntimeError(f"engine refused the update: {reply.decode()}")

    staging = IPCStagingBuffer(buffer_bytes) if keep else None  # one export for every sync
    args = IPCTrainerSendWeightsArgs(
        send_mode=send, packed=packed, packed_buffer_size_bytes=buffer_bytes, staging=staging
    )
    allocated = []
    for sync in range(SYNCS):
        weights = _weights(sync + 1, device)
        IPCWeightTransferEngine.trainer_send_weights(iter(weights.items()), args)
        del weights
        torch.cuda.ipc_collect()
        allocated.append(torch.cuda.memory_allocated(device))
    conn.send_bytes(json.dumps({"done": True, "allocated": allocated}).encode())


@pytest.mark.parametrize(
    ("packed", "buffer_bytes", "keep"),
    [(False, 1 << 20, False), (True, 40_000, False), (True, 1 << 20, False), (True, 40_000, True)],
)
def test_ipc_transfer_on_one_gpu(packed: bool, buffer_bytes: int, keep: bool) -> None:
    device = torch.device("cuda", 0)
    ctx = multiprocessing.get_context("spawn")
    engine_end, trainer_end = ctx.Pipe()
    trainer = ctx.Process(target=_trainer, args=(trainer_end, packed, buffer_bytes, keep), daemon=True)
    trainer.start()
    engine = IPCWeightTransferEngine(WeightTransferConfig("ipc"), device)
    engine.init_transfer_engine(engine.parse_init_info({}))
    target = {name: torch.zeros_like(t) for name, t in _weights(0, device).items()}

    def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            target[name].copy_(tensor)

    try:
        sync, chunks, mappings = 0, 0, set()
        while True:
            assert engine_end.poll(TIMEOUT_S), "trainer went silent"
            message = json.loads(engine_end.recv_bytes())
            if message.get("done"):
                break
            try:
                info = engine.parse_update_info(message)
                assert info.packed == packed
                engine.receive_weights(info, load_weights)
            except Exception as e:
                engine_end.send_bytes(repr(e).encode())
                raise
            chunks += 1
            if info.is_last_chunk:
                if keep:  # the kept buffer stays mapped: one mapping for every sync
                    mappings.add(id(engine._mapping.buffer))
                else:
                    assert engine._mapping is None  # the sync's buffer was released with its last chunk
                sync += 1
                want = weight_checksums(_weights(sync, device).items())
                assert compare_checksums(want, weight_checksums(target.items()))["match"], f"sync {sync}"
            engine_end.send_bytes(b"ok")
        assert sync == SYNCS
        assert len(mappings) == (1 if keep else 0)
        if packed and buffer_bytes < 100_000:
            assert chunks >= 2 * SYNCS  # the small buffer forced several chunks per sync
        allocated = message["allocated"]
        assert allocated[-1] == allocated[0], f"trainer memory grew across syncs: {allocated}"
        trainer.join(TIMEOUT_S)
        assert trainer.exitcode == 0
    finally:
        engine.shutdown()
        if trainer.is_alive():
            trainer.kill()
            trainer.join(5)


def test_ipc_packed_refuses_tensor_larger_than_buffer() -> None:
    weights = _weights(0, torch.device("cuda", 0))
    args = IPCTrainerSendWeightsArgs(send_mode=lambda info: None, packed=True, packed_buffer_size_bytes=1024)
    with pytest.raises(ValueError, match="more than the packed buffer"):
        IPCWeightTransferEngine.trainer_send_weights(iter(weights.items()), args)
