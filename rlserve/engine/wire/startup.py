"""What an engine core's launcher hands the core's main loop (by value: it crosses into the core's process), and the
exit codes by which the core tells the launcher why it stopped."""

from __future__ import annotations

from dataclasses import dataclass

from rlserve.config import EngineConfig

EXIT_STEP_FAILED = 3  # an engine step raised: its requests were ended, the traceback is in the core's log
EXIT_PEER_LOST = 4  # data-parallel lockstep: a peer rank left (stopped or died) while this one needed it


@dataclass(frozen=True)
class CoreStartup:
    """What the core process needs to start, passed to it by value."""

    config: EngineConfig
    address: str
    parent_pid: int | None  # the front end's, watched by the core; None for a Ray actor (Ray stops it with its owner)
    # Weight-transfer backends the front end registered by class ({name: "module:Class"}); the core registers them
    # too, so a backend registered before the engine was created works as in one process.
    extra_backends: dict[str, str]
    log_level: int  # the front end's, for rlserve's loggers: what it logs, the core logs too
    secret: str  # what every front end presents in its socket's handshake (wire/auth.py)
    # What the ranks of a data-parallel lockstep group present to each other's wave-notice sockets (dp_lockstep.py):
    # one per group, from the launcher that starts them all; None outside lockstep.
    lockstep_secret: str | None = None
    # Whether the front end runs under rlserve's vllm surface (rlserve.vllm_surface.active): the core then runs its
    # worker extension under it too, whatever the environment of the fork server it comes from (the one that server
    # started with, maybe before the front end asked for the surface).
    vllm_surface: bool = False
