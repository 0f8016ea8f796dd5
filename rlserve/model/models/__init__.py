"""Supported architectures. Llama, Qwen2 and Qwen3 are one decoder with different switches."""

from rlserve.model.models.llama import DecoderForCausalLM, DecoderSpec, spec_from_hf_config

# Each architecture with its Hugging Face model type (the key of its configuration class).
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

__all__ = ["SUPPORTED_ARCHITECTURES", "DecoderForCausalLM", "DecoderSpec", "spec_from_hf_config"]
