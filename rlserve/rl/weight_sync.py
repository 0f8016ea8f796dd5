"""Pushing a trainer's weights into a live engine over HTTP control plus a weight-transfer backend, with generation
paused only for the length of the transfer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlserve.dtypes import dtype_name
from rlserve.engine.wire.process import free_port
from rlserve.rl.client import AsyncRLServeClient
from rlserve.rl.engine_server import EngineServer
from rlserve.weight_transfer import (
    IPCStagingBuffer,
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    WeightTransferGroup,
)

BACKENDS = ("nccl", "ipc")
# The toy models of the demo and the example fit in one bucket: one broadcast per update.
PACKED_BUFFER_SIZE_BYTES = 8 << 20
RENDEZVOUS_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SyncTiming:
    sync_ms: float  # start_weight_update -> finish_weight_update returned: the transfer itself
    pause_ms: float  # pause called -> resume returned: how long generation stood still
    # Each call of the sequence (pause, start, transfer, finish, resume), for the JSON log: where a slow sync goes.
    phases_ms: dict[str, float]


class WeightSync:
    """Pushes the trainer's weights into the engine through the native four-phase API, around a pause(keep).

    `nccl`: the trainer (rank 0) and the engine's worker (rank 1) form a group once (`connect`); every update is one
    packed broadcast (gloo for CPU tensors), received by the engine while its `update_weights` call is pending.
    `ipc`: nothing to connect; the trainer posts the CUDA handle of its staging buffer as the update itself, over
    the control client's connection. The buffer is kept across updates, so it is exported and mapped once.
    """

    def __init__(self, engine: EngineServer, control: AsyncRLServeClient) -> None:
        self.engine = engine
        self.control = control
        self._group: WeightTransferGroup | None = None
        self._staging = IPCStagingBuffer(PACKED_BUFFER_SIZE_BYTES)  # allocated on the first ipc update

    async def connect(self) -> None:
        if self.engine.backend == "ipc":
            await self.control.init_weight_transfer_engine({})
            return
        init_info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
        # Both sides block until the other joins: the engine's call is awaited while the trainer joins on a thread.
        _, self._group = await asyncio.gather(
            self.control.init_weight_transfer_engine(init_info),
            asyncio.to_thread(NCCLWeightTransferEngine.trainer_init, {**init_info, "timeout_s": RENDEZVOUS_TIMEOUT_S}),
        )

    async def push(self, weights: Sequence[tuple[str, torch.Tensor]], version: int) -> SyncTiming:
        phases: dict[str, float] = {}

        async def timed(name: str, call: Awaitable[Any]) -> None:
            t = time.perf_counter()
            await call
            phases[name] = (time.perf_counter() - t) * 1e3

        # keep: in-flight requests freeze and continue under the new weights. clear_cache: their KV is recomputed
        # under the new weights, so every token's logprob is exactly what the trainer computes for its version
        # (PipelineRL keeps the stale KV instead: a small, unmeasured mismatch in exchange for no recompute).
        await timed("pause", self.control.pause(mode="keep", clear_cache=True))
        try:
            await timed("start", self.control.start_weight_update())
            await timed("transfer", self._transfer(weights))
            await timed("finish", self.control.finish_weight_update(weight_version=str(version)))
        finally:
            await timed("resume", self.control.resume())
        sync_ms = phases["start"] + phases["transfer"] + phases["finish"]
        return SyncTiming(sync_ms=sync_ms, pause_ms=sync_ms + phases["pause"] + phases["resume"], phases_ms=phases)

    async def _transfer(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        if self.engine.backend == "ipc":
            loop = asyncio.get_running_loop()

            def post(update_info: dict[str, Any]) -> None:  # on the sending thread, through this loop's client
                asyncio.run_coroutine_threadsafe(self.control.update_weights(update_info), loop).result()

            args = IPCTrainerSendWeightsArgs(send_mode=post, packed=True, staging=self._staging)
            await asyncio.to_thread(IPCWeightTransferEngine.trainer_send_weights, iter(weights), args)
            return
        if self._group is None:
            raise RuntimeError("WeightSync.push before connect()")
        update_info = {
            "names": [name for name, _ in weights],
            "dtype_names": [dtype_name(t.dtype) for _, t in weights],
            "shapes": [list(t.shape) for _, t in weights],
            "packed": True,
            "packed_buffer_size_bytes": PACKED_BUFFER_SIZE_BYTES,
        }
        args = NCCLTrainerSendWeightsArgs(
            group=self._group, packed=True, packed_buffer_size_bytes=PACKED_BUFFER_SIZE_BYTES
        )
        await asyncio.gather(
            self.control.update_weights(update_info),
            asyncio.to_thread(NCCLWeightTransferEngine.trainer_send_weights, iter(weights), args),
        )

    def close(self) -> None:
        if self._group is not None:
            self._group.shutdown()
            self._group = None
