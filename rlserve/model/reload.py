"""vLLM's layerwise reload (`vllm.model_executor.model_loader.reload`) on rlserve's models, for worker extensions that
bracket a weight update with it: SkyRL's `NewInferenceWorkerWrap` calls `initialize_layerwise_reload(model)` before the
first chunk of an update and `finalize_layerwise_reload(model, model_config)` after the last.

vLLM moves each layer to the meta device at the start, loads what arrives, and at the end puts back the layers the
update did not cover and runs every layer's post-load processing (repacking quantized weights, say). rlserve's models
are written in place, tensor by tensor, each checked against the model before it is written (`load_weights`): a layer
the update does not cover keeps its weights, as vLLM's end leaves it, and FP8 projections are quantized as they are
written. What remains for the end is what rlserve derives from the weights (the fp32 copy of the LM head): dropped, to
be rebuilt from the new weights when next used.
"""

from __future__ import annotations

from typing import Any

from rlserve.config import EngineConfig
from rlserve.model.models.llama import DecoderForCausalLM


def _check_model(model: Any, function: str) -> DecoderForCausalLM:
    if not isinstance(model, DecoderForCausalLM):
        raise TypeError(f"{function}: model: expected the worker's model (model_runner.model), got {type(model)!r}")
    return model


def initialize_layerwise_reload(model: DecoderForCausalLM) -> None:
    """Nothing moves: rlserve writes the weights in place as they arrive (see the module's docstring)."""
    _check_model(model, "initialize_layerwise_reload")


def finalize_layerwise_reload(model: DecoderForCausalLM, model_config: EngineConfig) -> None:
    """The end of an update: what is derived from the weights is rebuilt from the new ones."""
    if not isinstance(model_config, EngineConfig):
        raise TypeError(
            f"finalize_layerwise_reload: model_config: expected the worker's model_config, got {type(model_config)!r}"
        )
    _check_model(model, "finalize_layerwise_reload").drop_derived_weights()
