"""The `nccl` backend end to end on CPU: a trainer process and the engine side over gloo, on 127.0.0.1.

One trainer process runs a fixed script of transfers; the test process plays the engine and follows the same script.
Each transfer uses different weights (a different seed), so a transfer that did not happen cannot pass.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from rlserve.config import WeightTransferConfig
from rlserve.dtypes import dtype_name
from rlserve.engine.wire.process import free_port
from rlserve.weight_transfer import (
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    compare_checksums,
    plan_buckets,
    weight_checksums,
)

TIMEOUT_S = 60.0
BUFFER_BYTES = 2000  # the model below then packs into several buckets, one of them an oversized tensor alone
SMALL_BUFFER_BYTES = 257  # an odd budget: dozens of buckets, most of them closing at unaligned sizes

# What the trainer sends and the engine does, in order. "reinit": both sides build a new group on the same port.
SCRIPT: list[dict[str, Any]] = [
    {"seed": 1, "packed": False, "num_buffers": 2, "engine": "receive"},
    {"seed": 2, "packed": True, "num_buffers": 1, "engine": "receive"},
    {"seed": 3, "packed": True, "num_buffers": 2, "engine": "receive"},
    {"seed": 4, "packed": False, "num_buffers": 2, "engine": "discard"},
    {"seed": 5, "packed": True, "num_buffers": 2, "engine": "discard"},
    {"seed": 6, "packed": True, "num_buffers": 2, "engine": "receive"},
    {"reinit": True},
    {"seed": 7, "packed": True, "num_buffers": 3, "engine": "receive"},
    # Many buckets through 1..4 alternating buffers, the engine's load slowed down so the trainer's next buckets
    # land while one is being loaded: a receive into a buffer still to be loaded would change the weights.
    *(
        {
            "seed": 8 + i,
            "packed": packed,
            "num_buffers": n,
            "engine": "receive",
            "buffer": SMALL_BUFFER_BYTES,
            "slow_load": True,
        }  # fmt: skip
        for i, (packed, n) in enumerate([(True, 1), (True, 2), (True, 3), (False, 2), (True, 4)])
    ),
    # vLLM 0.33's call, as SkyRL HEAD's worker extension makes it: receive_weights(update_info) into the target set
    # by set_weight_update_target.
    {"seed": 13, "packed": True, "num_buffers": 2, "engine": "receive into target"},
]


class TinyModel(nn.Module):
    """Mixed dtypes and odd byte counts (a 7-element bf16 vector, a 0-d scalar) so packed offsets are unaligned."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(37, 16, generator=gen))
        self.proj = nn.Parameter(torch.randn(24, 16, generator=gen))
        self.proj_bias = nn.Parameter(torch.randn(24, generator=gen))
        self.norm = nn.Parameter(torch.randn(7, generator=gen).to(torch.bfloat16))
        self.head = nn.Parameter(torch.randn(37, 24, generator=gen).to(torch.bfloat16))
        self.scale = nn.Parameter(torch.randn((), generator=gen))
        self.gate = nn.Parameter(torch.randn(5, 3, generator=gen).to(torch.float16))
        dtypes = (torch.bfloat16, torch.float32, torch.float16)
        self.extra = nn.ParameterList(
            torch.randn(3 + 11 * i, generator=gen).to(dtypes[i % 3]) for i in range(24)
        )  # fmt: skip

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)


def _trainer(port: int, out_dir: str) -> None:
    """The trainer process: joins the group as rank 0 and sends according to SCRIPT."""
    init = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "timeout_s": TIMEOUT_S}
    group = NCCLWeightTransferEngine.trainer_init(init)
    for step, action in enumerate(SCRIPT):
        if action.get("reinit"):
            group.shutdown()
            group = NCCLWeightTransferEngine.trainer_init(init)
            continue
        weights = dict(TinyModel(action["seed"]).named_parameters())
        # Written before sending, so the engine can read it once its receive returns.
        (Path(out_dir) / f"{step}.json").write_text(json.dumps(weight_checksums(weights.items())))
        args = NCCLTrainerSendWeightsArgs(
            group=group,
            packed=action["packed"],
            packed_buffer_size_bytes=action.get("buffer", BUFFER_BYTES),
            packed_num_buffers=action["num_buffers"],
            post_iter_func=lambda item: item[1].detach(),
        )
        NCCLWeightTransferEngine.trainer_send_weights(iter(weights.items()), args)
    group.shutdown()


def _update_info(model: nn.Module, action: dict[str, Any]) -> dict[str, Any]:
    params = list(model.named_parameters())
    return {
        "names": [name for name, _ in params],
        "dtype_names": [dtype_name(p.dtype) for _, p in params],
        "shapes": [list(p.shape) for _, p in params],
        "packed": action["packed"],
        "packed_buffer_size_bytes": action.get("buffer", BUFFER_BYTES),
        "packed_num_buffers": action["num_buffers"],
    }


def _assert_equal_models(got: nn.Module, want: nn.Module, what: str) -> None:
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), (
            f"{what}: {name} differs"
        )


def test_model_packs_into_several_buckets() -> None:
    sizes = [p.nbytes for p in TinyModel(0).parameters()]
    buckets = plan_buckets(sizes, BUFFER_BYTES)
    assert len(buckets) >= 3 and any(len(b) == 1 and sizes[b[0]] > BUFFER_BYTES for b in buckets)
    assert any(len(b) > 1 for b in buckets)
    small = plan_buckets(sizes, SMALL_BUFFER_BYTES)
    assert len(small) >= 15 and any(sum(sizes[i] for i in b) % 4 for b in small)


def test_two_process_transfer_over_gloo(tmp_path: Path) -> None:
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(target=_trainer, args=(port, str(tmp_path)), daemon=True)
    trainer.start()
    engine = NCCLWeightTransferEngine(WeightTransferConfig("nccl"), torch.device("cpu"), timeout_s=TIMEOUT_S)
    init_info = engine.parse_init_info({"master_address": "127.0.0.1", "master_port": port, "world_size": 2})
    target = TinyModel(0)
    try:
        engine.init_transfer_engine(init_info)  # blocks until the trainer has joined
        last_received = 0
        for step, action in enumerate(SCRIPT):
            if action.get("reinit"):
                engine.init_transfer_engine(init_info)
                continue
            what = f"step {step} {action}"
            update_info = engine.parse_update_info(_update_info(target, action))
            if action["engine"] == "receive into target":
                engine.set_weight_update_target(target, None)
                try:
                    engine.receive_weights(update_info)
                finally:
                    engine.reset_weight_update_target()
                last_received = action["seed"]
            elif action["engine"] == "receive":
                calls: list[int] = []

                slow = "slow_load" in action

                def load_weights(
                    weights: list[tuple[str, torch.Tensor]], calls: list[int] = calls, slow: bool = slow
                ) -> None:
                    calls.append(len(weights))
                    if slow:
                        time.sleep(0.002)  # the next buckets arrive meanwhile
                    target.load_weights(weights)

                engine.receive_weights(update_info, load_weights)
                last_received = action["seed"]
                sizes = [p.nbytes for p in target.parameters()]  # one load call per bucket
                assert calls == [len(b) for b in plan_buckets(sizes, action.get("buffer", BUFFER_BYTES))], what
            else:
                engine.discard_weights(update_info)
            # After a discard the target still holds the last received weights, byte for byte.
            _assert_equal_models(target, TinyModel(last_received), what)
            sent = json.loads((tmp_path / f"{step}.json").read_text())
            result = compare_checksums(sent, weight_checksums(target.named_parameters()))
            assert result["match"] == (action["engine"] != "discard"), (what, result)
        trainer.join(TIMEOUT_S)
        assert trainer.exitcode == 0, f"trainer exit code {trainer.exitcode}"
    finally:
        engine.shutdown()
        if trainer.is_alive():
            trainer.kill()
            trainer.join(5)


def test_rendezvous_times_out_without_trainer() -> None:
    engine = NCCLWeightTransferEngine(WeightTransferConfig("nccl"), torch.device("cpu"), timeout_s=1.0)
    info = engine.parse_init_info({"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2})
    with pytest.raises(RuntimeError, match="rendezvous"):
        engine.init_transfer_engine(info)
