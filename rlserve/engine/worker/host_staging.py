"""Pinned host memory for the copies of one step, in two halves that alternate between steps.

Every step moves a dozen small tensors to the GPU (inputs, block tables, sampling settings) and its results back.
Pinned memory makes those copies asynchronous, but allocating it per tensor goes through the caching host allocator,
which cannot hand out a block until the step that used it has finished, so with one step in flight it keeps
allocating more (cudaHostAlloc is slow and serialises with the device). A step instead takes slices of one half
of a preallocated buffer; the half is reused two launches later, after the step that used it has been read back.
"""

from __future__ import annotations

import math

import torch

_ALIGN = 64  # bytes: every slice starts aligned for any dtype


class HostStaging:
    def __init__(self, nbytes_per_step: int, device: torch.device, pin_memory: bool = True) -> None:
        self.device = device
        self.pin_memory = pin_memory  # off only where there is no accelerator (the allocator's own tests)
        self.halves = [torch.empty(nbytes_per_step, dtype=torch.uint8, pin_memory=pin_memory) for _ in range(2)]
        self.current = 0
        self.offset = 0

    def next_step(self) -> None:
        """Start a step's allocations in the other half. The caller guarantees that the step which last used it
        has been read back (so its copies are complete): the engine keeps at most one step in flight."""
        self.current ^= 1
        self.offset = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pinned host tensor valid until the step after next; fresh pinned memory if the half is full."""
        nbytes = dtype.itemsize * math.prod(shape)
        start = -(-self.offset // _ALIGN) * _ALIGN
        buffer = self.halves[self.current]
        if start + nbytes > buffer.numel():  # unusually large step (many prompt logprobs): correct, just slower
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
        self.offset = start + nbytes
        return buffer[start : start + nbytes].view(dtype).view(shape)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """An asynchronous copy of a (pageable) host tensor to the device, staged through pinned memory."""
        staged = self.empty(tuple(host.shape), host.dtype)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)

    def to_host(self, device_tensor: torch.Tensor) -> torch.Tensor:
        """Start copying a device tensor back; its values are valid once the step's completion event has fired."""
        host = self.empty(tuple(device_tensor.shape), device_tensor.dtype)
        host.copy_(device_tensor, non_blocking=True)
        return host
