"""The trainer side of FP8 rollouts when the trainer quantizes (prime-rl's `quantize_in_weight_transfer`): a
`WeightSource` whose projection weights are sent as the engine serves them, float8_e4m3fn with their scales
(rlserve.model.fp8), so that the engine loads them as they are and the wire carries half the bytes of bf16.

A trainer that sends bf16 instead needs none of this: an engine started with `quantization="fp8"` quantizes each
bf16 projection weight as it arrives, into the same storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

import torch

from rlserve.model.fp8 import FP8_DTYPE, Fp8Scheme, is_quantized_weight_name, quantize_checkpoint
from rlserve.model.layers import quantize_fp8_weight
from rlserve.weight_transfer.source import ParamMeta, WeightSource


class Fp8QuantizedSource(WeightSource):
    """`source`'s weights with every decoder projection weight replaced by its fp8 tensor and scales in `method`'s
    layout ("fp8": `weight_scale_inv` per 128x128 block; "fbgemm_fp8": `weight_scale` per row), the rest as they
    are. Each tensor is quantized whole, as `source.iter_full()` yields it, on its device (one kernel on CUDA)."""

    def __init__(self, source: WeightSource, method: str = "fp8") -> None:
        self._source = source
        self.scheme = Fp8Scheme(method)

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        metas = []
        for meta in self._source.metadata:
            if not is_quantized_weight_name(meta.name):
                metas.append(meta)
                continue
            owners = dict(owners=meta.owners, mesh_shape=meta.mesh_shape)  # gathered whole: no placements
            scale_name = meta.name.removesuffix("weight") + self.scheme.scale_name
            metas.append(ParamMeta(meta.name, FP8_DTYPE, meta.shape, **owners))
            metas.append(ParamMeta(scale_name, torch.float32, self.scheme.scale_shape(*meta.shape), **owners))
        return metas

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from quantize_checkpoint(self._source.iter_full(), self.scheme, quantize_fp8_weight)
