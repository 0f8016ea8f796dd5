"""Backend-neutral pieces of weight transfer: request envelopes, info dataclasses and the engine interface.

The shapes follow vLLM's native weight-sync API (G1/G2): the engine builds one backend per worker from
`WeightTransferConfig`, hands it the trainer's `init_info` once, and the `update_info` of every update.

The info dataclasses are deliberately not frozen: vLLM's are plain dataclasses and backends written for it subclass
them, and a plain dataclass may not inherit from a frozen one.
"""

from __future__ import annotations

import inspect
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


@dataclass(frozen=True)
class ParallelConfigLike:
    """What a vLLM 0.33 backend reads of `vllm_config.parallel_config` to place a worker in the trainer's group:
    its rank within its data-parallel group (TP x PP; rlserve has one worker per core), and the group's index."""

    rank: int = 0
    world_size: int = 1
    data_parallel_index: int = 0
    data_parallel_size: int = 1

    @property
    def data_parallel_rank(self) -> int:
        return self.data_parallel_index

    @property
    def world_size_across_dp(self) -> int:
        return self.world_size * self.data_parallel_size


@dataclass(frozen=True)
class VllmConfigLike:
    """The stand-in for `vllm_config` that rlserve passes a vLLM 0.33-shaped backend: `parallel_config` as above;
    `model_config` the engine's `EngineConfig` (vLLM's layerwise reload, which reads it, does not exist here)."""

    parallel_config: ParallelConfigLike = ParallelConfigLike()
    model_config: Any = None


def current_device() -> torch.device:
    """The current accelerator device, where vLLM places what it builds without a device; without one, the CPU
    (rlserve's weight transfer runs over gloo there)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class WeightUpdateRefused(ValueError):
    """Raised by `receive_weights` when it refused the update after taking delivery but before writing any of it
    (a sparse index out of bounds, say): the engine then knows the model is unchanged."""


class _DiscardingModel(torch.nn.Module):
    """The target of a discarded update for a backend that loads through `self.model.load_weights`."""

    def load_weights(self, weights) -> int:
        return sum(1 for _ in weights)


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    """One worker's end of a weight-transfer backend, in either of vLLM's two shapes:

    - vLLM 0.33: `__init__(config, vllm_config, device, model)` and `receive_weights(update_info)`, which loads into
      the engine-owned `self.model` (its `load_weights`, or in place);
    - vLLM 0.24: `receive_weights(update_info, load_weights)`, which hands tensors to the engine's loader; built as
      `__init__(config, device)`, or as vLLM 0.24.0 builds it, `__init__(config, parallel_config, model)` (on this
      process's current device).

    The factory and the engine tell them apart by signature (a constructor parameter named `model`, a
    `receive_weights` with a second parameter). The engine calls, in order: `parse_init_info` +
    `init_transfer_engine` once; per update `start_weight_update`, then for each `update_weights` call
    `parse_update_info` and either `receive_weights` (metadata accepted) or `discard_weights` (refused, so a trainer
    in the middle of sending does not hang), then `finish_weight_update`; `shutdown` at the end.

    rlserve's own dense backends keep the 0.24 shape: the engine's loader records exactly which tensors were written,
    so a failed update rolls back only those. A 0.33 backend's failure counts every tensor of its update as written,
    unless it raises `WeightUpdateRefused`.
    """

    init_info_cls: ClassVar[type[WeightTransferInitInfo]]
    update_info_cls: ClassVar[type[WeightTransferUpdateInfo]]
    # True for a backend that patches tensors rather than rewriting them (sparse_nccl): a tensor that held no valid
    # weights still holds none after a patch.
    applies_deltas: ClassVar[bool] = False
    # This worker's index among all the engine's workers (vLLM: dp_rank * TP * PP + rank within the DP group), set
    # by the factory: a backend with one group for every worker (nccl) takes its rank from it.
    worker_index: int = 0
    # vLLM 0.33's deferred-processing contract: True for a backend whose `receive_weights` returns once the update is
    # queued rather than applied; it completes it in `finish_weight_update`, which rlserve's engine always calls, and
    # a caller that runs the update's tail itself calls `drain_pending` first. rlserve's own backends apply in place.
    defers_processing: ClassVar[bool] = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfigLike | Any | torch.device | str | None = None,
        device: torch.device | str | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        if device is None and isinstance(vllm_config, torch.device | str):  # the 0.24 call: (config, device)
            vllm_config, device = None, vllm_config
        elif isinstance(device, torch.nn.Module) and model is None:  # 0.24.0's (config, parallel_config, model)
            vllm_config, device, model = VllmConfigLike(vllm_config), current_device(), device
        if device is None:
            raise TypeError(f"{type(self).__name__}: `device` is required")
        self.config = config
        # vLLM's VllmConfig, or anything shaped like it (a framework's or a test's), is read as given
        self.vllm_config = VllmConfigLike() if vllm_config is None else vllm_config
        self.parallel_config = self.vllm_config.parallel_config
        self.model_config = self.vllm_config.model_config
        self.device = torch.device(device)
        self.model = self._default_model = model

    @classmethod
    def receives_into_model(cls) -> bool:
        """True for the 0.33 shape: `receive_weights(update_info)` loads into `self.model` itself."""
        return len(inspect.signature(cls.receive_weights).parameters) == 2

    def receive(self, update_info: TUpdateInfo, load_weights: LoadWeightsFn) -> None:
        """`receive_weights` in whichever shape the backend has."""
        if self.receives_into_model():
            self.receive_weights(update_info)  # type: ignore[call-arg]
        else:
            self.receive_weights(update_info, load_weights)

    def target_load_weights(self, load_weights: LoadWeightsFn | None) -> LoadWeightsFn:
        """For a backend in the 0.24 shape whose `receive_weights` takes `load_weights` optionally: the loader given
        (0.24's call), else the update target's `load_weights` (0.33's call, which SkyRL HEAD's worker extension
        makes after `set_weight_update_target`)."""
        if load_weights is not None:
            return load_weights
        if self.model is None:
            raise RuntimeError(
                f"{type(self).__name__}.receive_weights: no load_weights given and no model to load into "
                "(the engine gives one; set_weight_update_target sets another)"
            )
        return self.model.load_weights

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model, self.model_config = model, model_config

    def reset_weight_update_target(self) -> None:
        self.model, self.model_config = self._default_model, self.vllm_config.model_config

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

    def drain_pending(self) -> None:
        """Block until every deferred update is applied to the model (see `defers_processing`). Safe to call on any
        backend, any number of times: one that applies synchronously has nothing to drain."""

    def start_weight_update(self) -> None:
        """A weight update begins (vLLM 0.33's hook; its dense backends start a layerwise reload here)."""

    def finish_weight_update(self) -> None:
        """The weight update is complete (vLLM 0.33's hook)."""

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo, load_weights: LoadWeightsFn) -> None:
        """Receive the tensors described by `update_info` and load them: into `self.model` (0.33 shape, no
        `load_weights` parameter) or through `load_weights`, possibly in several calls (0.24 shape). Returns once
        every tensor is in; raises one of TRAINER_LOST if the trainer is gone or silent for longer than the backend
        waits."""

    def receive_sparse_weights(self, update_info: TUpdateInfo, apply_patches: Callable[..., None]) -> None:
        """vLLM 0.24's sparse receive on a dense backend: refused (rlserve's sparse updates are the `sparse_nccl`
        backend's, vLLM 0.33's form)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support sparse weight updates: use the sparse_nccl backend"
        )

    @staticmethod
    def trainer_send_sparse_weights(iterator: Iterator[Any], trainer_args: Any) -> None:
        """vLLM 0.24's trainer-side sparse send: refused, as `receive_sparse_weights` is."""
        raise NotImplementedError(
            "Sparse weight updates are not supported by this backend's 0.24 API: use the sparse_nccl backend's "
            "SparseNCCLTrainerWeightTransferEngine"
        )

    def discard_weights(self, update_info: TUpdateInfo) -> None:
        """Take delivery of the update described by `update_info` and drop it: called instead of `receive_weights`
        when the engine refused the update's metadata, so the trainer's send completes and the transport stays in
        step. This default receives into a loader that keeps nothing; a backend that writes the model other than
        through `load_weights` overrides it."""
        if not self.receives_into_model():
            self.receive_weights(update_info, lambda weights: None)
            return
        self.set_weight_update_target(_DiscardingModel(), self.model_config)
        try:
            self.receive_weights(update_info)  # type: ignore[call-arg]
        finally:
            self.reset_weight_update_target()

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
