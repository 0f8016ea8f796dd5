"""The trainer's side of weight transfer in vLLM 0.33's shape: a `TrainerWeightTransferEngine` built by
`WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)` drives the whole handshake through a
`VLLMWeightSyncClient` (init, then per round start / update / finish), so trainer code never sees the transport.

Every trainer rank constructs the engine and calls `send_weights`; rank 0 is the sender (it alone talks to the
engine and opens the transport), the others only join the gathers of sharded parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar, runtime_checkable

import torch

from rlserve.weight_transfer.source import ParamMeta, WeightSource

UpdatePayload = dict[str, Any] | list[dict[str, Any]]


@runtime_checkable
class VLLMWeightSyncClient(Protocol):
    """The engine's weight-sync control plane as the trainer drives it: any object with these four synchronous
    methods (structural, as in vLLM). rlserve's `LLM` is one as it is (in-process); `HTTPVLLMWeightSyncClient` (a
    `rlserve serve` over HTTP) and `RayVLLMWeightSyncClient` (engine actors) are the others."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: UpdatePayload) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


@dataclass
class TrainerInitInfo:
    """Base of the trainer-side init infos: `rank` is this trainer process's rank, given explicitly (never read from
    a global process group, which is ambiguous with FSDP/TP/PP groups); rank 0 sends. Each subclass names its
    `backend` (the `WeightTransferTrainerFactory` key) as a class variable."""

    backend: ClassVar[str]

    rank: int = field(default=0, kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "backend", None):
            raise TypeError(f"{cls.__name__} must set a class-level `backend` string (its trainer factory key)")

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


TTrainerInitInfo = TypeVar("TTrainerInitInfo", bound=TrainerInitInfo)


class TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo]):
    """The trainer's end of a backend. Full-resync backends (nccl, ipc) take a `WeightSource` at `trainer_init` and
    send all of it on each `send_weights()`; delta backends (sparse_nccl) take no source and get each round's patches
    as `send_weights`'s argument."""

    init_info_cls: ClassVar[type[TrainerInitInfo]]

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None, is_sender: bool = True, rank: int = 0
    ) -> None:
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.rank = rank

    @classmethod
    @abstractmethod
    def trainer_init(
        cls, init_info: TTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        """Rendezvous with the engine (the sender calls `client.init_weight_transfer_engine` while opening its
        endpoint) and return a ready engine. Called on every trainer rank."""

    @abstractmethod
    def send_weights(self) -> None:
        """One whole round trip: start_weight_update, update_weights (concurrently with the transfer where the
        transport needs it), finish_weight_update. Called on every trainer rank."""

    def shutdown(self) -> None:
        """Close the transport. Default: nothing to close."""


def run_trainer_rendezvous(*, init_worker: Callable[[], None], init_trainer: Callable[[], None]) -> None:
    """Both sides of a rendezvous block until the other joins: the engine's init call runs on a thread while the
    trainer opens its endpoint here; the engine's error, if any, is raised."""
    with ThreadPoolExecutor(max_workers=1) as executor:
        future = executor.submit(init_worker)
        try:
            init_trainer()
        finally:
            future.result()


def send_with_update(update: Callable[[], None], send: Callable[[], None]) -> None:
    """Run the engine's `update_weights` call on a thread while the trainer sends (both meet inside the same
    broadcasts). An update call that fails before the engine receives (a refused request) is raised before
    sending; one that fails after it received (the engine took delivery and dropped the bytes) after it."""
    executor = ThreadPoolExecutor(max_workers=1)
    try:
        future = executor.submit(update)
        if future.done():
            future.result()
        send()
        future.result()
    finally:
        # Never join here: if the send raised, the engine's call is still blocked in its receive.
        executor.shutdown(wait=False)


def checked_iter(source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The sender's `iter_full()`, each item checked against the metadata the engine was told to expect: a
    disagreement would split the stream differently on the two sides (a hang, or garbage); this names it."""
    sent = 0
    for name, tensor in source.iter_full():
        if sent >= len(meta):
            raise ValueError(f"WeightSource yielded more parameters than its metadata declares; first extra {name!r}")
        expected = meta[sent]
        if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != expected.shape:
            raise ValueError(
                f"WeightSource metadata disagrees with iteration at index {sent}: declared {expected.name!r} "
                f"{expected.dtype} {expected.shape}, got {name!r} {tensor.dtype} {tuple(tensor.shape)}"
            )
        sent += 1
        yield name, tensor
    if sent != len(meta):
        raise ValueError(f"WeightSource yielded {sent} parameters but its metadata declares {len(meta)}")


def check_single_sender(source: WeightSource) -> None:
    """Broadcast and IPC have one sender, rank 0: every parameter's owners must include it first."""
    for m in source.metadata:
        if m.owners is not None and m.owners[0] != 0:
            raise ValueError(
                f"rank 0 does not own every parameter: {m.name!r} is sent by its first owner, rank {m.owners[0]}, but "
                "this backend has one sender, rank 0 (every parameter's owners must start at rank 0)"
            )
