"""vLLM 0.33's `start_profile` / `stop_profile` as the front ends and the engine core both check them: whether
profiling is enabled, and a session's arguments (the front ends check what they can before sending the call, and the
core checks again, since several front ends share it). The traces themselves: rlserve.engine.worker.tracing; the
core's session: rlserve.engine.core.profiling."""

from __future__ import annotations

from typing import Any

from rlserve.config import EngineConfig, ProfilerConfig

# torch.profiler.profile's switches that one session may override (start_profile's profiler_kwargs): plain booleans,
# so that they travel to the core as data. vLLM passes any keyword through.
PROFILER_KWARGS = ("record_shapes", "profile_memory", "with_stack", "with_flops", "with_modules")

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
