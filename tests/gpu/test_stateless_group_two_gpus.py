"""The CUDA path of rlserve's member of a vLLM-style trainer group (prime-rl's and PipelineRL's), on two GPUs: rank 0
plays vLLM's StatelessProcessGroup + PyNcclCommunicator from their wire facts (a TCPStore it serves, its NCCL unique
id pickled under `broadcast_from/0/0` as vLLM's ctypes `ncclUniqueId`, a one-element warm-up all-reduce, then typed
broadcasts); rank 1 is `StatelessGroupMember` on cuda:1."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import pickle
import sys
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rlserve.engine.wire.process import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
VLLM_WRAPPER = "vllm.distributed.device_communicators.pynccl_wrapper"
TIMEOUT_S = 60


def _vllm_unique_id(raw: bytes) -> object:
    parts = VLLM_WRAPPER.split(".")
    for i in range(1, len(parts) + 1):  # pickle imports the module, parents first (a spawned child: no vLLM)
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    cls = type("ncclUniqueId", (ctypes.Structure,), {"_fields_": [("internal", ctypes.c_byte * 128)]})
    cls.__module__ = VLLM_WRAPPER
    sys.modules[VLLM_WRAPPER].ncclUniqueId = cls
    uid = cls()
    ctypes.memmove(uid.internal, raw, 128)
    return uid


def _trainer(port: int, queue: mp.Queue) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=TIMEOUT_S))
    raw = torch.cuda.nccl.unique_id()
    store.set("broadcast_from/0/0", pickle.dumps(_vllm_unique_id(raw)))
    comm = torch.cuda.nccl.init_rank(2, raw, 0)
    torch.cuda.nccl.all_reduce([torch.zeros(1, device=device)], comms=[comm])
    for tensor in (torch.arange(12, dtype=torch.bfloat16, device=device), torch.full((3, 4), 2.5, device=device)):
        torch.cuda.nccl.broadcast([tensor], root=0, comms=[comm])
    torch.cuda.synchronize(device)
    queue.put("sent")


def test_member_receives_typed_broadcasts_from_a_pynccl_style_trainer() -> None:
    from rlserve.weight_transfer.framework_group import StatelessGroupMember

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(port, queue))
    trainer.start()
    try:
        member = StatelessGroupMember.join("127.0.0.1", port, 1, 2, torch.device("cuda", 1), TIMEOUT_S)
        first = torch.empty(12, dtype=torch.bfloat16, device="cuda:1")
        second = torch.empty(3, 4, device="cuda:1")
        for tensor in (first, second):
            member.broadcast(tensor).wait()
        torch.cuda.synchronize(1)
        assert torch.equal(first.cpu(), torch.arange(12, dtype=torch.bfloat16))
        assert torch.equal(second.cpu(), torch.full((3, 4), 2.5))
        assert queue.get(timeout=TIMEOUT_S) == "sent"
        member.shutdown()
    finally:
        trainer.join(TIMEOUT_S)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0
