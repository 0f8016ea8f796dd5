"""A worker extension as vLLM RL frameworks write them (PipelineRL's and OpenRLHF's have this shape), for the tests
of `worker_extension_cls` and `collective_rpc`: its methods run on the engine's worker, `self` being that worker."""

from __future__ import annotations

import time

from safetensors.torch import load_file


class CheckpointLoader:
    def load_checkpoint(self, path: str) -> int:
        """Write a safetensors checkpoint into the live model through vLLM's worker surface."""
        weights = load_file(path, device=str(self.device))
        self.model_runner.model.load_weights(weights.items())
        return len(weights)

    def describe(self) -> dict:
        return {"rank": self.rank, "local_rank": self.local_rank, "device": str(self.device)}

    def transfer_backend(self) -> str | None:
        """The class of this rank's weight-transfer backend, as vLLM code reads it (`self.weight_transfer_engine`)."""
        engine = self.weight_transfer_engine
        return None if engine is None else type(engine).__name__

    def nap(self, seconds: float) -> float:
        """Hold the engine core for `seconds`, as a slow extension method does."""
        time.sleep(seconds)
        return seconds

    def first_weights(self, count: int):
        """A tensor, as an extension that reports weights returns it (msgspec cannot encode one)."""
        return next(iter(self.model_runner.model.parameters())).detach().flatten()[:count]

    def opaque(self) -> object:
        return object()

    def lookup(self, key: str) -> str:
        return {}[key]  # a KeyError: neither a ValueError nor a RuntimeError

    def fail(self) -> None:
        raise ValueError("value: the extension refused")

    def break_forward(self) -> None:
        """Make every later forward pass raise, as a device fault would."""

        def broken(*args, **kwargs):
            raise RuntimeError("injected fault")

        self.model_runner.model.forward = broken


class ClashingExtension:
    def device(self) -> None:  # the worker's own attribute
        pass
