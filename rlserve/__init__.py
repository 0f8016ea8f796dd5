"""rlserve: an LLM inference engine for reinforcement-learning post-training."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"  # the one source of the version: pyproject reads it, and a source tree without install has it

# The public names and their modules, imported on first access: a trainer that imports only `rlserve.rl.client`
# (httpx) must not pay for torch and the engine, which `rlserve.engine.frontend.llm` pulls in.
_EXPORTS = {
    "LLM": "rlserve.engine.frontend.llm",
    "AsyncLLM": "rlserve.engine.frontend.async_llm",
    "AsyncEngineArgs": "rlserve.engine.frontend.args",
    "EngineArgs": "rlserve.engine.frontend.args",
    "CompletionOutput": "rlserve.outputs",
    "EngineConfig": "rlserve.config",
    "Logprob": "rlserve.outputs",
    "LoRARequest": "rlserve.lora.request",
    "ProfilerConfig": "rlserve.config",
    "RequestOutput": "rlserve.outputs",
    "RequestOutputKind": "rlserve.sampling_params",
    "RetryableRequestError": "rlserve.engine.frontend.core_client",
    "SamplingParams": "rlserve.sampling_params",
    "WeightTransferConfig": "rlserve.config",
    "WeightTransferInitRequest": "rlserve.weight_transfer.base",
    "WeightTransferUpdateRequest": "rlserve.weight_transfer.base",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
