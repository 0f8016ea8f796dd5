"""What a caller may ask of the engine by name: checked by the HTTP routes (which turn the errors into 400 and 403
answers) and again by the engine core, whatever front end the call came through (defence in depth: a core's socket
is private, and were it reached anyway, it still refuses what the server would)."""

from __future__ import annotations

import os
from collections.abc import Collection

from rlserve.engine.wire.messages import ENGINE_RPC_METHODS


def check_rpc_method(method: str, extension_methods: Collection[str]) -> None:
    """collective_rpc by name reaches the public methods of the worker extension and vLLM's own engine methods,
    never the worker's other attributes (`__init__`, `model_runner`): a ValueError naming `method` otherwise."""
    allowed = set(extension_methods) | set(ENGINE_RPC_METHODS)
    if method not in allowed:
        raise ValueError(f"method: {method!r} is not a method of the worker extension (callable: {sorted(allowed)})")


def confined_weight_dir(weight_dir: str, allowed: Collection[str], param: str = "weight_dir") -> str:
    """The real path of `weight_dir` if it is a directory under one the operator allowed (--allowed-weight-dirs);
    links are resolved first, so none leads out of them. PermissionError (HTTP 403) naming `param` otherwise, one
    message for a directory that is missing and one that is not allowed, so that a caller cannot probe which
    directories exist; ValueError (400) for a path no file system holds."""
    if "\0" in weight_dir:  # no path holds one (os.path raises ValueError)
        raise ValueError(f"{param}: holds a NUL character")
    real = os.path.realpath(weight_dir)
    roots = [os.path.realpath(a) for a in allowed]
    if not any(os.path.commonpath([real, root]) == root for root in roots) or not os.path.isdir(real):
        raise PermissionError(
            f"{param}: {weight_dir!r} is not a directory under an allowed one (--allowed-weight-dirs)"
        )
    return real
