"""LoRA adapters: the request that names one (vLLM's LoRARequest) and the PEFT directory format they are read from.
The math lives with the layers (rlserve.model.lora); the slots and their bookkeeping with the engine."""

from rlserve.lora.peft import SUPPORTED_TARGET_MODULES, PEFTAdapter, load_peft_adapter
from rlserve.lora.request import LoRARequest

__all__ = ["SUPPORTED_TARGET_MODULES", "LoRARequest", "PEFTAdapter", "load_peft_adapter"]
