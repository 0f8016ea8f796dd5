"""On a GPU, an engine whose user sets no batch limits gets the ones rlserve.engine.device_defaults chooses for that
GPU (on an H200: W1's tuned 1,024 sequences and 16,384 tokens per step), and a limit the user sets wins."""

from __future__ import annotations

import pytest
import torch

from rlserve import LLM
from rlserve.engine.device_defaults import batch_limits, describe_cuda_device
from rlserve.toy import make_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("given", [{}, {"max_num_seqs": 32}])
def test_llm_takes_the_devices_batch_limits(tmp_path, monkeypatch, given):
    monkeypatch.setenv("RLSERVE_ENABLE_MULTIPROCESSING", "0")  # the core's config is read in this process
    expected = batch_limits(describe_cuda_device("cuda"))
    if torch.cuda.get_device_properties(0).total_memory >= 120 << 30:  # an H200-class GPU: W1's tuned settings
        assert (expected.max_num_seqs, expected.max_num_batched_tokens) == (1024, 16384)
    llm = LLM(str(make_model_dir(tmp_path / "m", preset="tiny")), device="cuda", gpu_memory_utilization=0.3, **given)
    try:
        config = llm.engine_core.config
        assert config.max_num_seqs == given.get("max_num_seqs", expected.max_num_seqs)
        assert config.max_num_batched_tokens == expected.max_num_batched_tokens
        assert llm.engine_core.scheduler.config.max_num_seqs == config.max_num_seqs
    finally:
        llm.shutdown()
