"""vLLM's worker surface for user code: the methods of a `worker_extension_cls` and functions passed to
`collective_rpc` run on the engine's worker and see it as vLLM code expects (`self.model_runner.model.load_weights`,
`self.device`, `self.rank`, `self.vllm_config`, `self.weight_transfer_engine`), so weight-sync extensions written for
vLLM (PipelineRL's, OpenRLHF's, SkyRL's `NewInferenceWorkerWrap`) run unchanged."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlserve.config import EngineConfig
from rlserve.engine.worker.model_runner import ModelRunner
from rlserve.vllm_surface import ENV_VAR, install_if_requested

if TYPE_CHECKING:
    from rlserve.weight_transfer.base import WeightTransferEngine


class TransferHolder(Protocol):
    """What holds a rank's weight-transfer backend: the core's weight control (rank 0), a follower (the others).
    `transfer` is None until the trainer's init_weight_transfer_engine, and replaced by a later one."""

    transfer: WeightTransferEngine | None


class Worker:
    """One worker per tensor-parallel rank of an engine core: rank 0's in the core's own process, the others' in
    theirs (rlserve.engine.worker.tp_workers). `rank` is, as in vLLM, the rank among the workers of its data-parallel
    rank: the tensor-parallel rank (no pipeline parallelism)."""

    rank = 0
    local_rank = 0
    vllm_config: EngineConfig
    model_runner: ModelRunner
    device: torch.device

    def __init__(self, *, vllm_config: EngineConfig, model_runner: ModelRunner, transfers: TransferHolder) -> None:
        """Keywords only, as vLLM builds its workers: an extension's `__new__` reads them (verl's reads
        `vllm_config`). `vllm_config`: vLLM's `worker.vllm_config`, which extensions hand back to vLLM functions
        (`set_current_vllm_config`): the engine's config."""
        self.vllm_config = vllm_config
        self.model_runner = model_runner
        self.device = model_runner.device
        self._transfers = transfers

    @property
    def model_config(self) -> EngineConfig:
        """vLLM's `worker.model_config` (what `finalize_layerwise_reload` and `set_weight_update_target` take): the
        engine's config, which holds rlserve's model settings."""
        return self.model_runner.config

    @property
    def weight_transfer_engine(self) -> WeightTransferEngine | None:
        """vLLM's: this rank's weight-transfer backend (`parse_update_info`, `receive_weights`,
        `set_weight_update_target`...), the one the trainer's init_weight_transfer_engine joined; None before."""
        return self._transfers.transfer


def import_class(path: str) -> type:
    """A class from "package.module:Class" or "package.module.Class"."""
    module_path, sep, name = path.partition(":")
    if not sep:
        module_path, _, name = path.rpartition(".")
    if not module_path or not name:
        raise ValueError(f"worker_extension_cls: expected 'package.module:Class', got {path!r}")
    surface = install_if_requested()  # before the import: extensions written for vLLM import vllm
    try:
        cls = getattr(importlib.import_module(module_path), name)
    except (ImportError, AttributeError) as e:
        hint = "" if surface or getattr(e, "name", None) != "vllm" else f" (set {ENV_VAR}=1 to resolve vllm to rlserve)"
        raise ValueError(f"worker_extension_cls: cannot import {path!r}: {e}{hint}") from e
    if not isinstance(cls, type):
        raise ValueError(f"worker_extension_cls: {path!r} is not a class")
    return cls


def make_worker(runner: ModelRunner, extension_cls: str | None, transfers: TransferHolder) -> Worker:
    """The engine's worker, with the extension's methods mixed in (as vLLM does; a name both define is an error)."""
    kwargs = {"vllm_config": runner.config, "model_runner": runner, "transfers": transfers}
    if extension_cls is None:
        return Worker(**kwargs)
    extension = import_class(extension_cls)
    worker_names = set(vars(Worker)) | set(Worker.__annotations__)
    clashes = sorted(n for n in vars(extension) if not n.startswith("__") and n in worker_names)
    if clashes:
        raise ValueError(f"worker_extension_cls: {extension.__name__} redefines worker attributes {clashes}")
    cls = type(f"WorkerWith{extension.__name__}", (Worker, extension), {})
    return cls(**kwargs)


def extension_methods(worker: Worker) -> set[str]:
    """The public methods a worker's extension defines: what `/collective_rpc` may call over HTTP."""
    names: set[str] = set()
    for base in type(worker).__mro__:
        if base in (Worker, object) or base is type(worker):
            continue
        names |= {n for n, v in vars(base).items() if callable(v) and not n.startswith("_")}
    return names


def call(worker: Worker, method: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Run `method` (a worker method's name, or a function taking the worker first) on the worker."""
    if isinstance(method, str):
        fn = getattr(worker, method, None)
        if not callable(fn):
            raise ValueError(f"method: the worker has no method {method!r}")
        return fn(*args, **kwargs)
    if not callable(method):
        raise ValueError(f"method: expected a method name or a callable, got {type(method).__name__}")
    return method(worker, *args, **kwargs)
