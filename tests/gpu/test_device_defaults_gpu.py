"""On a GPU, an engine whose user sets no batch limits gets the ones rlserve.engine.core.device_defaults chooses for
that GPU (on an H200: W1's tuned 1,024 sequences and 16,384 tokens per step), and a limit the user sets wins."""

from __future__ import annotations

import pytest
import torch

from rlserve import LLM
from rlserve.config import EngineConfig
from rlserve.engine.core.device_defaults import batch_limits, describe_cuda_device, with_device_defaults
from rlserve.toy import make_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_llm_takes_the_devices_batch_limits(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSERVE_ENABLE_MULTIPROCESSING", "0")  # the core's config is read in this process
    device = describe_cuda_device("cuda")
    expected = batch_limits(device)
    if device.total_memory >= 120 << 30:  # an H200-class GPU: W1's tuned settings
        assert (expected.max_num_seqs, expected.max_num_batched_tokens) == (1024, 16384)
    model = make_model_dir(tmp_path / "m", preset="tiny")
    llm = LLM(str(model), device="cuda", gpu_memory_utilization=0.3, enforce_eager=True)
    try:
        config = llm.engine_core.config
        assert (config.max_num_seqs, config.max_num_batched_tokens) == (
            expected.max_num_seqs,
            expected.max_num_batched_tokens,
        )
        assert llm.engine_core.scheduler.config.max_num_seqs == expected.max_num_seqs
    finally:
        llm.shutdown()
    given = with_device_defaults(EngineConfig(model=str(model), device="cuda", max_num_seqs=32))
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (32, expected.max_num_batched_tokens)
