"""The lockstep wave protocol and its two-phase pause (rlserve/engine/core/dp_wave.py), driven by a simulator.

The simulator runs the real `LockstepRank` of every rank over fake engines, with its own scheduler choosing what
happens next: a rank reads one message, hears a wave notice, or runs a loop iteration; a client sends its next call.
Collectives (the wave's all-gather; a weight update's transfer, which needs every rank) block a rank until every rank
has entered the same one, as gloo and NCCL do. A schedule deadlocks when nothing can happen any more while a call is
unanswered, a request unfinished or a rank inside a collective. Every schedule also checks that the ranks take the
same number of steps between two all-gathers, so collectives inside each step (expert parallelism's) would pair up.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from rlserve.engine.core.dp_wave import Gate, LockstepRank, SyncFlags

MAX_ACTIONS = 6000  # per schedule: far above what a schedule needs (a few hundred), so reaching it is a livelock


class FakeEngine:
    """Requests that need a number of steps; the scheduler's three pause states."""

    def __init__(self, finished: dict[str, int]) -> None:
        self.finished = finished  # request id -> times it finished (shared by the ranks)
        self.running: dict[str, int] = {}  # request id -> steps left
        self.waiting: list[str] = []
        self.steps_of: dict[str, int] = {}
        self.pause_state = "none"  # "none", "new" (running ones go on), "all"
        self.num_dummy_steps = 0
        self.num_steps = 0  # real and dummy

    def add(self, request_id: str, steps: int) -> None:
        self.waiting.append(request_id)
        self.steps_of[request_id] = steps

    def abort(self, request_id: str) -> None:
        if request_id in self.running or request_id in self.waiting:
            self.running.pop(request_id, None)
            if request_id in self.waiting:
                self.waiting.remove(request_id)
            self._finish(request_id)

    def _finish(self, request_id: str) -> None:
        self.finished[request_id] = self.finished.get(request_id, 0) + 1

    def has_work(self) -> bool:
        if self.pause_state == "all":
            return False
        return bool(self.running) or (bool(self.waiting) and self.pause_state == "none")

    def is_paused(self) -> bool:
        return self.pause_state != "none"

    def step(self) -> None:
        self.num_steps += 1
        if self.pause_state == "none":
            for request_id in self.waiting:
                self.running[request_id] = self.steps_of[request_id]
            self.waiting.clear()
        for request_id in list(self.running):
            self.running[request_id] -= 1
            if self.running[request_id] == 0:
                del self.running[request_id]
                self._finish(request_id)

    def dummy_step(self) -> None:
        self.num_steps += 1
        self.num_dummy_steps += 1

    def pause(self, mode: str) -> None:
        if mode == "abort":
            for request_id in list(self.running) + list(self.waiting):
                self.abort(request_id)
        self.pause_state = "all" if mode == "keep" else "new"


@dataclass
class Call:
    """A control call fanned out to every rank; answered once every rank answered."""

    method: str
    mode: str | None = None
    answers: dict[int, str] = field(default_factory=dict)  # rank -> "ok" or "refused"


@dataclass
class SimRank:
    lockstep: LockstepRank
    engine: FakeEngine
    inbox: deque = field(default_factory=deque)  # ("add", id, steps) / ("abort", id) / ("call", Call)
    notices: deque = field(default_factory=deque)
    turn: object = None  # the iteration generator, while inside the all-gather
    num_syncs: int = 0  # all-gathers entered
    steps_at_sync: int = 0  # the engine's steps when it last entered one
    updates: deque = field(default_factory=deque)  # weight-update collectives queued (one at a time)
    num_updates: int = 0  # weight-update collectives completed


class Sim:
    def __init__(self, size: int, sync_interval: int, rng: random.Random, two_phase: bool = True) -> None:
        self.rng = rng
        self.finished: dict[str, int] = {}
        self.added: list[str] = []
        self.calls: list[Call] = []
        self.syncs: dict[int, dict[int, SyncFlags]] = {}  # all-gather index -> rank -> flags
        self.steps_between: dict[int, dict[int, int]] = {}  # all-gather index -> rank -> its steps since the last
        self.uneven_steps: list[int] = []  # all-gathers before which the ranks took different numbers of steps
        self.ranks: list[SimRank] = []
        for r in range(size):
            engine = FakeEngine(self.finished)
            lockstep = LockstepRank(r, size, sync_interval, engine, self._announcer(r), two_phase)
            self.ranks.append(SimRank(lockstep, engine))

    def _announcer(self, sender: int):
        def announce(wave: int) -> None:
            for r, rank in enumerate(self.ranks):
                if r != sender:
                    rank.notices.append(wave)

        return announce

    # ---- what clients do ----

    def add(self, request_id: str, steps: int, rank: int) -> None:
        self.added.append(request_id)
        self.ranks[rank].inbox.append(("add", request_id, steps))

    def abort(self, request_id: str) -> None:
        for rank in self.ranks:  # the DP client sends it to the owner; the others do not know the id
            rank.inbox.append(("abort", request_id))

    def call(self, method: str, mode: str | None = None) -> Call:
        call = Call(method, mode)
        self.calls.append(call)
        for rank in self.ranks:
            rank.inbox.append(("call", call))
        return call

    def answered(self, call: Call) -> bool:
        return len(call.answers) == len(self.ranks)

    # ---- what ranks do ----

    def blocked(self, r: int) -> bool:
        rank = self.ranks[r]
        return rank.turn is not None or bool(rank.updates)

    def read(self, r: int) -> None:
        rank = self.ranks[r]
        message = rank.inbox.popleft()
        if message[0] == "add":
            rank.engine.add(message[1], message[2])
        elif message[0] == "abort":
            rank.engine.abort(message[1])
        else:
            self._handle_call(r, message[1])

    def _handle_call(self, r: int, call: Call) -> None:
        rank = self.ranks[r]
        lockstep = rank.lockstep

        def reply(outcome: str = "ok") -> None:
            assert r not in call.answers, f"{call.method} answered twice on rank {r}"
            call.answers[r] = outcome

        if call.method == "pause":
            rank.engine.pause(call.mode)
            lockstep.pause(reply)
        elif call.method == "resume":
            rank.engine.pause_state = "none"
            lockstep.resume()
            reply()
        else:  # update_weights: one collective with every rank
            gate = lockstep.gate("update_weights")

            def run() -> None:
                rank.updates.append(call)

            if gate is Gate.RUN:
                run()
            elif gate is Gate.DEFER:
                lockstep.defer("update_weights", run, lambda why: reply("refused"))
            else:
                reply("refused")
        self._complete_updates()

    def hear(self, r: int) -> None:
        rank = self.ranks[r]
        rank.lockstep.wave_started(rank.notices.popleft())

    def iterate(self, r: int) -> None:
        rank = self.ranks[r]
        turn = rank.lockstep.iteration()
        try:
            flags = next(turn)
        except StopIteration:
            return
        rank.turn = turn
        self.syncs.setdefault(rank.num_syncs, {})[r] = flags
        self.steps_between.setdefault(rank.num_syncs, {})[r] = rank.engine.num_steps - rank.steps_at_sync
        rank.steps_at_sync = rank.engine.num_steps
        rank.num_syncs += 1
        self._complete_sync(rank.num_syncs - 1)

    def _complete_sync(self, index: int) -> None:
        entered = self.syncs[index]
        if len(entered) < len(self.ranks):
            return
        gathered = [entered[r] for r in range(len(self.ranks))]
        del self.syncs[index]
        # Every rank took as many steps since the last all-gather as the others: were each step a collective too
        # (expert parallelism's all-to-all), those would pair up as well.
        if len(set(self.steps_between.pop(index).values())) > 1:
            self.uneven_steps.append(index)
        for rank in self.ranks:
            turn, rank.turn = rank.turn, None
            with pytest.raises(StopIteration):
                turn.send(gathered)
        self._complete_updates()

    def _complete_updates(self) -> None:
        while self.ranks and all(rank.updates and rank.turn is None for rank in self.ranks):
            calls = [rank.updates[0] for rank in self.ranks]
            assert all(c is calls[0] for c in calls), "the ranks are in different weight updates"
            for r, rank in enumerate(self.ranks):
                rank.updates.popleft()
                rank.num_updates += 1
                calls[0].answers[r] = "ok"

    def actions(self) -> list[tuple]:
        actions = []
        for r, rank in enumerate(self.ranks):
            if self.blocked(r):
                continue
            if rank.inbox:
                actions.append((self.read, r))
            if rank.notices:
                actions.append((self.hear, r))
            if not rank.lockstep.idle():
                actions.append((self.iterate, r))
        return actions

    def problems(self) -> list[str]:
        """What is wrong once nothing can happen any more."""
        out = []
        for r in range(len(self.ranks)):
            if self.ranks[r].turn is not None:
                out.append(f"rank {r} is stuck in an all-gather")
            if self.ranks[r].updates:
                out.append(f"rank {r} is stuck in a weight update")
        out += [f"{c.method} unanswered by ranks {set(range(len(self.ranks))) - c.answers.keys()}" for c in self.calls]
        out = [p for p in out if "unanswered by ranks set()" not in p]
        out += [f"request {rid} lost" for rid in self.added if rid not in self.finished]
        out += [f"all-gather {i}: the ranks took different numbers of steps before it" for i in self.uneven_steps]
        out += [f"request {rid} finished {n} times" for rid, n in self.finished.items() if n != 1]
        return out


@dataclass
class Client:
    """Sends its calls in order; an awaited call holds back the next until every rank answered it."""

    ops: deque
    waiting_on: Call | None = None


def random_schedule(seed: int, two_phase: bool = True) -> tuple[Sim, list[str]]:
    """One seeded schedule: a user adding and aborting requests, a trainer pausing (every mode, duplicates), updating
    weights (queued behind its pause or not) and resuming (duplicates), over 2-4 ranks; then a final resume and a
    run to the end. Returns the simulator and what went wrong (empty: nothing)."""
    rng = random.Random(seed)
    sim = Sim(rng.choice((2, 2, 3, 4)), rng.choice((1, 2, 4)), rng, two_phase)
    size = len(sim.ranks)
    user_ops: deque = deque()
    for i in range(rng.randint(3, 12)):
        user_ops.append(("add", f"r{i}", rng.randint(1, 8), rng.randrange(size)))
        if rng.random() < 0.2:
            user_ops.append(("abort", f"r{rng.randrange(i + 1)}"))
    trainer_ops: deque = deque()
    for _ in range(rng.randint(1, 4)):
        mode = rng.choice(("abort", "wait", "keep"))
        trainer_ops.append(("pause", mode, rng.random() < 0.6))
        if rng.random() < 0.3:
            trainer_ops.append(("pause", rng.choice(("abort", "wait", "keep")), rng.random() < 0.5))  # duplicate
        if rng.random() < 0.7:
            trainer_ops.append(("update", None, True))
        trainer_ops.append(("resume", None, rng.random() < 0.7))
        if rng.random() < 0.3:
            trainer_ops.append(("resume", None, False))  # duplicate
    if rng.random() < 0.1:
        trainer_ops.appendleft(("update", None, True))  # not paused: refused by every rank
    clients = [Client(user_ops), Client(trainer_ops)]
    final_resume = None
    for _ in range(MAX_ACTIONS):
        choices = sim.actions()
        for client in clients:
            if client.waiting_on is not None and sim.answered(client.waiting_on):
                client.waiting_on = None
            if client.ops and client.waiting_on is None:
                choices.append((issue, sim, client))
        if final_resume is None and not any(c.ops for c in clients) and all(c.waiting_on is None for c in clients):
            final_resume = sim.call("resume")
            continue
        if not choices:
            break
        action, *args = rng.choice(choices)
        action(*args)
    else:
        return sim, [f"livelock: still busy after {MAX_ACTIONS} actions"]
    return sim, sim.problems()


def issue(sim: Sim, client: Client) -> None:
    op = client.ops.popleft()
    if op[0] == "add":
        sim.add(*op[1:])
    elif op[0] == "abort":
        sim.abort(op[1])
    else:
        method, mode, awaited = op
        call = sim.call("update_weights" if method == "update" else method, mode)
        if awaited:
            client.waiting_on = call


SCHEDULES = 1000


def test_randomized_interleavings_never_deadlock_lose_or_duplicate() -> None:
    failures = {}
    updates_run = refused = 0
    for seed in range(SCHEDULES):
        sim, problems = random_schedule(seed)
        if problems:
            failures[seed] = problems
        for call in sim.calls:
            if call.method == "update_weights":
                outcomes = set(call.answers.values())
                assert len(outcomes) == 1, f"seed {seed}: ranks disagree on a weight update: {call.answers}"
                updates_run += outcomes == {"ok"}
                refused += outcomes == {"refused"}
    assert not failures, f"{len(failures)} of {SCHEDULES} schedules failed, e.g. {next(iter(failures.items()))}"
    # The harness exercised both sides of the weight-update gate.
    assert updates_run > 100 and refused > 10, (updates_run, refused)


def test_the_naive_one_phase_pause_deadlocks_in_the_same_harness() -> None:
    deadlocked = [seed for seed in range(SCHEDULES) if random_schedule(seed, two_phase=False)[1]]
    assert len(deadlocked) > SCHEDULES // 20, f"only {len(deadlocked)} schedules deadlocked"


def _seed_race(two_phase: bool) -> tuple[Sim, Call, Call]:
    """The seed article's race, scripted: rank 1 has a request and enters the wave's all-gather; a pause reaches
    rank 0 while rank 1 is inside it, and the trainer's weight update is queued behind the pause on both."""
    sim = Sim(2, 1, random.Random(0), two_phase)
    sim.add("r0", 3, rank=1)
    sim.read(1)
    sim.iterate(1)  # rank 1 starts the wave (its notice is on the way to rank 0) and enters the all-gather
    assert sim.blocked(1) and sim.ranks[0].notices
    pause = sim.call("pause", "keep")
    update = sim.call("update_weights")
    sim.read(0)  # the pause reaches rank 0 ...
    sim.read(0)  # ... and the update behind it
    sim.hear(0)  # the wave notice from rank 1, after the pause
    for _ in range(50):  # every rank does what it can, in rank order, until nothing can happen
        actions = sim.actions()
        if not actions:
            break
        action, r = actions[0]
        action(r)
    assert not sim.answered(pause) or two_phase
    return sim, pause, update


def test_seed_race_pause_while_a_peer_is_in_a_collective_finishes() -> None:
    sim, pause, update = _seed_race(two_phase=True)
    assert sim.answered(pause) and update.answers == {0: "ok", 1: "ok"}
    assert sim.ranks[0].num_updates == sim.ranks[1].num_updates == 1
    resume = sim.call("resume")
    while sim.actions():
        action, r = sim.actions()[0]
        action(r)
    assert sim.answered(resume)
    assert sim.problems() == []  # r0 ran to the end after the resume
    assert sim.ranks[0].engine.num_dummy_steps > 0  # rank 0 kept stepping so rank 1 could leave its all-gather


def test_seed_race_deadlocks_with_the_naive_pause() -> None:
    sim, pause, update = _seed_race(two_phase=False)
    assert sim.actions() == []
    assert "rank 1 is stuck in an all-gather" in sim.problems()
    assert "rank 0 is stuck in a weight update" in sim.problems()


def test_wave_numbers_agree_and_stale_notices_are_dropped() -> None:
    sim = Sim(2, 2, random.Random(0))
    sim.add("a", 3, rank=0)
    sim.read(0)
    sim.iterate(0)  # rank 0 starts wave 0 and syncs at its first step
    sim.hear(1)
    sim.iterate(1)  # rank 1 joins: the sync finds work, the wave goes on
    assert [r.lockstep.running for r in sim.ranks] == [True, True]
    for _ in range(2):  # steps 2 (a sync: work left) and 3 (the request's last)
        sim.iterate(0)
        sim.iterate(1)
    assert sim.ranks[0].lockstep.running and sim.ranks[1].engine.num_dummy_steps == 3
    sim.iterate(0)
    sim.iterate(1)  # step 4 syncs: no work anywhere, the wave ends on both
    assert [r.lockstep.wave for r in sim.ranks] == [1, 1] and sim.finished == {"a": 1}
    assert not any(r.lockstep.running for r in sim.ranks)
    sim.ranks[1].lockstep.wave_started(0)  # a notice of the ended wave, late
    assert sim.ranks[1].lockstep.idle()


def test_calls_behind_a_pending_pause_keep_their_order_and_a_resume_refuses_them() -> None:
    rank = LockstepRank(0, 2, 1, FakeEngine({}), lambda wave: None)
    assert rank.gate("update_weights") is Gate.REFUSE  # not paused
    assert rank.gate("stats") is Gate.RUN
    done: list[str] = []
    rank.pause(lambda: done.append("pause"))
    for method in ("start_weight_update", "finish_weight_update"):
        assert rank.gate(method) is Gate.DEFER
        rank.defer(method, lambda m=method: done.append(m), lambda why, m=method: done.append("refused " + m))
    rank.resume()
    assert done == ["pause", "refused start_weight_update", "finish_weight_update"]
    assert "pause the engine first" in rank.refusal("update_weights")
