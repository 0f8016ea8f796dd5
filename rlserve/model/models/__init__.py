"""Supported architectures. Llama, Qwen2 and Qwen3 are one decoder with different switches; Qwen3-MoE is that decoder
with sparse MoE layers."""

from rlserve.model.models.llama import DecoderForCausalLM, DecoderSpec, spec_from_hf_config
from rlserve.model.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
# Each architecture with its Hugging Face model type (the key of its configuration class).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

__all__ = ["MODEL_CLASSES", "SUPPORTED_ARCHITECTURES", "DecoderForCausalLM", "DecoderSpec", "spec_from_hf_config"]
