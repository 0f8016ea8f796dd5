"""Trainer-side senders of prime-rl's and PipelineRL's weight broadcasts, written from their code's protocol facts
(their trainers import vLLM's PyNccl and need CUDA, so their code cannot run here):

- the group: vLLM's `StatelessProcessGroup` (rank 0 serves the TCPStore for `world_size` ranks and waits for all);
  on CPU the tensors go over gloo on that store as bytes (rlserve's CPU convention, `stateless_group.py`), where on
  GPU PyNccl would carry them;
- prime-rl 559b4477 `src/prime_rl/transports/weights/nccl.py`: `broadcast_integer` of the state-dict count, then per
  state dict (`filter_state_dict_by_layers`: the non-layer weights first, then each `model.layers.{i}.`) the pickled
  `{dtype: [(name, shape, numel)]}` size, bytes, and one `torch.cat` of the flattened tensors per dtype;
- prime-rl 559b4477 with `quantize_in_weight_transfer` (`preprocess_layer_quantized`): the non-layer state dict as
  it is, each layer through `convert_layer_to_vllm_kernel(..., quantize_fp8=True)`, whose rules
  (`trainer/models/glm_moe_dsa/converting_glm_moe_dsa.py`, the one model that implements it there) are: norms as
  they are; fused projections stacked by rows (`gate_up_proj` = cat(gate, up)); every 2-d projection weight through
  `quantize_to_vllm_kernel_format` (`trainer/models/fp8.py`; on Hopper the plain block grid): per 128x128 block
  scale = max(amax / 448, 1e-12) in fp32, q = clamp(w / scale, +-448) as float8_e4m3fn, the scales under
  `<name>_scale_inv` ([rows/128, cols/128], fp32). A standard attention's q/k/v are stacked as `qkv_proj` (vLLM's
  kernel name), as that converter stacks GLM's `fused_qkv_a_proj`;
- PipelineRL 58d39345 `pipelinerl/finetune_loop.py` `send_weight_update`: each parameter broadcast in
  `parameters_info` order.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from rlserve.weight_transfer.nccl import WeightTransferGroup
from rlserve.weight_transfer.packed import as_bytes

LAYER_PREFIX = "model.layers."  # prime-rl's get_layer_prefix for a decoder-only HF model


class StatelessTrainer:
    """Rank 0 of the group. Blocks in the constructor until every engine rank has joined, as vLLM's does."""

    def __init__(self, port: int, world_size: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=timeout)
        self.group = WeightTransferGroup(dist.PrefixStore("rlserve/gloo", self.store), 0, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(as_bytes(tensor.contiguous()), src=0).wait()

    def shutdown(self) -> None:
        self.group.shutdown()


def prime_rl_broadcast_weights(trainer: StatelessTrainer, state_dict: dict[str, torch.Tensor]) -> None:
    """prime-rl's `NCCLWeightBroadcastSender.broadcast_weights` for an HF-named state dict."""
    layers = {int(name[len(LAYER_PREFIX) :].split(".")[0]) for name in state_dict if name.startswith(LAYER_PREFIX)}
    num_layers = max(layers) + 1 if layers else 0  # get_max_layer_num
    trainer.broadcast(torch.tensor([num_layers + 1], dtype=torch.long))
    prime_rl_broadcast_state_dict(trainer, {k: v for k, v in state_dict.items() if not k.startswith(LAYER_PREFIX)})
    for i in range(num_layers):
        layer = {k: v for k, v in state_dict.items() if k.startswith(f"{LAYER_PREFIX}{i}.")}
        prime_rl_broadcast_state_dict(trainer, layer)


def prime_rl_kernel_format(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF-named state dict as prime-rl's quantizing sender sends it: layers in vLLM's FP8 kernel format."""
    out = {}
    for name, tensor in state_dict.items():
        parts = name.split(".")
        if not name.startswith(LAYER_PREFIX) or parts[-1] != "weight" or not parts[-2].endswith("_proj"):
            out[name] = tensor  # the non-layer weights, norms
            continue
        prefix, sub = ".".join(parts[:-2]), parts[-2]
        if sub in ("k_proj", "v_proj", "up_proj"):
            continue  # stacked with q_proj / gate_proj
        fused = {
            "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
            "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
        }
        kernel_name, stacked = fused.get(sub, (sub, (sub,)))
        weight = torch.cat([state_dict[f"{prefix}.{part}.weight"] for part in stacked])
        out[f"{prefix}.{kernel_name}.weight"], out[f"{prefix}.{kernel_name}.weight_scale_inv"] = _fp8_blockwise(weight)
    return out


def _fp8_blockwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % 128, 0, -rows % 128))
    blocks = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128).permute(0, 2, 1, 3)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scales = (blocks.abs().amax(dim=(2, 3)) / fp8_max).clamp(min=1e-12)
    q = (blocks / scales[:, :, None, None]).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q.permute(0, 2, 1, 3).reshape(padded.shape)[:rows, :cols].contiguous(), scales.contiguous()


def prime_rl_broadcast_state_dict(trainer: StatelessTrainer, state_dict: dict[str, torch.Tensor]) -> None:
    dtype_groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for key, value in state_dict.items():
        dtype_groups.setdefault(value.dtype, []).append((key, value))
    metadata = {
        dtype: [(key, value.shape, value.numel()) for key, value in items] for dtype, items in dtype_groups.items()
    }
    state = pickle.dumps(metadata)
    trainer.broadcast(torch.tensor([len(state)], dtype=torch.long))
    trainer.broadcast(torch.ByteTensor(list(state)))
    for items in dtype_groups.values():
        trainer.broadcast(torch.cat([value.flatten() for _, value in items]))


def pipelinerl_parameters_info(state_dict: dict[str, torch.Tensor]) -> list[dict]:
    """PipelineRL's `ParameterInfo(name, shape=list(parameter.shape), dtype=str(parameter.dtype))`, dumped."""
    return [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype)} for n, p in state_dict.items()]
