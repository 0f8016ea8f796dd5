"""The one table of dtype names: what `--dtype` accepts, and the `"bfloat16"` <-> `torch.bfloat16` conversions that
weight updates (`update_info["dtype_names"]`), checksums and the parity tools use."""

from __future__ import annotations

import torch

from rlserve.config import MODEL_DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in MODEL_DTYPES}


def dtype_from_name(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`; anything that is not a torch dtype attribute is a ValueError."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")
