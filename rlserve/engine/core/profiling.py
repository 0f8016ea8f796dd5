"""The engine core's profiling session: vLLM 0.33's `start_profile` / `stop_profile` (see
rlserve.engine.worker.tracing for the traces)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
