"""vLLM's collective_rpc on the engine core: a method of the worker extension (or a function, from a front end in
this process) run on every tensor-parallel rank's worker between steps."""

from __future__ import annotations

from typing import Any

from rlserve.engine.core.data_plane import DataPlane
from rlserve.engine.core.weights import WeightControl
from rlserve.engine.wire.call_policy import check_rpc_method
from rlserve.engine.wire.messages import ENGINE_RPC_METHODS
from rlserve.engine.worker.extension import call as call_worker
from rlserve.engine.worker.extension import extension_methods, make_worker


class WorkerRPC:
    def __init__(self, plane: DataPlane, weights: WeightControl) -> None:
        self.plane = plane
        self.worker = make_worker(plane.runner, plane.config.worker_extension_cls, weights)  # rank 0's
        # vLLM's own worker methods (ENGINE_RPC_METHODS) are the weights' methods of the same names.
        self.engine_methods = {name: getattr(weights, name) for name in ENGINE_RPC_METHODS}

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's collective_rpc: run `method` on every worker (one per tensor-parallel rank) between steps; one
        result per worker, in rank order. What it changes behind the engine's back (weights, say) is its own affair:
        a method that writes weights should be followed by reset_prefix_cache, as in vLLM. vLLM's own worker methods
        `update_config`, `reload_weights` and `reset_weights` run on the core, which keeps its bookkeeping of the
        weights right (and reaches every rank through its loader)."""
        self.plane.drain()
        if isinstance(method, str):  # a function comes only from a front end in this process, which owns it
            check_rpc_method(method, extension_methods(self.worker))
            if method in ENGINE_RPC_METHODS:
                return [self.engine_methods[method](*args, **(kwargs or {}))]
        args, kwargs = tuple(args), dict(kwargs or {})
        runner = self.plane.runner
        with runner.on_device(), runner.mirrored("collective_rpc", method, args, kwargs) as others:
            mine = call_worker(self.worker, method, args, kwargs)
        return [mine, *others]
