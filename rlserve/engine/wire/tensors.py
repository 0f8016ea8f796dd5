"""(name, tensor) pairs as plain data, for weights that a front end sends to a core in another process (no pickle)."""

from __future__ import annotations

import torch

from rlserve.dtypes import dtype_from_name


def pack_tensors(weights) -> list[list]:
    """(name, tensor) pairs as plain data: [name, dtype name, shape, raw bytes] (no pickle)."""
    packed = []
    for name, tensor in weights:
        t = tensor.detach().to("cpu").contiguous()
        packed.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()])
    return packed


def unpack_tensors(packed: list[list]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, dtype, shape, data in packed:
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out.append((name, flat.view(dtype_from_name(dtype)).reshape(shape)))
    return out
