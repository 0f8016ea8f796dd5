"""Which LoRA adapters the engine holds, in which slot, at which version; the core's side of add_lora, remove_lora,
list_loras and of a request that names an adapter."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Protocol

from rlserve.lora.peft import PEFTAdapter, load_peft_adapter
from rlserve.lora.request import LoRARequest


class LoRASlotWriter(Protocol):
    """The model runner's adapter slots (ModelRunner.load_lora / clear_lora)."""

    def load_lora(self, slot: int, adapter: PEFTAdapter) -> None: ...

    def clear_lora(self, slot: int) -> None: ...


@dataclass(frozen=True)
class LoadedLoRA:
    request: LoRARequest  # the one it was last loaded by (its path is where a reload reads)
    slot: int
    version: int  # unique to this load: the prefix cache keys KV by it


class LoRAManager:
    def __init__(self, slots: LoRASlotWriter, max_loras: int, max_lora_rank: int) -> None:
        self.slots = slots
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.loaded: dict[int, LoadedLoRA] = {}  # by lora_int_id
        self._versions = itertools.count(1)

    def add(self, request: LoRARequest) -> LoadedLoRA:
        """Load the adapter unless it is loaded under this id already; `load_inplace` reloads it into its slot (what
        runs with it from then on uses the new weights). A refused load changes nothing."""
        current = self._check_names(request)
        if current is not None and not request.load_inplace:
            return current
        adapter = load_peft_adapter(request.lora_path, self.max_lora_rank)
        if current is None and len(self.loaded) >= self.max_loras:
            raise ValueError(
                f"max_loras: {self.max_loras} adapters are loaded already (ids {sorted(self.loaded)}); remove one "
                f"(remove_lora) before loading {request.lora_name!r}, or start the engine with a larger max_loras"
            )
        slot = current.slot if current is not None else min(set(range(self.max_loras)) - self._used_slots())
        self.slots.load_lora(slot, adapter)
        loaded = self.loaded[request.lora_int_id] = LoadedLoRA(request, slot, next(self._versions))
        return loaded

    def get(self, request: LoRARequest) -> LoadedLoRA:
        """The adapter a new request runs with, loaded first if it is not (vLLM does); never reloaded here (a
        front end sends add_lora once for a `load_inplace` request, not once per sample)."""
        current = self._check_names(request)
        return current if current is not None else self.add(replace(request, load_inplace=False))

    def remove(self, lora_id: int, num_users: int) -> bool:
        """Unload adapter `lora_id` (False if it is not loaded); refused while `num_users` requests use it."""
        current = self.loaded.get(lora_id)
        if current is None:
            return False
        if num_users:
            raise ValueError(
                f"lora_id: adapter {current.request.lora_name!r} (id {lora_id}) is used by {num_users} running or "
                "waiting requests; remove it once they finish (or abort them)"
            )
        del self.loaded[lora_id]
        self.slots.clear_lora(current.slot)
        return True

    def ids(self) -> set[int]:
        return set(self.loaded)

    def _used_slots(self) -> set[int]:
        return {loaded.slot for loaded in self.loaded.values()}

    def _check_names(self, request: LoRARequest) -> LoadedLoRA | None:
        """The adapter loaded under the request's id, if any; one id has one name and one name one id."""
        current = self.loaded.get(request.lora_int_id)
        if current is not None and current.request.lora_name != request.lora_name:
            raise ValueError(
                f"lora_int_id: {request.lora_int_id} is loaded as adapter {current.request.lora_name!r}, not "
                f"{request.lora_name!r}"
            )
        for lora_id, loaded in self.loaded.items():
            if loaded.request.lora_name == request.lora_name and lora_id != request.lora_int_id:
                raise ValueError(
                    f"lora_name: adapter {request.lora_name!r} is loaded with lora_int_id {lora_id}, not "
                    f"{request.lora_int_id}"
                )
        return current
