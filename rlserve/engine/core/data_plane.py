"""What the engine core's control-plane collaborators (pause.py, sleep.py, weights.py, loras.py, profiling.py,
worker_rpc.py) act on: the core's data plane, described here so that none of them imports the EngineCore that
holds them."""

from __future__ import annotations

from typing import Protocol

from rlserve.config import EngineConfig
from rlserve.engine.sched.kv_cache import KVCacheManager
from rlserve.engine.sched.request import Request
from rlserve.engine.sched.scheduler import Scheduler
from rlserve.engine.wire.messages import EngineCoreOutput
from rlserve.engine.worker.model_runner import ModelRunner


class DataPlane(Protocol):
    config: EngineConfig  # the one in force: update_config (weights.py) replaces it
    runner: ModelRunner  # rank 0's
    scheduler: Scheduler
    kv_cache: KVCacheManager
    requests: dict[str, Request]  # the unfinished ones, by id

    def drain(self) -> None:
        """Read back the step in flight (its outputs wait in `take_pending_outputs`): no device work races what the
        caller does next."""

    def take_pending_outputs(self) -> list[EngineCoreOutput]: ...

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]: ...
