"""Batch limits chosen per device when the user sets none (rlserve.engine.core.device_defaults): vLLM 0.33's tiers by
memory (EngineArgs.get_batch_defaults, read from the vllm==0.33.0 wheel), on descriptions of real devices; a value
the user sets always wins; on the CPU nothing changes."""

from __future__ import annotations

import logging

import pytest

from rlserve import LLM
from rlserve.config import EngineConfig
from rlserve.engine.core.device_defaults import GIB, DeviceDescription, batch_limits, with_device_defaults

H200 = DeviceDescription("NVIDIA H200", 150_119_661_568, 132, (9, 0))  # 139.8 GiB, as torch reports it
H100 = DeviceDescription("NVIDIA H100 80GB HBM3", 85_045_510_144, 132, (9, 0))
B200 = DeviceDescription("NVIDIA B200", 191_513_804_800, 148, (10, 0))
A100 = DeviceDescription("NVIDIA A100-SXM4-80GB", 85_899_345_920, 108, (8, 0))
GB10 = DeviceDescription("NVIDIA GB10", 128 * GIB, 48, (12, 1))
L4 = DeviceDescription("NVIDIA L4", 23_580_639_232, 58, (8, 9))


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (H200, (1024, 16384)),  # W1's tuned settings
        (H100, (1024, 16384)),
        (B200, (1024, 16384)),  # >= 160 GiB: the largest tier
        (A100, (256, 8192)),  # vLLM keeps the A100 small: larger batches cut its throughput
        (GB10, (256, 8192)),  # the memory of a large GPU, not its compute
        (L4, (256, 8192)),
        (None, (256, 8192)),  # the CPU
    ],
)
def test_limits_per_device(device, expected):
    limits = batch_limits(device)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == expected


def test_unset_limits_are_chosen_for_the_device_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="rlserve.engine.core.device_defaults"):
        config = with_device_defaults(EngineConfig(model="m", device="cuda"), device=H200)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (1024, 16384)
    assert "max_num_seqs=1024" in caplog.text and "NVIDIA H200, 132 SMs" in caplog.text


@pytest.mark.parametrize("given", [{"max_num_seqs": 64}, {"max_num_batched_tokens": 2048}, {"max_num_seqs": 2048}])
def test_a_value_the_user_sets_wins(given):
    config = with_device_defaults(EngineConfig(model="m", device="cuda", **given), device=H200)
    chosen = {"max_num_seqs": 1024, "max_num_batched_tokens": 16384} | given
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (
        chosen["max_num_seqs"],
        chosen["max_num_batched_tokens"],
    )


def test_both_set_reads_no_device():
    config = EngineConfig(model="m", device="cuda:7", max_num_seqs=8, max_num_batched_tokens=64)
    assert with_device_defaults(config) is config  # no CUDA query: there is no cuda:7 here


def test_cpu_engine_keeps_its_limits(qwen3_dir, monkeypatch):
    monkeypatch.setenv("RLSERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(qwen3_dir), device="cpu")
    try:
        config = llm.engine_core.config
        assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 8192)
        assert llm.engine_core.scheduler.config.max_num_seqs == 256
    finally:
        llm.shutdown()
