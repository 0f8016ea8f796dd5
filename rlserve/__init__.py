"""rlserve: an LLM inference engine for reinforcement-learning post-training."""

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
