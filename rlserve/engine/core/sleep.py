"""vLLM's sleep / wake_up: a colocated trainer takes the device memory between rollouts."""

from __future__ import annotations

from rlserve.engine.core.data_plane import DataPlane
from rlserve.engine.core.pause import PauseControl
from rlserve.engine.core.weights import WeightControl

SLEEP_LEVELS = (0, 1, 2)
WAKE_UP_TAGS = ("weights", "kv_cache", "scheduling")


class SleepControl:
    def __init__(self, plane: DataPlane, pausing: PauseControl, weights: WeightControl) -> None:
        self.plane = plane
        self.pausing = pausing  # holds scheduling while asleep
        self.weights = weights  # a level-2 sleep leaves them unwritten
        self.asleep = False
        self.level = 0  # the deepest level since it fell asleep

    def sleep(self, level: int = 1) -> None:
        """Stop scheduling and free device memory. Level 0 keeps both; level 1 drops the KV cache and moves the
        weights to host memory; level 2 drops both (the next weight update must write every weight). Requests in
        flight keep their tokens and recompute their KV after wake_up."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level: sleep level must be one of {list(SLEEP_LEVELS)}, got {level!r}")
        if self.weights.update_active:
            raise RuntimeError("sleep: a weight update is in progress; finish it first")
        self.plane.drain()
        if not self.asleep:
            self.asleep = True
            self.level = level
        self.level = max(self.level, level)
        self.pausing.hold()
        runner = self.plane.runner
        if level >= 1:
            self.pausing.clear_cache()  # running requests give their blocks back; they recompute after wake_up
            runner.release_kv_cache()
            runner.release_weights(keep_host_copy=level == 1)
        if level == 2:
            self.weights.mark_unwritten(set(runner.weight_names), "sleep(level=2) released them")

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back what sleep released: `tags` any of "weights", "kv_cache", "scheduling" (default: all).
        As in vLLM 0.33, scheduling resumes (and the engine is awake) as soon as weights and KV cache are both back,
        so any wake_up ends a sleep of level 0. Returns whether the engine is awake."""
        tags = list(WAKE_UP_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in WAKE_UP_TAGS]
        if unknown:
            raise ValueError(f"tags: unknown wake_up tags {unknown}; expected a subset of {list(WAKE_UP_TAGS)}")
        if self.asleep:
            runner = self.plane.runner
            runner.restore(weights="weights" in tags, kv_cache="kv_cache" in tags)
            if runner.weights_resident and runner.kv_cache_resident:
                self.pausing.release()
                self.asleep = False
        return not self.asleep

    @property
    def sleep_state(self) -> str:
        """vLLM's engine_sleep_state, in words: "awake", "weights_offloaded" (level 1), "discard_all" (level 2), or
        "scheduling_paused" (level 0)."""
        if not self.asleep:
            return "awake"
        return ("scheduling_paused", "weights_offloaded", "discard_all")[self.level]

    def is_sleeping(self) -> bool:
        return self.asleep
