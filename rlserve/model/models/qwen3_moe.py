"""Qwen3-MoE: the Qwen3 decoder (attention, norms, layer skeleton shared with llama.py) whose sparse layers' MLP is
rlserve.model.moe's SparseMoeBlock, and whose loader maps each expert's checkpoint tensors onto the stacked experts.

Experts arrive under either naming: the checkpoint's per-expert tensors (`mlp.experts.E.gate_proj.weight`, ...), or
transformers 5's stacked parameters (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), what
a trainer holding the Hugging Face model sends from its named_parameters(). A stacked tensor is split into its
per-expert views before the shared loader checks and writes them, so both go through one validation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from rlserve.model.layers import RotaryEmbedding, ShardSlice
from rlserve.model.models.llama import DecoderForCausalLM, DecoderSpec
from rlserve.model.moe import FusedExperts, SparseMoeBlock
from rlserve.model.parallel import TensorParallelGroup


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def __init__(
        self,
        spec: DecoderSpec,
        rotary: RotaryEmbedding,
        tp: TensorParallelGroup | None = None,
        ep: TensorParallelGroup | None = None,
    ) -> None:
        """`ep`: the expert-parallel group (the data-parallel ranks) the experts are split over."""
        if spec.moe is None:
            raise ValueError(f"{spec.architecture}: a MoE model needs the MoE fields of its config")
        if tp is not None and tp.size > 1:
            # The experts would need splitting (tensor-parallel MoE), which is not built yet.
            raise ValueError(f"tensor_parallel_size: {spec.architecture} runs on one rank (MoE layers are not sharded)")
        self.ep = ep or TensorParallelGroup()
        super().__init__(spec, rotary, tp)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        if self.spec.moe.is_sparse(layer_idx):
            return SparseMoeBlock(self.spec.moe, self.spec.hidden_size, layer_idx, self.ep)
        return super().make_mlp(layer_idx)

    def set_batch_invariant(self, enabled: bool) -> None:
        super().set_batch_invariant(enabled)
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                module.batch_invariant = enabled

    def _fp8_targets(self) -> Iterator[nn.Module]:
        """Every layer's attention projections, and its experts or (a dense layer's) MLP projections."""
        for layer in self.model.layers:
            yield layer.self_attn.qkv_proj
            yield layer.self_attn.o_proj
            if isinstance(layer.mlp, SparseMoeBlock):
                yield layer.mlp.experts
            else:
                yield from (layer.mlp.gate_up_proj, layer.mlp.down_proj)

    def _module_of(self, name: str) -> nn.Module:
        expert_tensor = _expert_tensor(name)
        if expert_tensor is None:
            return super()._module_of(name)
        return self.get_submodule(expert_tensor[0])

    def _find_target(self, name: str) -> tuple[nn.Parameter, ShardSlice] | None:
        """`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight` (and an FP8 model's `.weight_scale_inv` /
        `.weight_scale`) are rows of the layer's stacked experts (and their scales)."""
        expert_tensor = _expert_tensor(name)
        if expert_tensor is not None:
            experts_name, expert, sub, param_name = expert_tensor
            experts = self._experts_of(experts_name)
            if experts is not None and expert < experts.experts.total:
                try:
                    return experts.shard(expert, sub, param_name)
                except KeyError:
                    pass
            raise ValueError(f"weight name {name!r} does not exist in this {self.spec.architecture} model")
        if self._stacked_experts(name) is not None:  # written through their per-expert names (see _split)
            raise ValueError(f"weight name {name!r}: stacked experts are loaded by load_weights, not resolved")
        return super()._find_target(name)

    def _stacked_experts(self, name: str) -> tuple[FusedExperts, tuple[str, ...], tuple[int, ...]] | None:
        """For transformers 5's `...mlp.experts.gate_up_proj` / `.down_proj`: (experts, the per-expert checkpoint
        sub-names each expert's slice holds, the stacked shape); None for any other name."""
        prefix, _, attr = name.rpartition(".")
        if attr not in ("gate_up_proj", "down_proj") or not prefix.endswith(".experts"):
            return None
        experts = self._experts_of(prefix)
        if experts is None:
            return None
        e, h, i = experts.experts.total, experts.hidden_size, experts.intermediate_size
        if attr == "gate_up_proj":
            return experts, ("gate_proj", "up_proj"), (e, 2 * i, h)
        return experts, ("down_proj",), (e, h, i)

    def _split(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, slice]]] | None:
        """A stacked expert tensor as (per-expert checkpoint name, index into the stacked tensor) pairs, each a
        [rows, columns] slice; None for a name that is not one. A wrong shape is refused here, by the stacked name."""
        stacked = self._stacked_experts(name)
        if stacked is None:
            return None
        experts, subs, expected = stacked
        if tuple(shape) != expected:
            raise ValueError(f"weight {name!r}: shape {list(shape)} does not match the model's {list(expected)}")
        prefix = name.rpartition(".")[0]
        rows = expected[1] // len(subs)
        return [
            (f"{prefix}.{expert}.{sub}.weight", (expert, slice(j * rows, (j + 1) * rows)))
            for expert in range(experts.experts.total)
            for j, sub in enumerate(subs)
        ]

    def check_weights(
        self, metadata: Iterable[tuple[str, tuple[int, ...], torch.dtype]], whole_update: bool = False
    ) -> None:
        super().check_weights(self._per_expert_metadata(metadata), whole_update)

    def _per_expert_metadata(
        self, metadata: Iterable[tuple[str, tuple[int, ...], torch.dtype]]
    ) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
        for name, shape, dtype in metadata:
            parts = self._split(name, shape)
            if parts is None:
                yield name, shape, dtype
                continue
            for sub, (_, rows) in parts:
                yield sub, (rows.stop - rows.start, shape[2]), dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        def per_expert() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                parts = self._split(name, tuple(tensor.shape))
                if parts is None:
                    yield name, tensor
                else:
                    yield from ((sub, tensor[index]) for sub, index in parts)

        return super().load_weights(per_expert())

    def written_names(self, name: str, dtype: torch.dtype | None = None) -> tuple[str, ...]:
        stacked = self._stacked_experts(name)
        if stacked is None:
            return super().written_names(name, dtype)
        per_expert = super().written_names  # each expert's tensor, and its scales when quantized here
        return tuple(n for sub, _ in self._split(name, stacked[2]) for n in per_expert(sub, dtype))

    def _experts_of(self, module_name: str) -> FusedExperts | None:
        try:
            module = self.get_submodule(module_name)
        except AttributeError:
            return None
        return module if isinstance(module, FusedExperts) else None

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """As the dense model's, with each expert's gate/up/down tensors under their checkpoint names (this rank's
        experts under expert parallel: the engine's checksums merge the ranks' sets)."""
        for name, tensor in super().checkpoint_weights():
            prefix, _, attr = name.rpartition(".")
            experts = self._experts_of(prefix)
            if experts is None:
                yield name, tensor
            elif attr == "gate_up_proj":  # once per layer: every (local) expert's three tensors (and their scales)
                shard = experts.experts
                param_names = ("weight",) if experts.fp8 is None else ("weight", experts.fp8.scale_name)
                for expert in range(shard.first, shard.first + shard.num_local):
                    for sub in ("gate_proj", "up_proj", "down_proj"):
                        for param_name in param_names:
                            param, sl = experts.shard(expert, sub, param_name)
                            yield f"{prefix}.{expert}.{sub}.{param_name}", sl.of_param(param.data)


def _expert_tensor(name: str) -> tuple[str, int, str, str] | None:
    """(experts module name, expert, checkpoint sub-name, parameter name) of an expert's checkpoint tensor
    `model.layers.L.mlp.experts.E.SUB.PARAM`; None for any other name."""
    parts = name.split(".")
    if len(parts) == 8 and parts[4] == "experts" and parts[5].isdigit():
        return ".".join(parts[:5]), int(parts[5]), parts[6], parts[7]
    return None
