"""vLLM's LoRARequest: which adapter a request runs with, and where its weights are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """An adapter by name and id (vLLM's fields and semantics). `lora_int_id` (>= 1) is the adapter's id in the
    engine; `lora_path` the PEFT directory it is (re)loaded from; `load_inplace` reloads an adapter already loaded
    under the same id (an RL trainer re-saves it after each optimizer step). Equal, and hashed, by `lora_name`."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name: must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path: must be a non-empty string, got {self.lora_path!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name: must be a string or None, got {self.base_model_name!r}")
        if not isinstance(self.load_inplace, bool):
            raise ValueError(f"load_inplace: must be a bool, got {self.load_inplace!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @classmethod
    def of(cls, value: LoRARequest | dict[str, Any]) -> LoRARequest:
        """A LoRARequest from itself or its fields as a dict (how a control call's untyped arguments carry it across
        processes); anything else is refused by name."""
        if isinstance(value, LoRARequest):
            return value
        if isinstance(value, dict):
            try:
                return cls(**value)
            except TypeError as e:
                raise ValueError(f"lora_request: {e}") from None
        raise ValueError(f"lora_request: expected a LoRARequest, got {type(value).__name__}")
