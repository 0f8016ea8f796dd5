"""The batch limits an engine gets when its user sets none, chosen from the device, as vLLM 0.33 does.

vLLM 0.33 (`EngineArgs.get_batch_defaults`) gives `max_num_seqs` and `max_num_batched_tokens` by the device's total
memory: 1,024 sequences and 16,384 tokens per step for `LLM` on a GPU of at least 160 GiB, and on one of at least
70 GiB unless it is an A100 (larger batches cut its throughput, vLLM PR 17885) or a GB10 (compute capability 12.1:
the memory of a large GPU, not its compute); 256 and 8,192 otherwise. These are W1's tuned settings
(benchmarks/workloads.py; W1 under rlserve's earlier fixed defaults, 256 and 8,192, ran at 0.81x of them on an H200,
issue 33). Where rlserve departs from vLLM:
its API server gets the `LLM` class's 16,384 tokens on the 70-160 GiB tier too (vLLM's server gets 8,192, shorter
prefill chunks for lower latency between tokens; an RL rollout server is there for throughput), and the CPU keeps
rlserve's 256 and 8,192 (vLLM's CPU defaults are 256 and 4,096 per rank). A value the user sets always wins.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from rlserve.config import EngineConfig

logger = logging.getLogger(__name__)

GIB = 1 << 30
LIMITS = ("max_num_seqs", "max_num_batched_tokens")


@dataclass(frozen=True)
class DeviceDescription:
    """What the choice reads of a GPU (torch.cuda.get_device_properties)."""

    name: str
    total_memory: int  # bytes
    multi_processor_count: int
    capability: tuple[int, int]


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    tier: str  # why, for the start-up log


def batch_limits(device: DeviceDescription | None) -> BatchLimits:
    """The limits for `device` (None: the CPU)."""
    if device is None:
        return BatchLimits(256, 8192, "the CPU")
    memory = f"{device.total_memory / GIB:.0f} GiB"
    if device.total_memory >= 160 * GIB:
        return BatchLimits(1024, 16384, f"a GPU of {memory} (>= 160 GiB)")
    if device.total_memory >= 70 * GIB:
        if "a100" in device.name.lower():
            return BatchLimits(256, 8192, f"an A100 ({memory}; larger batches cut its throughput)")
        if device.capability == (12, 1):
            return BatchLimits(256, 8192, f"a GB10 ({memory}, compute capability 12.1: not a large GPU's compute)")
        return BatchLimits(1024, 16384, f"a GPU of {memory} (70-160 GiB, H100/H200 class)")
    return BatchLimits(256, 8192, f"a GPU of {memory} (< 70 GiB)")


def describe_cuda_device(device: str) -> DeviceDescription:
    import torch  # here: the config module and its users stay importable without initialising CUDA

    props = torch.cuda.get_device_properties(torch.device(device))
    return DeviceDescription(props.name, props.total_memory, props.multi_processor_count, (props.major, props.minor))


def with_device_defaults(config: EngineConfig, device: DeviceDescription | None = None) -> EngineConfig:
    """`config` with the limits the user left unset (None) chosen for its device, logged; `device` defaults to the
    config's (read from CUDA, in the process that runs the engine: the front end never initialises CUDA)."""
    unset = [name for name in LIMITS if getattr(config, name) is None]
    if not unset:
        return config
    if device is None and config.device.startswith("cuda"):
        device = describe_cuda_device(config.device)
    limits = batch_limits(device)
    chosen = {name: getattr(limits, name) for name in unset}
    where = "cpu" if device is None else f"{device.name}, {device.multi_processor_count} SMs"
    logger.info(
        "batch limits for %s (%s): %s; --max-num-seqs and --max-num-batched-tokens set them",
        limits.tier,
        where,
        ", ".join(f"{name}={value}" for name, value in chosen.items()),
    )
    return replace(config, **chosen)
