"""Qwen3-MoE: the Qwen3 decoder (attention, norms, layer skeleton shared with llama.py) whose sparse layers' MLP is
rlserve.model.moe's SparseMoeBlock, and whose loader maps each expert's checkpoint tensors onto the stacked experts."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from rlserve.model.layers import RotaryEmbedding
from rlserve.model.models.llama import DecoderForCausalLM, DecoderSpec
from rlserve.model.moe import FusedExperts, SparseMoeBlock


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding) -> None:
        if spec.moe is None:
            raise ValueError(f"{spec.architecture}: a MoE model needs the MoE fields of its config")
        super().__init__(spec, rotary)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        if self.spec.moe.is_sparse(layer_idx):
            return SparseMoeBlock(self.spec.moe, self.spec.hidden_size, layer_idx)
        return super().make_mlp(layer_idx)

    def set_batch_invariant(self, enabled: bool) -> None:
        super().set_batch_invariant(enabled)
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                module.batch_invariant = enabled

    def _find_target(self, name: str) -> tuple[torch.Tensor, int, int] | None:
        """`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight` are rows of the layer's stacked experts."""
        parts = name.split(".")
        if len(parts) == 8 and parts[4] == "experts" and parts[-1] == "weight" and parts[5].isdigit():
            experts = self._experts_of(".".join(parts[:5]))
            expert = int(parts[5])
            if experts is not None and expert < experts.num_experts:
                try:
                    return experts.shard(expert, parts[6])
                except KeyError:
                    pass
            raise ValueError(f"weight name {name!r} does not exist in this {self.spec.architecture} model")
        if len(parts) >= 2 and parts[-2] == "experts":  # the stacked parameters have no checkpoint name of their own
            raise ValueError(
                f"weight name {name!r}: send the experts by their checkpoint names "
                "(model.layers.L.mlp.experts.E.gate_proj.weight, .up_proj.weight, .down_proj.weight)"
            )
        return super()._find_target(name)

    def _experts_of(self, module_name: str) -> FusedExperts | None:
        try:
            module = self.get_submodule(module_name)
        except AttributeError:
            return None
        return module if isinstance(module, FusedExperts) else None

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """As the dense model's, with each expert's gate/up/down tensors under their checkpoint names."""
        for name, tensor in super().checkpoint_weights():
            prefix, _, attr = name.rpartition(".")
            experts = self._experts_of(prefix)
            if experts is None:
                yield name, tensor
            elif attr == "gate_up_proj":  # once per layer: every expert's three tensors
                for expert in range(experts.num_experts):
                    for sub in ("gate_proj", "up_proj", "down_proj"):
                        param, start, rows = experts.shard(expert, sub)
                        yield f"{prefix}.{expert}.{sub}.weight", param.data[start : start + rows]
