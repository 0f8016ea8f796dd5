"""Data-parallel lockstep: vLLM's wave protocol and its two-phase pause, as one rank's state machine.

In lockstep mode (`data_parallel_lockstep`) every rank steps while any rank has work: ranks without requests run
dummy steps, so that the collectives inside a step (expert parallelism's all-to-all) always find every peer. One
idle -> running -> idle cycle of all ranks is a *wave*; each rank counts its waves, and the counts agree because a
wave ends only at a collective decision:

- A rank that gets work while idle starts a wave and tells its peers (`announce(wave)`, vLLM's START_DP_WAVE); a
  peer that hears of its current wave joins it. A notice of an older wave is stale (that wave ended) and dropped.
- At the first step of a wave and every `sync_interval` steps after (every step while a pause is being agreed:
  the flags below are the same on every rank, so they switch together), the ranks all-gather their flags (has work,
  locally paused, a pause pending, and the number of pause/resume calls received): the same list on every rank, so
  every rank takes the same decision at the same collective. When none has work and none waits on a pause, the wave
  ends on every rank.

The two-phase pause: a pause call applies its mode on each rank at once (phase 1: abort, keep or wait) but is not
answered yet; the rank keeps stepping (dummy steps if it has nothing left) and keeps honouring wave starts, so a
peer that is inside a collective finishes it. When an all-gather finds every rank locally paused (paused, nothing left
to step) *after the same pause/resume calls* (each rank counts those it received; the front end sends every rank
the same calls in the same order), phase 2: every rank, at the same collective, answers its pause calls and stops
stepping. Without the count, ranks paused by different pauses, with a resume between, would take their states for
one agreed pause (the randomized schedules found that). While paused, wave
notices are remembered, not acted on: nothing steps on a paused engine (a weight update's collectives run alone),
and a peer's notice is taken up when this rank leaves the pause. Any pause that reaches a paused rank goes through
phase 1 again (every rank decides alike, so none waits in a collective the others skip).

Resume is a barrier at the front end (the call returns when every rank has resumed), not a collective: a rank that
resumes and starts a wave while a peer is still paused is joined by that peer when its resume arrives. A duplicate
resume is a no-op, so it cannot strand a peer in a barrier (vLLM #55229).

Calls that must not meet a wave on some rank (a weight update, whose transfer is one collective with every rank) run
only on a paused engine: queued behind a pause in phase 1 and run in arrival order at phase 2; refused, by name,
on an engine that is not paused.

`LockstepRank` is plain code with no I/O: the engine-core process drives it with a gloo all-gather and ZMQ notices
(main_loop.py), tests/engine/test_dp_wave.py with simulated ranks and collectives. `two_phase=False` is the naive
one-phase pause (stop at once), kept so that the tests can show what the two phases prevent.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Protocol

# Calls that need every rank out of its waves: run only on a paused engine (see the module doc).
NEEDS_PAUSE = frozenset({"start_weight_update", "update_weights"})
# Calls kept in order behind those: a weight update's later calls wait with the ones before them.
ORDERED_BEHIND_PAUSE = NEEDS_PAUSE | {"finish_weight_update", "abandon_weight_update"}

# This rank's (has work, locally paused, pause pending: each 0 or 1, and the pause/resume calls received)
SyncFlags = tuple[int, int, int, int]


class RankEngine(Protocol):
    """What the protocol needs of one rank's engine."""

    def has_work(self) -> bool:
        """Something to step (requests that may be scheduled, a step in flight)."""

    def is_paused(self) -> bool: ...

    def step(self) -> None: ...

    def dummy_step(self) -> None:
        """A step with no requests, joining the step's collectives."""


class Gate(enum.Enum):
    RUN = "run"
    DEFER = "defer"
    REFUSE = "refuse"


@dataclass(frozen=True)
class _Deferred:
    method: str
    run: Callable[[], None]
    refuse: Callable[[str], None]


class LockstepRank:
    """One rank's wave state. The caller feeds it what arrives between iterations (`wave_started`, `pause`,
    `resume`, `gate`/`defer`) and runs `iteration()` in its loop, answering each `SyncFlags` the generator yields with
    every rank's flags, in rank order (an all-gather)."""

    def __init__(
        self,
        rank: int,
        size: int,
        sync_interval: int,
        engine: RankEngine,
        announce: Callable[[int], None],
        two_phase: bool = True,
    ) -> None:
        if sync_interval < 1:
            raise ValueError(f"data_parallel_sync_interval must be >= 1, got {sync_interval}")
        self.rank = rank
        self.size = size
        self.sync_interval = sync_interval
        self.engine = engine
        self.announce = announce
        self.two_phase = two_phase
        self.wave = 0  # waves ended so far: the number of the current (or next) wave
        self.running = False  # inside a wave: stepping, joining its syncs
        self.steps = 0  # steps of the current wave
        self.paused = False  # phase 2 reached (or a one-phase pause applied), not resumed since
        self.heard_wave = -1  # the newest wave a peer announced
        self.num_syncs = 0
        self.num_pause_calls = 0  # pause and resume calls received: ranks agree on a pause only at the same count
        self._pause_replies: list[Callable[[], None]] = []  # phase 1: pauses answered at phase 2
        self._agreeing = False  # the last sync saw a pause pending: every rank syncs at each step until it is agreed
        self._deferred: list[_Deferred] = []

    @property
    def pause_pending(self) -> bool:
        return bool(self._pause_replies)

    # ---- what arrives between iterations ----

    def wave_started(self, wave: int) -> None:
        """A peer's notice that it started wave `wave` (vLLM's START_DP_WAVE)."""
        self.heard_wave = max(self.heard_wave, wave)

    def pause(self, reply: Callable[[], None]) -> None:
        """A pause whose mode the engine has applied; `reply` answers the call (phase 2, or a resume first)."""
        self.num_pause_calls += 1
        if not self.two_phase:  # the naive pause: stop now, wherever the peers are
            self.paused = True
            self.running = False
            reply()
            return
        self.paused = False  # a pause on a paused engine is agreed again, as every rank gets it
        self._pause_replies.append(reply)

    def resume(self) -> None:
        """Lift the pause on this rank. Pauses still in phase 1 are answered now (overtaken by the resume, as a
        single engine's pause(mode="wait") is), and calls queued behind them are gated again (refused, mostly)."""
        self.num_pause_calls += 1
        self.paused = False
        replies, self._pause_replies = self._pause_replies, []
        for reply in replies:
            reply()
        self._run_deferred()

    def pause_lifted(self) -> None:
        """The engine lifted its pause by itself (an abandoned weight update: the trainer that would resume is
        gone). Not a resume call, so not counted: every rank of the broadcast abandons it alike, and until they
        have, a peer still paused leaves this rank waiting in its wave's all-gather, not deadlocked: any resume
        frees it."""
        self.paused = False

    def gate(self, method: str) -> Gate:
        """Whether a control call may run now, must wait behind a pause in phase 1, or is refused."""
        if method not in ORDERED_BEHIND_PAUSE:
            return Gate.RUN
        if self.pause_pending or self._deferred:
            return Gate.DEFER
        if method in NEEDS_PAUSE and not self.paused:
            return Gate.REFUSE
        return Gate.RUN

    def refusal(self, method: str) -> str:
        return (
            f"{method}: data-parallel lockstep: pause the engine first (pause; sleep alone does not stop the ranks' "
            "waves), so that no rank is inside a wave while the update's collective needs every rank"
        )

    def defer(self, method: str, run: Callable[[], None], refuse: Callable[[str], None]) -> None:
        self._deferred.append(_Deferred(method, run, refuse))

    def _run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for i, call in enumerate(deferred):
            gate = self.gate(call.method)
            if gate is Gate.DEFER:  # only another pause in phase 1 does this: the rest keep their order
                self._deferred = deferred[i:]
                return
            if gate is Gate.RUN:
                call.run()
            else:
                call.refuse(self.refusal(call.method))

    # ---- the loop ----

    def idle(self) -> bool:
        """Nothing to do until a message arrives (the loop may wait for one)."""
        return not self.running and not self._wants_wave()

    def _wants_wave(self) -> bool:
        if self.paused:
            return False
        return self.engine.has_work() or self.pause_pending or self.heard_wave >= self.wave

    def iteration(self) -> Generator[SyncFlags, list[SyncFlags], None]:
        """One turn of the loop: join or start a wave if there is reason to, step (a dummy step without work), and
        every `sync_interval` steps yield this rank's flags for the all-gather and act on every rank's."""
        if not self.running:
            if not self._wants_wave():
                return
            self.running = True
            self.steps = 0
            if self.heard_wave < self.wave:  # this rank starts the wave: the peers are told
                self.announce(self.wave)
        engine = self.engine
        if engine.has_work():
            engine.step()
        else:
            engine.dummy_step()
        self.steps += 1
        # Also at a wave's first step (as vLLM since #52957): a wave started only to agree on a pause, or by a
        # request that finished at once, ends after one step instead of sync_interval dummy steps. And at every
        # step while the last sync saw a pause pending: the pause is agreed as soon as the last rank applies it.
        if self.steps != 1 and self.steps % self.sync_interval and not self._agreeing:
            return
        has_work = engine.has_work()
        locally_paused = self.pause_pending and engine.is_paused() and not has_work
        flags = yield (int(has_work), int(locally_paused), int(self.pause_pending), self.num_pause_calls)
        self._synced(flags)

    def _synced(self, flags: list[SyncFlags]) -> None:
        self.num_syncs += 1
        self._agreeing = any(pending for _, _, pending, _ in flags)
        if all(paused for _, paused, _, _ in flags) and len({calls for *_, calls in flags}) == 1:
            # phase 2: every rank paused by the same calls, decided on all of them at this same collective
            self.paused = True
            self._end_wave()
            replies, self._pause_replies = self._pause_replies, []
            for reply in replies:
                reply()
            self._run_deferred()
        elif not any(work or pending for work, _, pending, _ in flags):
            self._end_wave()

    def _end_wave(self) -> None:
        self._agreeing = False
        self.running = False
        self.wave += 1
        self.steps = 0


def run_iteration(rank: LockstepRank, all_gather: Callable[[SyncFlags], list[SyncFlags]]) -> None:
    """Drive one `iteration` with a blocking all-gather (the engine-core process's)."""
    turn = rank.iteration()
    try:
        flags = next(turn)
        while True:
            flags = turn.send(all_gather(flags))
    except StopIteration:
        pass
