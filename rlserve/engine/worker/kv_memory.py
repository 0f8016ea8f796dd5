"""Memory for the KV cache."""

from __future__ import annotations

import math
import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. On the CPU in fresh anonymous memory, which the kernel zeroes page by page on first touch:
    torch.zeros wrote all of the default 1 GiB at every start (0.4 s idle, seconds on a busy machine) and held it
    resident, where only the blocks in use need be."""
    if device.type != "cpu" or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)  # the tensor keeps it alive
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
