"""The engine cores as Ray actors (`data_parallel_backend="ray"`, vLLM's option).

`RayLauncher` reserves a placement group of one bundle per data-parallel rank (a GPU each on CUDA, a CPU on the
CPU; PACK: one node while it has room, the next ones after) and starts each rank's core in an `EngineCoreActor` on its
bundle. The actor (core/actor.py) runs the same core loop as a core process on a thread of its own and binds the same
ZMQ socket, so the front end speaks the same typed messages to it: an ipc socket when the actor shares the front
end's node, TCP on the actor's node address otherwise. Everything above the client is unchanged.

The front end connects to the cluster named by RAY_ADDRESS, or starts a local one. The actors are owned by the
front end's process: shutdown kills them and removes the placement group, and Ray stops them if that process dies.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

from rlserve import vllm_surface
from rlserve.config import EngineConfig
from rlserve.engine.core.actor import EngineCoreActor
from rlserve.engine.frontend.launcher import STARTUP_TIMEOUT_S, startup_error
from rlserve.engine.wire.auth import new_secret, private_ipc_address, remove_ipc_address
from rlserve.engine.wire.backends import registered_backends
from rlserve.engine.wire.startup import EXIT_PEER_LOST, EXIT_STEP_FAILED, CoreStartup

logger = logging.getLogger(__name__)

RAY_EXTRA = "pip install 'rlserve[ray]'"
PLACEMENT_TIMEOUT_S = 120.0  # a cluster that is scaling up may take a while to offer the bundles
STOP_TIMEOUT_S = 10.0


def import_ray(what: str) -> Any:
    """The `ray` module, or an error that names the extra which installs it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{what} needs Ray, an optional extra of rlserve: {RAY_EXTRA}") from e
    return ray


def connect_ray(what: str) -> Any:
    """Ray, connected: to the cluster of RAY_ADDRESS when that is set, else to the one this process already joined,
    else to a local one started here (vLLM's behaviour)."""
    ray = import_ray(what)
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address="auto")
        else:
            ray.init()
    return ray


class RayCore:
    """The front end's handle on one core actor, with the surface of launcher.CoreProcess."""

    def __init__(self, ray: Any, actor: Any, rank: int, address: str, secret: str) -> None:
        self.ray = ray
        self.actor = actor
        self.rank = rank
        self.address = address  # the proposed one until wait_ready tells where the core listens
        self._proposed_address = address  # its directory is this node's to remove, whichever the core took
        self.secret = secret
        self.pid: int | None = None
        self._address_ref = actor.address.remote()
        self._run_ref = actor.run.remote()
        self._waited = False
        self._stop_requested = False

    def _name(self) -> str:
        pid = f", pid {self.pid}" if self.pid is not None else ""
        return f"the engine-core actor of data-parallel rank {self.rank}{pid}"

    def wait_ready(self) -> None:
        if self._waited:
            return
        self._waited = True
        ray = self.ray
        started = time.monotonic()
        try:
            self.address, self.pid = ray.get(self._address_ref, timeout=STARTUP_TIMEOUT_S)
            status, detail = ray.get(self.actor.wait_ready.remote(STARTUP_TIMEOUT_S), timeout=STARTUP_TIMEOUT_S + 30)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"{self._name()} died while starting: {e}") from None
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"{self._name()} did not start within {STARTUP_TIMEOUT_S:.0f} s") from None
        if status != "ready":
            raise startup_error(detail)
        logger.info("%s serving at %s after %.1f s", self._name(), self.address, time.monotonic() - started)

    def is_alive(self) -> bool:
        done, _ = self.ray.wait([self._run_ref], timeout=0)
        return not done

    def _exit_code(self) -> int | str:
        """The code `run` returned, or why the actor died without returning."""
        try:
            return self.ray.get(self._run_ref, timeout=STOP_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            return "still running"
        except self.ray.exceptions.RayError as e:
            return f"{type(e).__name__}: {e}"

    def death_reason(self) -> str:
        code = self._exit_code()
        if code == 0:
            return f"{self._name()} was stopped"
        if code == EXIT_STEP_FAILED:
            return f"{self._name()} died (an engine step failed; the traceback is in its log)"
        if code == EXIT_PEER_LOST:
            return f"{self._name()} died (a data-parallel peer it steps in lockstep with was gone)"
        return f"{self._name()} died ({code if isinstance(code, str) else f'exit code {code}'})"

    @property
    def stopped(self) -> bool:
        """It exited as told, rather than crashing or being killed."""
        return self._stop_requested and self._exit_code() == 0

    def shutdown(self) -> None:
        """Stop the core's loop (it closes its weight-transfer group), then kill the actor whatever it did."""
        ray = self.ray
        remove_ipc_address(self._proposed_address)
        if not ray.is_initialized():  # this process left the cluster (exiting): Ray stopped the actors it owned
            return
        if self.is_alive():
            self._stop_requested = True
            try:
                self.actor.stop.remote()
                ray.wait([self._run_ref], timeout=STOP_TIMEOUT_S)
            except ray.exceptions.RayError:
                pass  # dead already
        ray.kill(self.actor)


class RayLauncher:
    """Starts each rank's core as an actor on its bundle of one placement group (see the module's doc)."""

    def __init__(self, config: EngineConfig) -> None:
        ray = self.ray = connect_ray("data_parallel_backend: ray")
        from ray.util.placement_group import placement_group

        self.on_gpu = config.device.startswith("cuda")
        # A rank's GPUs: one per tensor-parallel rank (its followers run in the actor's own placement).
        bundle = {"GPU": config.tensor_parallel_size} if self.on_gpu else {"CPU": 1}
        self.placement_group = placement_group([dict(bundle)] * config.data_parallel_size, strategy="PACK")
        self.cores: list[RayCore] = []
        self.lockstep_secret = new_secret()  # the ranks' wave notices carry it (dp_lockstep.py)
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise RuntimeError(
                f"data_parallel_backend: the Ray cluster has no room for {config.data_parallel_size} bundles of "
                f"{bundle} (after {PLACEMENT_TIMEOUT_S:.0f} s; it has {ray.cluster_resources()})"
            ) from None
        self.node_id = ray.get_runtime_context().get_node_id()
        self.actor_class = ray.remote(EngineCoreActor)

    def launch(self, config: EngineConfig) -> RayCore:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rank = config.data_parallel_rank
        # Ray shows the actor only its own GPU (CUDA_VISIBLE_DEVICES): that is cuda:0 there, whatever the rank.
        config = replace(config, device="cuda") if self.on_gpu else config
        log_level = logging.getLogger("rlserve").getEffectiveLevel()
        startup = CoreStartup(
            config,
            private_ipc_address(),
            None,
            registered_backends(config),
            log_level,
            new_secret(),
            self.lockstep_secret,
            vllm_surface.active(),
        )
        actor = self.actor_class.options(
            num_cpus=0 if self.on_gpu else 1,
            num_gpus=1 if self.on_gpu else 0,
            max_concurrency=3,  # run, and wait_ready or stop beside it
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank
            ),
        ).remote(startup, self.node_id)
        core = RayCore(self.ray, actor, rank, startup.address, startup.secret)
        self.cores.append(core)
        return core

    def shutdown(self) -> None:
        """Kill any core still running (each client stopped its own already) and give the bundles back."""
        if not self.ray.is_initialized():
            return
        for core in self.cores:
            self.ray.kill(core.actor)
        self.cores = []
        self.ray.util.remove_placement_group(self.placement_group)
