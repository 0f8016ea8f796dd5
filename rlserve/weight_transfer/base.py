"""Backend-neutral pieces of weight transfer: request envelopes, info dataclasses and the engine interface.

The shapes follow vLLM's native weight-sync API (G1/G2): the engine builds one backend per worker from
`WeightTransferConfig`, hands it the trainer's `init_info` once, and the `update_info` of every update.

The info dataclasses are deliberately not frozen: vLLM's are plain dataclasses and backends written for it subclass
them, and a plain dataclass may not inherit from a frozen one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from rlserve.config import WeightTransferConfig
from rlserve.dtypes import dtype_from_name

TRAINER_LOST = (ConnectionError, TimeoutError)
"""What `receive_weights` raises when the trainer is gone or silent (peer lost, nothing within the timeout): the
engine then abandons the update, since the rest of it will never come. Any other error leaves the update open."""

LoadWeightsFn = Callable[[list[tuple[str, torch.Tensor]]], None]
"""Loads `(checkpoint_name, tensor)` pairs into the model. It copies out of the tensors, so a backend may reuse its
receive buffers as soon as the call returns."""


@dataclass
class WeightTransferInitRequest:
    """Envelope of `init_weight_transfer_engine`: the backend-specific `init_info` as plain data."""

    init_info: dict[str, Any]


@dataclass
class WeightTransferUpdateRequest:
    """Envelope of `update_weights`: the backend-specific `update_info` as plain data."""

    update_info: dict[str, Any]


@dataclass
class WeightTransferInitInfo:
    """Base of the backend-specific init infos (sent once, at the handshake)."""


@dataclass
class WeightTransferUpdateInfo:
    """Base of the backend-specific update infos: the metadata of every tensor of the update, in sending order.

    The engine checks names, dtypes and shapes against its model before the first byte arrives, so every backend's
    update info carries them.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        count = len(self.names)
        if len(self.dtype_names) != count:
            raise ValueError(
                f"`dtype_names` should be of the same size as `names`: got {len(self.dtype_names)} and {count}"
            )
        if len(self.shapes) != count:
            raise ValueError(f"`shapes` should be of the same size as `names`: got {len(self.shapes)} and {count}")
        for name in self.dtype_names:
            dtype_from_name(name)
        for name, shape in zip(self.names, self.shapes, strict=True):
            if not isinstance(shape, list | tuple) or not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError(f"shape of {name!r} must be a list of non-negative ints, got {shape!r}")

    @property
    def dtypes(self) -> list[torch.dtype]:
        return [dtype_from_name(n) for n in self.dtype_names]


TInitInfo = TypeVar("TInitInfo", bound=WeightTransferInitInfo)
TUpdateInfo = TypeVar("TUpdateInfo", bound=WeightTransferUpdateInfo)


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    """One worker's end of a weight-transfer backend.

    The engine calls, in order: `parse_init_info` + `init_transfer_engine` once; then per update
    `parse_update_info` and either `receive_weights` (metadata accepted) or `discard_weights` (metadata refused, so
    that a trainer in the middle of sending does not hang); `shutdown` at the end. The trainer side is the static
    `trainer_send_weights` (and, where the backend needs a rendezvous, a static `trainer_init`).
    """

    init_info_cls: ClassVar[type[WeightTransferInitInfo]]
    update_info_cls: ClassVar[type[WeightTransferUpdateInfo]]
    # This worker's index among all the engine's workers (vLLM: dp_rank * TP * PP + rank within the DP group), set
    # by the factory: a backend with one group for every worker (nccl) takes its rank from it.
    worker_index: int = 0

    def __init__(self, config: WeightTransferConfig, device: torch.device) -> None:
        self.config = config
        self.device = torch.device(device)

    def parse_init_info(self, init_info: dict[str, Any]) -> TInitInfo:
        return self._parse(self.init_info_cls, init_info, "init_info")  # type: ignore[return-value]

    def parse_update_info(self, update_info: dict[str, Any]) -> TUpdateInfo:
        return self._parse(self.update_info_cls, update_info, "update_info")  # type: ignore[return-value]

    def _parse(self, cls: type, data: dict[str, Any], what: str) -> Any:
        if not isinstance(data, dict):
            raise ValueError(f"Invalid {what} for {type(self).__name__}: expected a dict, got {type(data).__name__}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"Invalid {what} for {type(self).__name__}: {e}") from e

    @abstractmethod
    def init_transfer_engine(self, init_info: TInitInfo) -> None:
        """Set up the transport (a rendezvous with the trainer, where the backend has one). May block until the
        trainer joins."""

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo, load_weights: LoadWeightsFn) -> None:
        """Receive the tensors described by `update_info` and pass them to `load_weights` (possibly in several
        calls). Returns once every tensor has been handed over; raises one of TRAINER_LOST if the trainer is gone or
        silent for longer than the backend waits."""

    @abstractmethod
    def discard_weights(self, update_info: TUpdateInfo) -> None:
        """Take delivery of the update described by `update_info` and drop it: called instead of `receive_weights`
        when the engine refused the update's metadata, so the trainer's send completes and the transport stays in
        step."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the transport. Safe to call more than once."""

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: Any) -> None:
        """Trainer side: send `(name, tensor)` pairs to the engine(s)."""
        raise NotImplementedError("this weight transfer backend has no trainer-side sender")

    def _not_initialized(self) -> RuntimeError:
        return RuntimeError(
            f"{type(self).__name__} is not initialized: call init_weight_transfer_engine before updating weights"
        )
