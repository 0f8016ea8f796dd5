"""From a Hugging Face model directory to a model with its weights on the device."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from rlserve.dtypes import TORCH_DTYPES
from rlserve.model.fp8 import Fp8Scheme, scheme_from_hf_config, weight_scale_storage
from rlserve.model.layers import Linear, RotaryEmbedding, quantize_fp8_weight
from rlserve.model.models import MODEL_CLASSES, SUPPORTED_ARCHITECTURES, DecoderForCausalLM, spec_from_hf_config
from rlserve.model.parallel import TensorParallelGroup

DUMMY_WEIGHTS_RANGE = 1e-3  # vLLM's initialize_dummy_weights bounds
DUMMY_WEIGHTS_SEED = 1234  # and its seed


def load_hf_config(model_dir: str) -> PretrainedConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model: directory {model_dir!r} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {model_dir!r} has no config.json")
    cfg = AutoConfig.from_pretrained(path)
    arch = (getattr(cfg, "architectures", None) or ["<none>"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model: architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")
    return cfg


def import_config_classes() -> None:
    """Import the configuration classes of the supported architectures. transformers imports a model type's class
    on first use, and with it much of the package (seconds, and tens of seconds from source on a machine without
    bytecode caches): the engine-core fork server does it once, so a forked core's `load_hf_config` does not."""
    for model_type in SUPPORTED_ARCHITECTURES.values():
        AutoConfig.for_model(model_type)


def resolve_dtype(dtype: str, cfg: PretrainedConfig) -> torch.dtype:
    if dtype != "auto":
        return TORCH_DTYPES[dtype]
    configured = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
    if isinstance(configured, str):
        configured = TORCH_DTYPES.get(configured, torch.float32)
    return configured


def checkpoint_files(model_dir: str) -> list[Path]:
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {model_dir!r} holds no .safetensors weights")
    return files


def iterate_checkpoint(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(
    cfg: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
    ep: TensorParallelGroup | None = None,
    fp8: Fp8Scheme | None = None,
) -> DecoderForCausalLM:
    """Allocate the model (this rank's part of it, under tensor parallelism `tp`, and of the experts under expert
    parallelism `ep`; its projections in FP8 with `fp8`) on the device without initialising it; the caller loads
    weights next."""
    spec = spec_from_hf_config(cfg)
    rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, device)
    extra = {}
    if ep is not None and ep.size > 1:
        if spec.moe is None:
            raise ValueError(f"enable_expert_parallel: {spec.architecture} has no experts (not a MoE model)")
        extra["ep"] = ep
    with torch.device("meta"):
        model = MODEL_CLASSES[spec.architecture](spec, rotary, tp, **extra)
        if fp8 is not None:
            model.quantize_fp8(fp8)
    # Storage for each parameter, made with torch.empty: Module.to_empty goes through empty_like, whose meta
    # implementation imports sympy (a second of every engine's start-up).
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(_storage(module, name, param, dtype, device), requires_grad=False))
    if spec.tie_word_embeddings:  # parameters were re-created: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _storage(
    module: torch.nn.Module, name: str, param: torch.nn.Parameter, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Uninitialised storage for `param`; a block-wise FP8 projection's scales in the padded layout the GEMM reads."""
    scheme = module.fp8 if isinstance(module, Linear) else None
    if scheme is not None and scheme.block_wise and name == scheme.scale_name:
        return weight_scale_storage(tuple(param.shape), device)
    return torch.empty(param.shape, dtype=_storage_dtype(module, name, param, dtype), device=device)


def _storage_dtype(module: torch.nn.Module, name: str, param: torch.nn.Parameter, dtype: torch.dtype) -> torch.dtype:
    """The model dtype for floating-point parameters, except an FP8 projection's weight and scales, which keep
    theirs (float8_e4m3fn, fp32)."""
    if not param.is_floating_point() or (getattr(module, "fp8", None) is not None and name != "bias"):
        return param.dtype
    return dtype


def initialize_dummy_weights(model: DecoderForCausalLM, seed: int = DUMMY_WEIGHTS_SEED) -> None:
    """vLLM's dummy load format: every weight uniform in +-DUMMY_WEIGHTS_RANGE, from a fixed seed (the same dummy
    model each start), so that the engine runs (meaninglessly) until real weights are pushed or reloaded."""
    generators: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()  # a tied LM head is the embedding: drawn once, as model.parameters() gives it
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            device = param.device
            if device not in generators:  # made where the weights are: no host copy of a large model
                generators[device] = torch.Generator(device=device).manual_seed(seed)
            fp8_weights = module.fp8_weights() if getattr(module, "fp8", None) is not None else {}
            if name in fp8_weights:  # dummy values in fp32, quantized with their scales
                _dummy_fp8(module, name, fp8_weights[name], generators[device])
            elif name not in fp8_weights.values():
                param.data.uniform_(-DUMMY_WEIGHTS_RANGE, DUMMY_WEIGHTS_RANGE, generator=generators[device])


def _dummy_fp8(module: torch.nn.Module, weight_name: str, scale_name: str, generator: torch.Generator) -> None:
    param = getattr(module, weight_name)
    weight = torch.empty(param.shape, device=param.device)
    weight.uniform_(-DUMMY_WEIGHTS_RANGE, DUMMY_WEIGHTS_RANGE, generator=generator)
    q, scale = quantize_fp8_weight(weight, module.fp8)
    param.data.copy_(q)
    getattr(module, scale_name).data.copy_(scale)


def load_model(
    model_dir: str,
    dtype: str | torch.dtype,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
    load_format: str = "auto",
    ep: TensorParallelGroup | None = None,
    quantization: str | None = None,
) -> tuple[DecoderForCausalLM, PretrainedConfig]:
    """dtype: a torch dtype, or an engine dtype name ("auto" takes the checkpoint's). Under tensor parallelism each
    rank reads the whole checkpoint tensors and keeps its part of each. load_format "dummy": random weights of the
    right shapes, no checkpoint read (the config still comes from `model_dir`). quantization: an FP8 method
    (rlserve.model.fp8) quantizes a checkpoint in the model dtype as each tensor arrives; an FP8 checkpoint (its
    config's `quantization_config`) is loaded as it is, whether or not one is given."""
    cfg = load_hf_config(model_dir)
    fp8 = scheme_from_hf_config(quantization, getattr(cfg, "quantization_config", None))
    model = build_model(cfg, resolve_dtype(dtype, cfg) if isinstance(dtype, str) else dtype, device, tp, ep, fp8)
    if load_format == "dummy":
        initialize_dummy_weights(model)
        return model, cfg
    names = {name for name, _ in model.checkpoint_weights()}
    loaded: set[str] = set()
    for name, tensor in iterate_checkpoint(model_dir):
        if model.load_weights([(name, tensor)]):
            loaded.update(model.written_names(name, tensor.dtype))
    missing = names - loaded
    if missing:
        raise ValueError(f"model: checkpoint in {model_dir!r} lacks weights {sorted(missing)[:5]}")
    return model, cfg


def process_weights_after_loading(model: torch.nn.Module, model_config: object, target_device: torch.device) -> None:
    """vLLM's step after weights are written straight into a model (its layers' repacking and requantization), which
    worker extensions written for vLLM call after their own `model.load_weights` (verl's). rlserve's `load_weights`
    leaves it nothing to do: an FP8 weight is quantized as it is written, and the fp32 LM head copy is dropped there."""
