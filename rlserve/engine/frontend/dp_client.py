"""Data parallel: `data_parallel_size` engine cores behind one front end (vLLM's DPLBAsyncMPClient).

Each core is a process of its own with a whole copy of the model, driven by a per-rank client (`MPClient`,
`AsyncMPClient`); the DP clients here have the same surface as those, so `LLM` and `AsyncLLM` do not know how many
cores serve them:

- `add` sends each prompt (its n samples together) to one rank, chosen by `DPRouter`: the rank that served the same
  session, cache salt or prompt before (its prefix cache holds the KV), else the rank with the fewest requests in
  flight. `abort` goes to the rank that owns each request.
- `call` sends a control call to every rank at once and waits for all: pause returns when every rank has paused,
  a weight update's collective has every rank in it. The ranks' results are combined (`COMBINE`): counters summed,
  `collective_rpc` lists concatenated, values that must agree (the weight version, checksums) compared, and a
  disagreement raised; checksums are merged too (under expert parallel each rank holds only its experts).

Without lockstep the ranks never wait on each other: no rank runs a collective with another (only with the trainer,
which every rank joins as soon as it reads the call), so a fanned-out call cannot deadlock. With
`data_parallel_lockstep` the ranks step together in waves and pause in two phases (dp_wave.py); that protocol relies
on what the fan-out here gives it: every rank receives the same calls in the same order, so a resume returns when
every rank has resumed (the barrier), and the ranks agree on which pause they are in.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import zmq

from rlserve.config import EngineConfig
from rlserve.engine.frontend.core_client import (
    LIVENESS_INTERVAL_S,
    AsyncMPClient,
    EngineDeadError,
    MPClient,
    raise_for,
)
from rlserve.engine.frontend.launcher import ProcessLauncher
from rlserve.engine.wire.messages import AddRequest, EngineCoreOutput, UtilityResult
from rlserve.engine.wire.process import free_port

logger = logging.getLogger(__name__)

# Prompts (and sessions, salts) remembered with their rank: a GRPO group's requests arrive within moments of each
# other, a session's turns within minutes; older keys are forgotten first.
MAX_AFFINITY_KEYS = 1 << 16


def make_launcher(config: EngineConfig) -> Any:
    """What starts the engine cores of `config`: `launch(rank_config)` returns a handle on one core (its address
    once `wait_ready` returned, `is_alive`, `death_reason`, `stopped`, `shutdown`), `shutdown()` stops what the
    launcher holds for all of them."""
    if config.data_parallel_backend == "ray":
        from rlserve.engine.frontend.ray_launcher import RayLauncher  # Ray is an optional extra

        return RayLauncher(config)
    return ProcessLauncher()


class DPRouter:
    """Which rank serves what: requests in flight per rank (the load) and the affinity of prompts to ranks."""

    def __init__(self, size: int, max_affinity_keys: int = MAX_AFFINITY_KEYS) -> None:
        self.size = size
        self.max_affinity_keys = max_affinity_keys
        self.in_flight = [0] * size  # samples routed and not yet finished
        self.num_routed = [0] * size  # samples routed since start, for stats
        self.owners: dict[str, int] = {}  # request id -> rank
        self._affinity: OrderedDict[str, int] = OrderedDict()

    @staticmethod
    def affinity_key(request: AddRequest, session_id: str | None) -> str:
        """What makes requests share a prefix: the session (`X-Session-ID`), else the cache salt (a namespace of
        its own in the prefix cache), else the whole prompt (GRPO groups sent as separate requests). Only the whole
        prompt: a prefix shared by every request (a system prompt) would send all of them to one rank."""
        if session_id is not None:
            return "session:" + session_id
        if request.cache_salt is not None:
            return "salt:" + request.cache_salt
        return "prompt:" + hashlib.blake2b(request.prompt_token_ids, digest_size=16).hexdigest()

    def route(self, request: AddRequest, session_id: str | None = None) -> int:
        key = self.affinity_key(request, session_id)
        rank = self._affinity.get(key)
        if rank is None:
            # Fewest in flight; on a tie the rank that served fewer so far, so that requests sent one at a time
            # take turns rather than all landing on rank 0.
            rank = min(range(self.size), key=lambda r: (self.in_flight[r], self.num_routed[r]))
        self._affinity[key] = rank
        self._affinity.move_to_end(key)
        if len(self._affinity) > self.max_affinity_keys:
            self._affinity.popitem(last=False)
        for request_id in request.request_ids:
            self.owners[request_id] = rank
        self.in_flight[rank] += len(request.request_ids)
        self.num_routed[rank] += len(request.request_ids)
        return rank

    def finished(self, outputs: Sequence[EngineCoreOutput]) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                rank = self.owners.pop(out.request_id, None)
                if rank is not None:
                    self.in_flight[rank] -= 1

    def by_rank(self, request_ids: Sequence[str]) -> dict[int, list[str]]:
        """`request_ids` grouped by the rank that owns them; ids no rank owns (finished already) are left out."""
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self.owners.get(request_id)
            if rank is not None:
                groups.setdefault(rank, []).append(request_id)
        return groups


# ---- combining the ranks' results of one call ----


def _same(method: str, values: list[Any]) -> Any:
    """The one value every rank returned; ranks that disagree are an error, never averaged away."""
    if any(v != values[0] for v in values[1:]):
        raise RuntimeError(f"{method}: the data-parallel ranks disagree: {dict(enumerate(values))}")
    return values[0]


def _same_checksums(method: str, values: list[dict[str, str]]) -> dict[str, str]:
    """The model's checksums from every rank's: each rank's part of the tensors (under expert parallel a rank holds
    only its experts), a tensor that several ranks hold having the same checksum on each."""
    merged = dict(values[0])
    for rank, checksums in enumerate(values[1:], start=1):
        differ = sorted(name for name in checksums.keys() & merged.keys() if checksums[name] != merged[name])
        if differ:
            raise RuntimeError(
                f"{method}: data-parallel rank {rank} holds other weights than rank 0 ({len(differ)} tensors differ, "
                f"e.g. {differ[:3]})"
            )
        merged.update(checksums)
    return merged


def _every(method: str, values: list[bool]) -> bool:
    """Paused (asleep) is a state of the engine: true once every rank is in it."""
    return all(values)


def _concatenated(method: str, values: list[list[Any]]) -> list[Any]:
    """collective_rpc: one result per worker, rank 0's workers first (vLLM's order)."""
    return [v for rank_values in values for v in rank_values]


_AVERAGED_STATS = frozenset({"kv_cache_usage"})


def combine_stats(values: list[dict[str, Any]], router: DPRouter) -> dict[str, Any]:
    """The engine's counters and gauges summed over ranks (usage averaged), and each rank's own under
    `data_parallel` with the front end's counts of the requests routed to it."""
    first = values[0]
    combined: dict[str, Any] = dict(first)
    for name, value in first.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total = sum(v[name] for v in values)
            combined[name] = total / len(values) if name in _AVERAGED_STATS else total
    combined["is_paused"] = all(v["is_paused"] for v in values)
    # A label on /metrics, read while a weight update may be half-way through the ranks: shown, not raised.
    combined["weight_version"] = ",".join(dict.fromkeys(v["weight_version"] for v in values))
    combined["cache_config"] = first["cache_config"] | {
        name: sum(v["cache_config"][name] for v in values) for name in ("num_gpu_blocks", "kv_cache_size_tokens")
    }
    combined["data_parallel"] = [
        v | {"num_requests_routed": router.num_routed[rank], "num_requests_in_flight": router.in_flight[rank]}
        for rank, v in enumerate(values)
    ]
    return combined


Combine = Callable[[str, list[Any]], Any]


def _worst_outcome(method: str, values: list[str]) -> str:
    """abandon_weight_update's: the ranks' outcomes can differ (one had written tensors when the trainer died, another
    not); the engine is as bad as its worst rank: incomplete, then restored, then unchanged."""
    return min(values, key=("incomplete", "restored", "unchanged").index)


COMBINE: dict[str, Combine] = {
    "abandon_weight_update": _worst_outcome,
    "checksums": _same_checksums,
    "is_paused": _every,
    "is_sleeping": _every,
    "collective_rpc": _concatenated,
}


def combined(method: str, results: list[UtilityResult], router: DPRouter) -> Any:
    """The call's value over all ranks, or the first failing rank's error raised (as the single-core client raises
    it: the server maps its message to a field)."""
    for rank, result in enumerate(results):
        if result.error_type is not None:
            others = [r for r, res in enumerate(results) if res.error_type is None]
            logger.error("%s failed on data-parallel rank %d (succeeded on ranks %s)", method, rank, others)
            raise_for(result)
    values = [result.value for result in results]
    if method == "stats":
        return combine_stats(values, router)
    return COMBINE.get(method, _same)(method, values)


# ---- the clients ----


class _DPClientBase:
    """What both DP clients share: the ranks, the router, and where the calls that name requests go."""

    in_process = False

    def __init__(self, config: EngineConfig, make_rank: Callable[[EngineConfig], Any], launcher: Any = None) -> None:
        """`launcher`: what started the ranks' cores (make_launcher), stopped after them; None for cores that
        another process started."""
        self.router = DPRouter(config.data_parallel_size)
        if config.data_parallel_lockstep and config.data_parallel_master_port == 0:
            config = replace(config, data_parallel_master_port=free_port(config.data_parallel_master_ip))
        self.launcher = launcher
        self.ranks: list[Any] = []
        try:
            for rank in range(config.data_parallel_size):  # every core starts now, in parallel; connect waits
                self.ranks.append(make_rank(config.for_data_parallel_rank(rank)))
        except BaseException:
            self.shutdown()
            raise

    @property
    def not_serving(self) -> str | None:
        """Why generation is refused, if any rank refuses it (as each core last reported)."""
        for rank, client in enumerate(self.ranks):
            if client.not_serving is not None:
                return f"data-parallel rank {rank}: {client.not_serving}"
        return None

    @property
    def rejecting_new_requests(self) -> bool:
        """A pause in mode abort or wait refuses new requests on some rank (a pause reaches every rank)."""
        return any(client.rejecting_new_requests for client in self.ranks)

    def _route(self, requests: list[AddRequest], session_id: str | None) -> dict[int, list[AddRequest]]:
        groups: dict[int, list[AddRequest]] = {}
        for request in requests:
            groups.setdefault(self.router.route(request, session_id), []).append(request)
        return groups

    def _rank_args(self, method: str, args: tuple) -> list[tuple[int, tuple]]:
        """(rank, arguments) of each rank a call goes to: every rank, or for abort_requests the owners of the ids."""
        if method == "abort_requests":
            return [(rank, (ids,)) for rank, ids in self.router.by_rank(args[0]).items()]
        return [(rank, args) for rank in range(len(self.ranks))]

    def _combined(self, method: str, results: list[UtilityResult]) -> Any:
        if method == "abort_requests":
            return None
        return combined(method, results, self.router)

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.shutdown()
        if self.launcher is not None:
            self.launcher.shutdown()


class DPMPClient(_DPClientBase):
    """`LLM`'s client of `data_parallel_size` core processes: one `MPClient` per rank, read through one poller."""

    def __init__(self, config: EngineConfig) -> None:
        launcher = make_launcher(config)
        super().__init__(config, lambda rank_config: MPClient(rank_config, launcher.launch), launcher)
        self.poller = zmq.Poller()
        for rank in self.ranks:
            self.poller.register(rank.socket, zmq.POLLIN)
        self._by_socket = {rank.socket: rank for rank in self.ranks}
        self._last_liveness_check = time.monotonic()

    def connect(self) -> dict[str, Any]:
        return _same("engine_info", [rank.connect() for rank in self.ranks])

    def _receive(self) -> None:
        """Wait until some rank sent something and file it; check that every core lives at least once per
        LIVENESS_INTERVAL_S, even while the others keep sending (a call waits on all ranks)."""
        ready = self.poller.poll(int(LIVENESS_INTERVAL_S * 1000))
        now = time.monotonic()
        if not ready or now - self._last_liveness_check > LIVENESS_INTERVAL_S:
            self._last_liveness_check = now
            for rank in self.ranks:
                rank.check_alive()
        for socket, _ in ready:
            self._by_socket[socket].read()

    def add(self, requests: list[AddRequest], session_id: str | None = None) -> None:
        for rank, group in self._route(requests, session_id).items():
            self.ranks[rank].add(group)

    def abort(self, request_ids: list[str]) -> None:
        for rank, ids in self.router.by_rank(request_ids).items():
            self.ranks[rank].abort(ids)

    def call(self, method: str, *args: Any) -> Any:
        targets = self._rank_args(method, args)
        pending = [(rank, self.ranks[rank].start_call(method, *rank_args)) for rank, rank_args in targets]
        results: dict[int, UtilityResult] = {}
        while len(results) < len(pending):
            self._receive()
            for rank, call_id in pending:
                result = self.ranks[rank].result(call_id) if rank not in results else None
                if result is not None:
                    results[rank] = result
        return self._combined(method, [results[rank] for rank, _ in pending])

    def get_outputs(self) -> list[EngineCoreOutput]:
        outputs = [out for rank in self.ranks for out in rank.take_outputs()]
        if not outputs:
            self._receive()
            outputs = [out for rank in self.ranks for out in rank.take_outputs()]
        self.router.finished(outputs)
        return outputs


class DPAsyncMPClient(_DPClientBase):
    """`AsyncLLM`'s client of `data_parallel_size` core processes: one `AsyncMPClient` per rank on one event loop.
    The outputs of every rank reach `on_outputs`; the death of any core is the engine's (`on_dead`)."""

    def __init__(self, config: EngineConfig, make_rank: Callable[[EngineConfig], AsyncMPClient] | None = None) -> None:
        """`make_rank`: the client of one rank's core, given its config (by default it starts the core)."""
        if make_rank is not None:
            super().__init__(config, make_rank)
        else:
            launcher = make_launcher(config)
            super().__init__(config, lambda rank_config: AsyncMPClient(rank_config, launch=launcher.launch), launcher)
        self.on_outputs: Callable[[list[EngineCoreOutput]], None] = lambda outputs: None
        self.on_dead: Callable[[str], None] = lambda reason: None
        self.dead: str | None = None
        for rank in self.ranks:
            rank.on_outputs = self._on_rank_outputs
            rank.on_dead = self._on_rank_dead

    def connect(self) -> dict[str, Any]:
        return _same("engine_info", [rank.connect() for rank in self.ranks])

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        for rank in self.ranks:
            rank.bind(loop)

    def _on_rank_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        self.router.finished(outputs)
        self.on_outputs(outputs)

    def _on_rank_dead(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
            self.on_dead(reason)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def fail_calls(self, error: BaseException) -> None:
        for rank in self.ranks:
            rank.fail_calls(error)

    def add(self, requests: list[AddRequest], session_id: str | None = None) -> None:
        self._check_alive()
        for rank, group in self._route(requests, session_id).items():
            self.ranks[rank].add(group)

    def abort(self, request_ids: list[str]) -> None:
        for rank, ids in self.router.by_rank(request_ids).items():
            self.ranks[rank].abort(ids)

    async def call(self, method: str, *args: Any) -> Any:
        self._check_alive()
        targets = self._rank_args(method, args)
        # Raw results, so that every rank's call has finished before any error is raised: a caller that retries
        # after a failure must not race the ranks still working on the first attempt.
        results = await asyncio.gather(*(self.ranks[rank].call_raw(method, *rank_args) for rank, rank_args in targets))
        return self._combined(method, list(results))
