"""Which client of the engine core a front end gets for a config: the data-parallel ones (dp_client.py), one core in
a process of its own (core_client.py) or one in this process (inproc_client.py)."""

from __future__ import annotations

from typing import Any

from rlserve.config import EngineConfig
from rlserve.engine.frontend.core_client import AsyncMPClient, MPClient
from rlserve.engine.frontend.dp_client import DPAsyncMPClient, DPMPClient
from rlserve.engine.frontend.launcher import multiprocessing_enabled


def _check_data_parallel(config: EngineConfig) -> bool:
    """Whether `config` asks for the data-parallel client: several cores (each then needs a process of its own), or
    cores that are Ray actors (their launcher, which holds the placement group, belongs to that client)."""
    if config.data_parallel_size > 1 and not multiprocessing_enabled():
        raise ValueError(
            f"data_parallel_size: {config.data_parallel_size} engine cores run in processes of their own; unset "
            "RLSERVE_ENABLE_MULTIPROCESSING=0 (or VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        )
    if config.data_parallel_backend == "ray" and not multiprocessing_enabled():
        raise ValueError(
            "data_parallel_backend: ray runs the engine cores as Ray actors, not in this process; unset "
            "RLSERVE_ENABLE_MULTIPROCESSING=0 (or VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        )
    return config.data_parallel_size > 1 or config.data_parallel_backend == "ray"


def make_client(config: EngineConfig) -> Any:
    if _check_data_parallel(config):
        return DPMPClient(config)
    if multiprocessing_enabled():
        return MPClient(config)
    from rlserve.engine.frontend.inproc_client import InprocClient  # here: only this mode imports the core

    return InprocClient(config)


def make_async_client(config: EngineConfig) -> Any:
    if _check_data_parallel(config):
        return DPAsyncMPClient(config)
    if multiprocessing_enabled():
        return AsyncMPClient(config)
    from rlserve.engine.frontend.inproc_client import AsyncInprocClient  # here: only this mode imports the core

    return AsyncInprocClient(config)
