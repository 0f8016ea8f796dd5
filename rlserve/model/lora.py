"""LoRA on the projections: each target layer holds `num_slots` adapters at once, preallocated (so that CUDA graphs
capture them and a load is an in-place copy), and every token picks its slot (or none: the base model).

Per layer, with L slots, P parts (3 for the fused q/k/v, 2 for gate/up, 1 otherwise) and rank r (the engine's
max_lora_rank; smaller adapters are zero-padded):
    xa = x @ A.T                      A [L * P * r, in]: every slot's and part's A stacked
    xa *= mask                        each token keeps its own slot's columns (mask [T, L]; all zero for the base)
    y += xa @ B.T                     B [out, L * P * r]: part p's output rows read only part p's A columns
This is plain matmuls (no custom kernel), L times the work of one adapter: cheap for the few slots RL uses. A token
of the base model adds exact zeros, so its output is the base model's bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlserve.model import batch_invariant as bi


def lora_mask(slot_mapping: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, num_slots] one-hot of each token's slot; a row of zeros for slot -1 (the base model)."""
    slots = torch.arange(num_slots, device=slot_mapping.device)
    return (slot_mapping.unsqueeze(1) == slots).to(dtype)


class LoRASlots:
    """The adapters of one projection. Not parameters (plain tensors): checkpoint names, weight updates,
    checksums and sleep's host copies are about the model's own weights, never the adapters."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parts: tuple[tuple[int, int], ...],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """parts: (first output row, rows) of each part of a fused projection, in order."""
        self.parts = parts
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.width = len(parts) * max_rank  # columns of xa per slot
        self.a = torch.zeros(num_slots * self.width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(out_features, num_slots * self.width, dtype=dtype, device=device)

    def apply(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        """y (the projection's output for x) plus each token's adapter delta."""
        matmul = bi.linear if batch_invariant else F.linear
        xa = matmul(x, self.a)
        xa = (xa.view(-1, self.num_slots, self.width) * mask.unsqueeze(2)).view(-1, self.num_slots * self.width)
        return y + matmul(xa, self.b)

    @torch.no_grad()
    def write(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float) -> None:
        """Put an adapter in `slot`: per part (A [rank, in], B [rows, rank]) or None (no delta); scaling is folded
        into B. The slot's old contents are cleared first, so a smaller rank or fewer parts leave no trace."""
        first = slot * self.width
        self.a[first : first + self.width].zero_()
        self.b[:, first : first + self.width].zero_()
        for p, pair in enumerate(weights):
            if pair is None:
                continue
            a, b = pair
            rank, (row, rows) = a.shape[0], self.parts[p]
            col = first + p * self.max_rank
            self.a[col : col + rank].copy_(a)
            self.b[row : row + rows, col : col + rank].copy_(b.float() * scaling)
