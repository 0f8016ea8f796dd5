"""Weight-transfer backends that a caller registered by class, as import paths another process can load: the engine
core's (started by a front end) and each tensor-parallel rank's register them again, so a backend registered before
the engine was created works as in one process."""

from __future__ import annotations

import os
import sys

from rlserve.config import EngineConfig


def registered_backends(config: EngineConfig) -> dict[str, str]:
    """The configured weight-transfer backend as an import path the core process (or a tensor-parallel rank's) can
    load, when the caller registered it by class (the registry of this process is not the core's)."""
    from rlserve.weight_transfer import WeightTransferEngineFactory
    from rlserve.weight_transfer.factory import SCRIPT_MODULE_PREFIX

    wt = config.weight_transfer_config
    if wt is None or wt.backend in ("nccl", "ipc") or ":" in wt.backend:
        return {}
    try:
        cls = WeightTransferEngineFactory.get_engine_cls(wt.backend)
    except ValueError:
        return {}  # the core reports the unknown name, with the fix
    if "<locals>" in cls.__qualname__:
        return {}  # defined inside a function: nothing another process can import (the core names the fix)
    module = sys.modules.get(cls.__module__)
    from_script = cls.__module__ in ("__main__", "__mp_main__") or cls.__module__.startswith(SCRIPT_MODULE_PREFIX)
    if from_script and getattr(module, "__file__", None):
        return {wt.backend: f"{os.path.abspath(module.__file__)}:{cls.__qualname__}"}
    return {wt.backend: f"{cls.__module__}:{cls.__qualname__}"}
