"""Pausing generation (vLLM 0.33's pause / resume, in modes abort, wait and keep) and the cache clears that go with a
pause. The scheduler's pause state is set here only: from the pause asked for, and held at "nothing runs" while the
engine sleeps (sleep.py)."""

from __future__ import annotations

from rlserve.engine.core.data_plane import DataPlane
from rlserve.engine.sched.scheduler import PauseState
from rlserve.engine.wire.messages import EngineCoreOutput, resolve_pause_mode


class PauseControl:
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.state = PauseState.UNPAUSED  # the pause asked for (pause, resume)
        self.held = False  # nothing is scheduled whatever the pause (asleep); the pause applies at `release`
        # vLLM 0.33's user pause in mode abort or wait: new requests are refused (retryable) until resume, not queued.
        self.rejecting_new_requests = False

    def pause(self, mode: str, clear_cache: bool) -> list[EngineCoreOutput]:
        """Apply a pause mode. For "wait" the caller keeps stepping until `num_in_flight` is 0, then clears.
        The step in flight (async scheduling) is read back first: its tokens belong before the pause, and after a
        keep-pause returns, nothing may arrive until resume: its outputs come first among those returned."""
        mode = resolve_pause_mode(mode)
        plane = self.plane
        plane.drain()
        outputs = plane.take_pending_outputs()  # before any abort's last outputs
        if mode == "abort":
            outputs += plane.abort_requests(list(plane.requests))
        self._set(PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW)
        self.rejecting_new_requests = mode != "keep"
        if clear_cache and mode != "wait":
            self.clear_cache()
        return outputs

    def resume(self) -> None:
        """Lift the pause. With weights missing (WeightControl.not_serving) nothing runs until they are written."""
        self._set(PauseState.UNPAUSED)
        self.rejecting_new_requests = False

    def is_paused(self) -> bool:
        return self.state is not PauseState.UNPAUSED

    @property
    def num_in_flight(self) -> int:
        return self.plane.scheduler.num_in_flight

    def hold(self) -> None:
        """Schedule nothing until `release`, whatever the pause (sleep); a pause or resume meanwhile applies then."""
        self.held = True
        self._apply()

    def release(self) -> None:
        self.held = False
        self._apply()

    def _set(self, state: PauseState) -> None:
        self.state = state
        self._apply()

    def _apply(self) -> None:
        self.plane.scheduler.pause_state = PauseState.PAUSED_ALL if self.held else self.state

    def clear_cache(self) -> None:
        """Drop all KV: running requests are preempted (they recompute later) and the prefix cache is emptied."""
        plane = self.plane
        plane.drain()
        plane.scheduler.preempt_all()
        plane.kv_cache.reset_prefix_cache()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """Forget every cached prefix; `reset_running_requests` (vLLM's) also preempts the running requests, whose
        KV then recomputes, rather than letting them keep it."""
        if reset_running_requests:
            self.clear_cache()
        else:
            self.plane.kv_cache.reset_prefix_cache()
