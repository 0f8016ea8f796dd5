"""Reading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) and refusing, by the
field's name, what rlserve does not implement. Checks that need the model (shapes) are the model's
(rlserve.model.lora); nothing here writes anywhere, so a refused adapter changes nothing."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

# The projections of the dense decoders (llama, qwen2, qwen3) an adapter may target.
SUPPORTED_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# PEFT features that change what an adapter computes: refused when set (the value that means "off" is accepted).
_UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "adapters that replace whole modules are not supported (only LoRA deltas)",
    "fan_in_fan_out": "transposed (Conv1D-layout) weights are not supported; the supported decoders use Linear layers",
    "rank_pattern": "per-module ranks are not supported",
    "alpha_pattern": "per-module alphas are not supported",
    "lora_bias": "LoRA bias is not supported",
    "layer_replication": "layer replication is not supported",
    "use_qalora": "QALoRA is not supported",
    "alora_invocation_tokens": "activated LoRA is not supported",
}


@dataclass(frozen=True)
class PEFTAdapter:
    """An adapter's tensors by module (checkpoint name without `.weight`: `model.layers.0.self_attn.q_proj`):
    (A [rank, in], B [out, rank]); the delta of a module is scaling * B @ A."""

    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_peft_adapter(lora_path: str, max_lora_rank: int) -> PEFTAdapter:
    path = Path(lora_path)
    if not path.is_dir():
        raise ValueError(f"lora_path: {lora_path!r} is not a directory")
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file():
        raise ValueError(f"lora_path: {lora_path!r} has no {CONFIG_FILE}")
    if not weights_file.is_file():
        raise ValueError(
            f"lora_path: {lora_path!r} has no {WEIGHTS_FILE} (only safetensors are read: a .bin is a pickle)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"lora_path: cannot read {config_file}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora_path: {config_file} does not hold a JSON object")
    rank, scaling = _check_config(config, max_lora_rank)
    return PEFTAdapter(rank, scaling, _read_weights(weights_file, rank))


def _check_config(config: dict, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a config rlserve implements; a ValueError naming the first field it does not."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"peft_type: only LORA adapters are supported, got {peft_type!r}")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"r: the adapter's rank must be an integer >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"r: the adapter's rank {rank} exceeds max_lora_rank {max_lora_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"lora_alpha: must be a number, got {alpha!r}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise ValueError(f"bias: only 'none' is supported (adapters that train biases are not), got {bias!r}")
    for name, why in _UNSUPPORTED_FEATURES.items():
        if config.get(name):
            raise ValueError(f"{name}: {why}, got {config[name]!r}")
    targets = config.get("target_modules")
    # A string is a regex (or "all-linear") over module names: the tensors present say what it matched.
    if isinstance(targets, list):
        unknown = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED_TARGET_MODULES})
        if unknown:
            raise ValueError(f"target_modules: {unknown} not supported; supported: {list(SUPPORTED_TARGET_MODULES)}")
    elif not isinstance(targets, str):
        raise ValueError(f"target_modules: must be a list of module names or a string, got {targets!r}")
    use_rslora = bool(config.get("use_rslora", False))
    return rank, alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _read_weights(weights_file: Path, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for name in f.keys():
                module, kind = _split_name(name)
                parts.setdefault(module, {})[kind] = f.get_tensor(name)
    except ValueError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"lora_path: cannot read {weights_file}: {e}") from None
    if not parts:
        raise ValueError(f"lora_path: {weights_file} holds no LoRA tensors")
    weights = {}
    for module, pair in parts.items():
        missing = {"lora_A", "lora_B"} - pair.keys()
        if missing:
            raise ValueError(f"adapter tensor {module}.{sorted(missing)[0]}.weight: missing (A and B come in pairs)")
        a, b = pair["lora_A"], pair["lora_B"]
        for kind, t in (("lora_A", a), ("lora_B", b)):
            if t.dim() != 2 or not t.dtype.is_floating_point:
                raise ValueError(
                    f"adapter tensor {module}.{kind}.weight: expected a 2-d floating-point matrix, got "
                    f"{list(t.shape)} {t.dtype}"
                )
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"adapter tensor {module}.lora_A.weight / lora_B.weight: shapes {list(a.shape)} / {list(b.shape)} do "
                f"not have the adapter's rank r={rank}"
            )
        weights[module] = (a, b)
    return weights


def _split_name(name: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (<module>, "lora_A"); a tensor of anything else is refused."""
    parts = name.removeprefix(_PREFIX).split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise ValueError(f"adapter tensor {name}: not a LoRA A/B weight of a supported module (target_modules)")
    module = ".".join(parts[:-2])
    if parts[-3] not in SUPPORTED_TARGET_MODULES:
        raise ValueError(
            f"adapter tensor {name}: target_modules: {parts[-3]!r} is not supported; supported: "
            f"{list(SUPPORTED_TARGET_MODULES)}"
        )
    return module, parts[-2]
