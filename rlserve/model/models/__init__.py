"""Supported architectures. Llama, Qwen2 and Qwen3 are one decoder with different switches."""

from rlserve.model.models.llama import DecoderForCausalLM, DecoderSpec, spec_from_hf_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

__all__ = ["SUPPORTED_ARCHITECTURES", "DecoderForCausalLM", "DecoderSpec", "spec_from_hf_config"]
