"""rlserve: an LLM inference engine for reinforcement-learning post-training."""

__version__ = "0.1.0"  # the one source of the version: pyproject reads it, and a source tree without install has it

from rlserve.config import EngineConfig, WeightTransferConfig
from rlserve.engine.llm import LLM
from rlserve.outputs import CompletionOutput, Logprob, RequestOutput
from rlserve.sampling_params import RequestOutputKind, SamplingParams
from rlserve.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "WeightTransferConfig",
    "WeightTransferInitRequest",
    "WeightTransferUpdateRequest",
]
