"""Name -> backend registry. Backends are imported only when first used, so an unused backend costs nothing."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

import torch

from rlserve.config import WeightTransferConfig
from rlserve.weight_transfer.base import ParallelConfigLike, VllmConfigLike, WeightTransferEngine, current_device
from rlserve.weight_transfer.source import WeightSource
from rlserve.weight_transfer.trainer import TrainerInitInfo, TrainerWeightTransferEngine, VLLMWeightSyncClient

EngineLoader = Callable[[], type[WeightTransferEngine]]
SCRIPT_MODULE_PREFIX = "_rlserve_script_"  # the module names of backends loaded from a script's path


def _import_module(module_path: str) -> ModuleType:
    """A module by dotted name, or a script by file path (a backend defined in the script that created the engine,
    loaded in the engine-core process: its `if __name__ == "__main__"` block does not run there)."""
    if not module_path.endswith(".py"):
        return importlib.import_module(module_path)
    name = f"{SCRIPT_MODULE_PREFIX}{abs(hash(module_path))}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, module_path)
        if spec is None or spec.loader is None:
            raise ValueError(f"weight transfer backend: cannot load {module_path!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _lazy_loader(module_path: str, class_name: str, base: type = WeightTransferEngine) -> Callable[[], Any]:
    def load() -> type:
        cls = getattr(_import_module(module_path), class_name)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"{module_path}.{class_name} is not a {base.__name__} subclass")
        return cls

    return load


class WeightTransferEngineFactory:
    """Class-level registry, as in vLLM: `register_engine` from anywhere, then `create_engine` by config."""

    _registry: ClassVar[dict[str, EngineLoader]] = {}

    @classmethod
    def register_engine(
        cls,
        name: str,
        module_path_or_cls: str | type[WeightTransferEngine],
        class_name: str | None = None,
    ) -> None:
        """Register `name` as a class, as `"module.path"` + `class_name`, or as `"module.path:ClassName"`."""
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine {name!r} is already registered")
        if isinstance(module_path_or_cls, str):
            module_path = module_path_or_cls
            if class_name is None:
                module_path, sep, class_name = module_path.partition(":")
                if not sep or not class_name:
                    raise ValueError(
                        f"register_engine({name!r}, {module_path_or_cls!r}) needs a class: pass class_name "
                        "or use the 'module.path:ClassName' form"
                    )
            cls._registry[name] = _lazy_loader(module_path, class_name)
        elif isinstance(module_path_or_cls, type) and issubclass(module_path_or_cls, WeightTransferEngine):
            if class_name is not None:
                raise ValueError("class_name is only used with a module path")
            engine_cls = module_path_or_cls
            cls._registry[name] = lambda: engine_cls
        else:
            raise TypeError(f"expected a WeightTransferEngine subclass or a module path, got {module_path_or_cls!r}")

    @classmethod
    def available_engines(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def get_engine_cls(cls, name: str) -> type[WeightTransferEngine]:
        loader = cls._registry.get(name)
        if loader is None and ":" in name:  # "package.module:Class", loaded where the engine runs
            module_path, _, class_name = name.rpartition(":")
            loader = _lazy_loader(module_path, class_name)
        if loader is None:
            raise ValueError(
                f"Invalid weight transfer backend: {name}. Available engines: {cls.available_engines()}. A backend "
                "of your own: name it WeightTransferConfig(backend='package.module:Class'), or register it before "
                "creating the engine (the engine core runs in its own process and loads it there)"
            )
        return loader()

    @classmethod
    def create_engine(
        cls,
        config: WeightTransferConfig,
        device: torch.device | str | Any,
        worker_index: int | torch.device | str = 0,
        timeout_s: float | torch.nn.Module | None = None,
        model: torch.nn.Module | None = None,
        model_config: Any = None,
    ) -> WeightTransferEngine:
        """The backend for the worker `worker_index` of the engine (vLLM's dp_rank * tensor_parallel_size + tp_rank).
        A vLLM 0.33-shaped backend (a constructor parameter named `model`) is built as `(config, vllm_config, device,
        model)` with a `VllmConfigLike` placing it at `worker_index`; a 0.24-shaped one as `(config, device)`.
        `timeout_s`: how long the backend may wait for the trainer (EngineConfig.weight_transfer_timeout_s), given to
        a backend whose constructor takes a `timeout_s` keyword; others keep their own.

        vLLM's own calls are accepted too (a second argument that is not a device): 0.33's `create_engine(config,
        vllm_config, device, model)` and 0.24's `create_engine(config, parallel_config, model)` (on this process's
        current device); the worker's place is then read from the parallel config."""
        vllm_config: Any = None
        if not isinstance(device, torch.device | str):
            if hasattr(device, "parallel_config"):
                vllm_config, device, model = device, worker_index, timeout_s
            else:
                vllm_config, device, model = VllmConfigLike(device), current_device(), worker_index
            parallel = vllm_config.parallel_config
            worker_index, timeout_s = parallel.data_parallel_index * parallel.world_size + parallel.rank, None
        engine_cls = cls.get_engine_cls(config.backend)
        parameters = inspect.signature(engine_cls).parameters
        kwargs = {"timeout_s": timeout_s} if timeout_s is not None and "timeout_s" in parameters else {}
        if "model" in parameters:
            if vllm_config is None:
                vllm_config = VllmConfigLike(ParallelConfigLike(data_parallel_index=worker_index), model_config)
            engine = engine_cls(config, vllm_config, torch.device(device), model, **kwargs)
        else:
            engine = engine_cls(config, torch.device(device), **kwargs)
        engine.worker_index = worker_index  # set here, not passed: backends' constructors keep vLLM's signature
        return engine


class WeightTransferTrainerFactory:
    """The trainer side's registry, kept apart from the engine's as in vLLM 0.33 (the trainer never builds an engine
    backend and vice versa). `trainer_init` dispatches on `init_info.backend`."""

    _registry: ClassVar[dict[str, Callable[[], type[TrainerWeightTransferEngine]]]] = {}

    @classmethod
    def register_engine(
        cls, name: str, module_path_or_cls: str | type[TrainerWeightTransferEngine], class_name: str | None = None
    ) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer trainer engine {name!r} is already registered")
        if isinstance(module_path_or_cls, str):
            if class_name is None:
                raise ValueError(f"register_engine({name!r}, {module_path_or_cls!r}) needs class_name")
            cls._registry[name] = _lazy_loader(module_path_or_cls, class_name, TrainerWeightTransferEngine)
        elif isinstance(module_path_or_cls, type) and issubclass(module_path_or_cls, TrainerWeightTransferEngine):
            engine_cls = module_path_or_cls
            cls._registry[name] = lambda: engine_cls
        else:
            raise TypeError(
                f"expected a TrainerWeightTransferEngine subclass or a module path, got {module_path_or_cls!r}"
            )

    @classmethod
    def trainer_init(
        cls, init_info: TrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> TrainerWeightTransferEngine:
        """A rendezvoused, ready-to-send trainer engine for `init_info.backend`; called on every trainer rank."""
        loader = cls._registry.get(init_info.backend)
        if loader is None:
            raise ValueError(
                f"Invalid weight transfer backend: {init_info.backend}. Available trainer engines: "
                f"{sorted(cls._registry)}"
            )
        return loader().trainer_init(init_info, client=client, source=source)


WeightTransferEngineFactory.register_engine("nccl", "rlserve.weight_transfer.nccl", "NCCLWeightTransferEngine")
WeightTransferEngineFactory.register_engine("ipc", "rlserve.weight_transfer.ipc", "IPCWeightTransferEngine")
WeightTransferEngineFactory.register_engine(
    "sparse_nccl", "rlserve.weight_transfer.sparse_nccl", "SparseNCCLWeightTransferEngine"
)
# ModelExpress's backend (its own package; vLLM registers it the same way): imported only when asked for.
WeightTransferEngineFactory.register_engine(
    "modelexpress", "rlserve.distributed.weight_transfer.modelexpress_engine", "ModelExpressWeightTransferEngine"
)
# The receivers of prime-rl's and PipelineRL's trainers (their framework routes name them).
WeightTransferEngineFactory.register_engine(
    "prime_rl", "rlserve.weight_transfer.framework_backends", "PrimeRLBroadcastEngine"
)
WeightTransferEngineFactory.register_engine(
    "pipelinerl", "rlserve.weight_transfer.framework_backends", "PipelineRLBroadcastEngine"
)

WeightTransferTrainerFactory.register_engine(
    "nccl", "rlserve.weight_transfer.nccl_trainer", "NCCLTrainerWeightTransferEngine"
)
WeightTransferTrainerFactory.register_engine("ipc", "rlserve.weight_transfer.ipc", "IPCTrainerWeightTransferEngine")
WeightTransferTrainerFactory.register_engine(
    "sparse_nccl", "rlserve.weight_transfer.sparse_nccl", "SparseNCCLTrainerWeightTransferEngine"
)
