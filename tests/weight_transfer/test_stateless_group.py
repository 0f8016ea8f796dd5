"""What the trainer's store may hold, decoded without general unpickling (rlserve.weight_transfer.stateless_group):
prime-rl's per-state-dict metadata and vLLM's pickled NCCL unique id are restored; anything else is refused."""

from __future__ import annotations

import ctypes
import os
import pickle
import sys
import types

import pytest
import torch

from rlserve.weight_transfer.nccl_library import ncclUniqueId
from rlserve.weight_transfer.stateless_group import decode_store_value

VLLM_WRAPPER = "vllm.distributed.device_communicators.pynccl_wrapper"


def test_prime_rl_metadata_is_restored() -> None:
    # prime-rl 559b4477 broadcast_state_dict: {dtype: [(key, value.shape, value.numel())]}
    metadata = {torch.bfloat16: [("model.norm.weight", torch.Size([64]), 64)], torch.float32: []}
    assert decode_store_value(pickle.dumps(metadata)) == metadata


def test_vllms_unique_id_is_restored_as_rlserves(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's `ncclUniqueId` (a ctypes structure of 128 bytes), pickled under vLLM's module name."""
    parts = VLLM_WRAPPER.split(".")
    for i in range(1, len(parts) + 1):  # pickle imports the module, parents first
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    vllm_id = type("ncclUniqueId", (ctypes.Structure,), {"_fields_": [("internal", ctypes.c_byte * 128)]})
    vllm_id.__module__ = VLLM_WRAPPER
    sys.modules[VLLM_WRAPPER].ncclUniqueId = vllm_id
    sent = vllm_id()
    ctypes.memmove(sent.internal, os.urandom(128), 128)
    received = decode_store_value(pickle.dumps(sent))
    assert isinstance(received, ncclUniqueId) and bytes(received.internal) == bytes(sent.internal)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize("obj", [_Exploit(), types.SimpleNamespace(a=1), ctypes.c_int(3)])
def test_anything_else_is_refused(obj: object) -> None:
    with pytest.raises(ValueError, match="weight-transfer store"):
        decode_store_value(pickle.dumps(obj))


def test_garbage_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        decode_store_value(b"\x80\x04not a pickle")
