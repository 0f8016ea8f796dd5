"""vLLM 0.33's trainer engines on CUDA: `ipc` colocated on one GPU, and `sparse_nccl` over real NCCL (trainer
cuda:0, engine cuda:1; skipped without two GPUs). The CPU versions (gloo) run everywhere in
tests/weight_transfer/test_wt_033.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve import LLM, WeightTransferConfig
from rlserve.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
from rlserve.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from rlserve.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLTrainerInitInfo, SparseWeightPatch
from rlserve.rl.engine_server import free_port
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import compare_checksums, weight_checksums
from rlserve.weight_transfer.sparse_nccl import SparseDelta

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return (
        make_model_dir(tmp_path_factory.mktemp("old"), preset="small", seed=0),
        make_model_dir(tmp_path_factory.mktemp("new"), preset="small", seed=1),
    )


def _model(path: Path, device: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.bfloat16).to(device)


def _checksums(weights) -> dict[str, str]:
    return weight_checksums((name, t.cpu()) for name, t in weights)


@pytest.mark.parametrize("packed", [False, True])
def test_ipc_trainer_engine_updates_an_llm(checkpoints: tuple[Path, Path], packed: bool) -> None:
    old, new = checkpoints
    ipc = WeightTransferConfig("ipc")
    llm = LLM(str(old), dtype="bfloat16", device="cuda:0", num_kv_blocks=256, weight_transfer_config=ipc)
    try:
        trainer_model = _model(new, "cuda:0")
        init_info = IPCTrainerInitInfo(packed=packed, packed_buffer_size_bytes=4 << 20)
        engine = WeightTransferTrainerFactory.trainer_init(init_info, client=llm, source=ModuleSource(trainer_model))
        engine.send_weights()
        assert compare_checksums(_checksums(trainer_model.state_dict().items()), llm.weight_checksums())["match"]
    finally:
        llm.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one rank per GPU)")
def test_sparse_nccl_over_two_gpus(checkpoints: tuple[Path, Path]) -> None:
    old, _ = checkpoints
    llm = LLM(
        str(old), dtype="bfloat16", device="cuda:1", num_kv_blocks=256,
        weight_transfer_config=WeightTransferConfig("sparse_nccl"),
    )  # fmt: skip
    torch.cuda.set_device(0)
    try:
        init_info = SparseNCCLTrainerInitInfo("127.0.0.1", free_port(), 2, timeout_s=TIMEOUT_S)
        engine = WeightTransferTrainerFactory.trainer_init(init_info, client=llm)
        delta = SparseDelta(_model(old, "cuda:0").state_dict().items())
        gen = torch.Generator(device="cuda:0").manual_seed(0)
        new = {
            n: torch.where(torch.rand(t.shape, generator=gen, device="cuda:0") < 0.02, t + 0.01, t)
            for n, t in delta.previous.items()
        }
        patches = delta.patches(new.items())
        engine.send_weights(patches)
        delta.commit(patches)
        assert compare_checksums(_checksums(new.items()), llm.weight_checksums())["match"]

        before = llm.weight_checksums()
        patches = delta.patches({n: t + 0.01 for n, t in new.items()}.items())
        last = patches[-1]
        patches[-1] = SparseWeightPatch(last.name, last.indices.clone().fill_(-1), last.values, last.full_shape)
        with pytest.raises(ValueError, match="out of bounds"):
            engine.send_weights(patches)
        assert llm.abandon_weight_update() == "unchanged"
        assert llm.weight_checksums() == before
        engine.shutdown()
    finally:
        llm.shutdown()
