"""A trainer rank for test_wt_033_http.py, in a module of its own: a spawned process imports only this (not the test
module, whose conftest imports would resolve against whatever conftest comes first on the child's path)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from server_helpers import API_KEY
from transformers import AutoModelForCausalLM

from rlserve.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
from rlserve.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

TIMEOUT_S = 60.0


def trainer_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)


def sharded_trainer(rank: int, url: str, model_dir: str, store_port: int, transfer_port: int) -> None:
    """One rank of a two-rank trainer whose every parameter is a DTensor sharded on dim 0 (FSDP's layout): both
    ranks run the same code; rank 0 sends, rank 1 joins the per-tensor gathers."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = trainer_model(Path(model_dir))
        mesh = init_device_mesh("cpu", (2,))
        for name, param in list(model.named_parameters()):
            module_name, _, leaf = name.rpartition(".")
            sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
            setattr(model.get_submodule(module_name), leaf, torch.nn.Parameter(sharded, requires_grad=False))
        init_info = NCCLTrainerInitInfo("127.0.0.1", transfer_port, 2, rank=rank, timeout_s=TIMEOUT_S)
        client = HTTPVLLMWeightSyncClient(url, timeout=TIMEOUT_S, api_key=API_KEY)
        engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=ModuleSource(model))
        engine.send_weights()
        engine.shutdown()
    finally:
        dist.destroy_process_group()
