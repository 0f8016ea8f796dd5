"""torch.profiler traces of the engine-core processes: vLLM 0.33's `start_profile` / `stop_profile`.

With `profiler_config` (ProfilerConfig, vLLM's `--profiler-config`) set to the torch profiler, every engine-core
process (each data-parallel rank) and each of its tensor-parallel ranks runs a torch.profiler of its own from
`start_profile` to `stop_profile`, and writes one Chrome trace when it stops, as vLLM's workers do:

    <torch_profiler_dir>/[<prefix>_]dp<D>_pp0_tp<T>_dcp0_ep<E>_rank<T>.<time_ns>.pt.trace.json[.gz]

(vLLM's rank suffix, torch's trace-file naming), so ranks never collide. Each engine step is an `engine_step` range in
the trace. A session may skip `delay_iterations` steps before the trace starts and stop tracing by itself after
`max_iterations` steps; it stays open until `stop_profile` either way. The front ends are not traced.

The core owns the session (`ProfileSession`, one per core); the front ends check what they can before sending the call
(`check_session`) and the core checks again, since several front ends (API server processes) share it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from rlserve.config import EngineConfig, ProfilerConfig

logger = logging.getLogger(__name__)

# torch.profiler.profile's switches that one session may override (start_profile's profiler_kwargs): plain booleans,
# so that they travel to the core as data. vLLM passes any keyword through.
PROFILER_KWARGS = ("record_shapes", "profile_memory", "with_stack", "with_flops", "with_modules")
STEP_RANGE = "engine_step"  # the name of each engine step's range in the trace

NOT_ENABLED = (
    "profiling is not enabled: start the engine with profiler_config={'profiler': 'torch', 'torch_profiler_dir': DIR} "
    '(rlserve serve: --profiler-config \'{"profiler": "torch", "torch_profiler_dir": "DIR"}\')'
)
# vLLM 0.33's ProfilerAlreadyActiveError (HTTP 409)
ALREADY_ACTIVE = "A profiling session is already active. Call /stop_profile before starting another session."


def profiling_enabled(config: EngineConfig) -> bool:
    return config.profiler_config is not None and config.profiler_config.enabled


def require_profiling(config: EngineConfig) -> ProfilerConfig:
    if not profiling_enabled(config):
        raise RuntimeError(NOT_ENABLED)
    return config.profiler_config


def check_session(
    config: ProfilerConfig,
    profile_prefix: str | None,
    delay_iterations: int | None,
    max_iterations: int | None,
    profiler_kwargs: dict[str, Any] | None,
) -> None:
    """start_profile's arguments, checked as vLLM checks them (a ValueError naming the argument); and the operator's
    `max_iterations` is a ceiling: a session may trace fewer steps, never more (nor until stop_profile)."""
    prefix = profile_prefix
    if prefix is not None:
        # vLLM's rule: a prefix is part of a file name, never a path
        valid = (
            isinstance(prefix, str)
            and 1 <= len(prefix) <= 128
            and prefix.isascii()
            and prefix[0].isalnum()
            and all(c.isalnum() or c in "._-" for c in prefix[1:])
        )
        if not valid:
            raise ValueError(
                "profile_prefix must be 1-128 ASCII characters, start with a letter or number, and contain only "
                f"letters, numbers, '.', '_', or '-'; got {prefix!r}"
            )
    for name, value in (("delay_iterations", delay_iterations), ("max_iterations", max_iterations)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be an integer greater than or equal to 0, got {value!r}")
    ceiling = config.max_iterations
    if ceiling and max_iterations is not None and not 0 < max_iterations <= ceiling:
        raise ValueError(
            f"max_iterations: at most {ceiling}, the operator's profiler_config.max_iterations (0, tracing until "
            f"stop_profile, is more), got {max_iterations}"
        )
    if profiler_kwargs is not None:
        if not isinstance(profiler_kwargs, dict):
            raise ValueError(f"profiler_kwargs: expected a dict, got {type(profiler_kwargs).__name__}")
        for key, value in profiler_kwargs.items():
            if key not in PROFILER_KWARGS:
                raise ValueError(
                    f"profiler_kwargs: {key!r} is not supported (rlserve takes torch.profiler.profile's "
                    f"{list(PROFILER_KWARGS)})"
                )
            if not isinstance(value, bool):
                raise ValueError(f"profiler_kwargs: {key} must be true or false, got {value!r}")


def trace_name(config: EngineConfig, tp_rank: int, prefix: str | None) -> str:
    """vLLM's trace name: the prefix, then the rank suffix (its expert-parallel rank is the one vLLM's MoE engines
    have: DP x TP ranks in one group)."""
    tp_size, dp_rank = config.tensor_parallel_size, config.data_parallel_rank
    suffix = f"dp{dp_rank}_pp0_tp{tp_rank}_dcp0_ep{dp_rank * tp_size + tp_rank}_rank{tp_rank}"
    return f"{prefix}_{suffix}" if prefix else suffix


class TraceProfiler:
    """One process's torch.profiler, started and stopped by its rank's calls; `stop` writes the Chrome trace."""

    def __init__(self, config: ProfilerConfig, device: torch.device) -> None:
        self.config = config
        activities = config.torch_profiler_activities or (("CPU", "CUDA") if device.type == "cuda" else ("CPU",))
        self.activities = [getattr(torch.profiler.ProfilerActivity, a) for a in activities]
        self._profile: torch.profiler.profile | None = None
        self._name = ""
        self.last_trace: str | None = None  # the path of the trace written last

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, name: str, overrides: dict[str, Any] | None = None) -> None:
        config = self.config
        options: dict[str, Any] = dict(
            activities=self.activities,
            record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory,
            with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
        )
        options.update(overrides or {})
        self._name = name
        profile = torch.profiler.profile(**options)
        profile.start()
        self._profile = profile

    def stop(self) -> str:
        """Stop and write the trace; its path."""
        profile, self._profile = self._profile, None
        profile.stop()
        directory = self.config.torch_profiler_dir
        os.makedirs(directory, exist_ok=True)
        suffix = ".pt.trace.json.gz" if self.config.torch_profiler_use_gzip else ".pt.trace.json"
        path = os.path.join(directory, f"{self._name}.{time.time_ns()}{suffix}")
        profile.export_chrome_trace(path)  # gzipped by torch for a .gz path
        self.last_trace = path
        return path

    def step_range(self, num_requests: int) -> Any:
        """The range an engine step records itself in (only called while tracing)."""
        return torch.profiler.record_function(f"{STEP_RANGE} ({num_requests} requests)")


@dataclass
class ProfileSession:
    """A start_profile's session on one core: tracing starts once `delay` steps have passed and stops by itself
    after `max_steps` traced ones (0: never); the session ends with stop_profile."""

    prefix: str | None
    delay: int
    max_steps: int
    overrides: dict[str, Any] | None
    skipped: int = 0
    traced: int = 0
    tracing: bool = False
    done: bool = False  # traced its max_steps

    def should_start(self) -> bool:
        return not self.tracing and not self.done and self.skipped >= self.delay

    def stepped(self) -> bool:
        """Count a step; whether tracing must stop now (max_steps reached)."""
        if not self.tracing:
            self.skipped += 1
            return False
        self.traced += 1
        return 0 < self.max_steps <= self.traced
