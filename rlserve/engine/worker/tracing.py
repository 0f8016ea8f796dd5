"""torch.profiler traces of the engine-core processes: vLLM 0.33's `start_profile` / `stop_profile`.

With `profiler_config` (ProfilerConfig, vLLM's `--profiler-config`) set to the torch profiler, every engine-core
process (each data-parallel rank) and each of its tensor-parallel ranks runs a torch.profiler of its own from
`start_profile` to `stop_profile`, and writes one Chrome trace when it stops, as vLLM's workers do:

    <torch_profiler_dir>/[<prefix>_]dp<D>_pp0_tp<T>_dcp0_ep<E>_rank<T>.<time_ns>.pt.trace.json[.gz]

(vLLM's rank suffix, torch's trace-file naming), so ranks never collide. Each engine step is an `engine_step` range in
the trace. A session may skip `delay_iterations` steps before the trace starts and stop tracing by itself after
`max_iterations` steps; it stays open until `stop_profile` either way. The front ends are not traced.

Each rank's process traces itself (`TraceProfiler`); the core owns the session (rlserve.engine.core.profiling), and the
calls' checks are rlserve.engine.wire.profiling.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from rlserve.config import EngineConfig, ProfilerConfig

STEP_RANGE = "engine_step"  # the name of each engine step's range in the trace


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
