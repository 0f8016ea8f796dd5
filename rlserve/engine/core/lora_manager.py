"""Which LoRA adapters the engine holds, in which slot, at which version; the core's side of add_lora, remove_lora,
list_loras and of a request that names an adapter."""

from __future__ import annotations

import itertools
from collections import Counter
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
        self.users: Counter[int] = Counter()  # requests running or waiting with each slot
        # Slots of removed adapters that requests still use: freed when the last of them finishes.
        self.retiring: set[int] = set()
        self._versions = itertools.count(1)

    def add(self, request: LoRARequest) -> LoadedLoRA:
        """Load the adapter unless it is loaded under this id already; `load_inplace` reloads it into its slot (what
        runs with it from then on uses the new weights). A refused load changes nothing."""
        current = self._check_names(request)
        if current is not None and not request.load_inplace:
            return current
        adapter = load_peft_adapter(request.lora_path, self.max_lora_rank)
        free = set(range(self.max_loras)) - self._used_slots() - self.retiring
        if current is None and not free:
            retiring = f", and {len(self.retiring)} removed ones still finish requests" if self.retiring else ""
            raise ValueError(
                f"max_loras: all {self.max_loras} adapter slots are taken (loaded ids {sorted(self.loaded)}{retiring});"
                f" remove one (remove_lora) before loading {request.lora_name!r}, or start the engine with a larger "
                "max_loras"
            )
        slot = current.slot if current is not None else min(free)
        self.slots.load_lora(slot, adapter)
        loaded = self.loaded[request.lora_int_id] = LoadedLoRA(request, slot, next(self._versions))
        return loaded

    def get(self, request: LoRARequest) -> LoadedLoRA:
        """The adapter a new request runs with, loaded first if it is not (vLLM does); never reloaded here (a
        front end sends add_lora once for a `load_inplace` request, not once per sample). The request counts as a
        user of the adapter's slot until `release`."""
        current = self._check_names(request)
        loaded = current if current is not None else self.add(replace(request, load_inplace=False))
        self.users[loaded.slot] += 1
        return loaded

    def release(self, slot: int) -> None:
        """A request that ran with `slot` finished; the last user of a removed adapter frees its slot."""
        self.users[slot] -= 1
        if self.users[slot] == 0:
            del self.users[slot]
            if slot in self.retiring:
                self.retiring.discard(slot)
                self.slots.clear_lora(slot)

    def remove(self, lora_id: int) -> bool:
        """Unload adapter `lora_id` (False if it is not loaded). New requests no longer find it at once; requests
        already running or waiting with it finish with it, and its slot is freed after the last of them."""
        current = self.loaded.pop(lora_id, None)
        if current is None:
            return False
        if self.users[current.slot]:
            self.retiring.add(current.slot)
        else:
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
