"""vLLM's add_lora / remove_lora / list_loras on the engine core, over the adapters its LoRAManager holds (None
without enable_lora: every call is refused, naming the flag)."""

from __future__ import annotations

from rlserve.engine.core.data_plane import DataPlane
from rlserve.engine.core.lora_manager import LoRAManager
from rlserve.lora.request import LoRARequest


class LoRAControl:
    def __init__(self, plane: DataPlane, manager: LoRAManager | None) -> None:
        self.plane = plane
        self.manager = manager

    def require(self, field: str) -> LoRAManager:
        """The manager, or a ValueError naming `field` when the engine runs without adapters."""
        if self.manager is None:
            raise ValueError(f"{field}: not supported without enable_lora (start the engine with enable_lora)")
        return self.manager

    def add_lora(self, lora_request: LoRARequest | dict) -> bool:
        """Load an adapter (a no-op if loaded under the same id, unless `load_inplace`, which reloads it)."""
        request = LoRARequest.of(lora_request)
        manager = self.require("lora_request")
        self.plane.drain()  # an in-place reload writes slots that the step in flight may read
        manager.add(request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter (False if not loaded); requests already running with it finish with it."""
        return self.require("lora_id").remove(lora_id)

    def list_loras(self) -> set[int]:
        return self.require("list_loras").ids()
