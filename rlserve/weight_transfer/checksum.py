"""SHA-256 of weights, to check that what the engine holds is exactly what the trainer sent."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from rlserve.dtypes import dtype_name


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Hex SHA-256 of a tensor's dtype, shape and raw bytes (of its contiguous CPU copy): equal digests mean equal
    tensors bit for bit, including NaN payloads and -0.0, and a reinterpretation (same bytes, another dtype or shape)
    does not collide."""
    t = tensor.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{dtype_name(t.dtype)}|{tuple(t.shape)}|".encode())
    # A uint8 view rather than numpy on the tensor itself: numpy has no bfloat16.
    digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def weight_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {name: tensor_sha256(tensor) for name, tensor in named_tensors}


def compare_checksums(expected: Mapping[str, str], actual: Mapping[str, str]) -> dict[str, Any]:
    """`match` is True when both have the same names and every digest agrees."""
    mismatches = sorted(name for name in expected.keys() & actual.keys() if expected[name] != actual[name])
    missing = sorted(expected.keys() - actual.keys())
    unexpected = sorted(actual.keys() - expected.keys())
    return {
        "match": not (mismatches or missing or unexpected),
        "mismatches": mismatches,
        "missing": missing,
        "unexpected": unexpected,
    }
