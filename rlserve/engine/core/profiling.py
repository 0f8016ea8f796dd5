"""The engine core's side of vLLM 0.33's `start_profile` / `stop_profile`: the session between the two calls (its
delay, its step limit) and the traces it starts and stops, this process's and its tensor-parallel followers'
(rlserve.engine.worker.tracing writes them; rlserve.engine.wire.profiling checks the calls)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from rlserve.engine.core.data_plane import DataPlane
from rlserve.engine.wire.profiling import ALREADY_ACTIVE, check_session, profiling_enabled, require_profiling
from rlserve.engine.worker.tracing import TraceProfiler, trace_name

logger = logging.getLogger(__name__)


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


class ProfileControl:
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        config = plane.config
        self.profiler = (
            TraceProfiler(config.profiler_config, plane.runner.device) if profiling_enabled(config) else None
        )
        self.session: ProfileSession | None = None  # between start_profile and stop_profile

    def start_profile(
        self,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
        profiler_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Open a profiling session; tracing starts now, or after `delay_iterations` steps."""
        config = require_profiling(self.plane.config)
        if self.session is not None:
            raise RuntimeError(ALREADY_ACTIVE)
        check_session(config, profile_prefix, delay_iterations, max_iterations, profiler_kwargs)
        session = ProfileSession(
            profile_prefix,
            config.delay_iterations if delay_iterations is None else delay_iterations,
            config.max_iterations if max_iterations is None else max_iterations,
            profiler_kwargs,
        )
        if session.should_start():
            self._start_tracing(session)
        self.session = session

    def stop_profile(self) -> None:
        """End the session, writing each rank's trace if it is tracing; a no-op (logged) without a session, as in
        vLLM."""
        require_profiling(self.plane.config)
        session, self.session = self.session, None
        if session is None:
            logger.warning("stop_profile: no profiling session is active; nothing to stop")
            return
        if session.tracing:
            self._stop_tracing(session)
        elif not session.done:
            logger.info("stop_profile: the session ended within its %d delay steps; nothing was traced", session.delay)

    def _start_tracing(self, session: ProfileSession) -> None:
        """Start this rank's profiler and its tensor-parallel followers'; all or none."""
        self.profiler.start(trace_name(self.plane.config, 0, session.prefix), session.overrides)
        try:
            self.plane.runner.call_followers("start_profile", session.prefix, session.overrides)
        except BaseException:
            self.profiler.stop()
            raise
        session.tracing = True

    def _stop_tracing(self, session: ProfileSession) -> None:
        session.tracing = False
        paths = [self.profiler.stop()]
        paths += self.plane.runner.call_followers("stop_profile")
        logger.info("profile traces written: %s", ", ".join(paths))

    def step(self) -> contextlib.AbstractContextManager:
        """What an engine step (a dummy one too) runs inside: nothing without a session."""
        return contextlib.nullcontext() if self.session is None else self._profiled_step()

    @contextlib.contextmanager
    def _profiled_step(self):
        """One step of a profiling session: tracing starts before it once the delay has passed, the step is a range of
        the trace, and tracing stops after it at max_steps (a profiler's failure is logged, never a failed step)."""
        session = self.session
        if session.should_start():
            try:
                self._start_tracing(session)
            except Exception:
                logger.exception("the profiler did not start; this session traces nothing")
                session.done = True
        if session.tracing:
            with self.profiler.step_range(len(self.plane.requests)):
                yield
        else:
            yield
        if session.stepped():
            session.done = True
            try:
                self._stop_tracing(session)
            except Exception:
                logger.exception("writing the profile trace failed")

    def shutdown(self) -> None:
        """The trace so far is written, as vLLM's worker shutdown does."""
        session, self.session = self.session, None
        if session is not None and session.tracing:
            try:
                self._stop_tracing(session)
            except Exception:
                logger.exception("writing the profile trace at shutdown failed")
