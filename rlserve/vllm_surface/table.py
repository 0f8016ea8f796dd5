"""The `vllm` import surface's table: which of vLLM's module paths resolve, and to which rlserve names.

Each vLLM module maps to either
- an rlserve module path: the vLLM module's names are that module's `__all__` (and what its module-level
  `__getattr__` provides lazily); rlserve keeps such modules at vLLM's paths under `rlserve.distributed`;
- a dict of vLLM name -> "rlserve.module:attribute", or `Refused(why)` for a class that frameworks import
  unconditionally but construct only for an option rlserve lacks;
- `Entry("rlserve.module")`: a module frameworks run with `python -m`; running it runs that rlserve module, importing
  it gives that module's `__all__`.
Every prefix of a path here is a package too (`vllm.distributed`, `vllm.entrypoints.cli`...), with only the names
the table gives it. What is not here is not provided: importing it raises ImportError naming the vLLM API.

The paths and names are vLLM 0.33.0's (`VLLM_VERSION`, which `vllm.__version__` reports, so that frameworks pick
their code paths for the API rlserve implements), chosen from what the RL frameworks import: TRL 1.16.0 (`trl
vllm-serve`, `VLLMClient`, `VLLMGeneration`, async GRPO's weight transfer), SkyRL's worker extension and trainer-side
sender (layerwise reload, `set_current_vllm_config`, the NCCL engine), prime-rl / PipelineRL worker extensions (the
weight-transfer group classes).
"""

from __future__ import annotations

from dataclasses import dataclass

VLLM_VERSION = "0.33.0"


@dataclass(frozen=True)
class Refused:
    """Importable, so that a module importing it loads; constructing it raises NotImplementedError(why)."""

    why: str


@dataclass(frozen=True)
class Entry:
    """A module run with `python -m`: runs `module`'s code as `__main__`."""

    module: str


_LLM = "rlserve.engine.frontend.llm:LLM"
_SAMPLING_PARAMS = "rlserve.sampling_params:SamplingParams"
_REQUEST_OUTPUT = "rlserve.outputs:RequestOutput"
_COMPLETION_OUTPUT = "rlserve.outputs:CompletionOutput"
_ENGINE_ARGS = "rlserve.engine.frontend.args:EngineArgs"
_ASYNC_ENGINE_ARGS = "rlserve.engine.frontend.args:AsyncEngineArgs"
_LAYERWISE_RELOAD = {
    "initialize_layerwise_reload": "rlserve.model.reload:initialize_layerwise_reload",
    "finalize_layerwise_reload": "rlserve.model.reload:finalize_layerwise_reload",
}
_TOKENS_PROMPT = "rlserve.engine.frontend.validation:TokensPrompt"
_ENTRYPOINTS = "rlserve.server.vllm_entrypoints"
_NO_VLLM_LORA_MANAGER = (
    "rlserve loads adapters from PEFT directories with its own LoRA manager (LoRARequest), not from tensors through "
    "vLLM's"
)
_NO_VLLM_LAYERS = "rlserve's model layers are its own (rlserve.model.layers), not vLLM's quantizable layer classes"
_NO_HARMONY = "rlserve has no harmony encoding (gpt-oss's chat format)"
_NO_STRUCTURED_OUTPUTS = "rlserve has no structured (guided) decoding; leave the regex / JSON schema / grammar unset"

MODULES: dict[str, str | dict[str, str | Refused] | Entry] = {
    "vllm": {
        "LLM": _LLM,
        "SamplingParams": _SAMPLING_PARAMS,
        "RequestOutput": _REQUEST_OUTPUT,
        "CompletionOutput": _COMPLETION_OUTPUT,
        "EngineArgs": _ENGINE_ARGS,
        "AsyncEngineArgs": _ASYNC_ENGINE_ARGS,
        "TokensPrompt": _TOKENS_PROMPT,
    },
    "vllm.entrypoints.llm": {"LLM": _LLM},
    "vllm.sampling_params": {
        "SamplingParams": _SAMPLING_PARAMS,
        "RequestOutputKind": "rlserve.sampling_params:RequestOutputKind",
        # TRL's VLLMGeneration and online DPO import it at module level, and build one only for a regex option.
        "StructuredOutputsParams": Refused(_NO_STRUCTURED_OUTPUTS),
    },
    "vllm.outputs": {"RequestOutput": _REQUEST_OUTPUT, "CompletionOutput": _COMPLETION_OUTPUT},
    "vllm.logprobs": {"Logprob": "rlserve.outputs:Logprob"},
    "vllm.lora.request": {"LoRARequest": "rlserve.lora.request:LoRARequest"},
    # verl's VLLMHijack patches vLLM's LoRA manager at import (to load adapters from tensors); rlserve never builds it.
    "vllm.lora.lora_model": {"LoRAModel": Refused(_NO_VLLM_LORA_MANAGER)},
    "vllm.lora.utils": {"get_adapter_absolute_path": Refused(_NO_VLLM_LORA_MANAGER)},
    "vllm.lora.worker_manager": {"LRUCacheWorkerLoRAManager": Refused(_NO_VLLM_LORA_MANAGER)},
    "vllm.engine.arg_utils": {"EngineArgs": _ENGINE_ARGS, "AsyncEngineArgs": _ASYNC_ENGINE_ARGS},
    "vllm.v1.engine.async_llm": {"AsyncLLM": "rlserve.engine.frontend.async_llm:AsyncLLM"},
    "vllm.exceptions": {"RetryableRequestError": "rlserve.engine.frontend.core_client:RetryableRequestError"},
    "vllm.config": {
        "WeightTransferConfig": "rlserve.config:WeightTransferConfig",
        "ProfilerConfig": "rlserve.config:ProfilerConfig",
        "set_current_vllm_config": "rlserve.config:set_current_vllm_config",
    },
    # SkyRL's worker extension brackets an update with these (rlserve/model/reload.py says what they do here). It
    # also rebinds `get_numel_loaded` in `layerwise` and `meta` (its fix of vLLM's element count): rlserve's reload
    # counts no elements (every tensor is written whole as it arrives), so the rebound name has no reader.
    "vllm.model_executor.model_loader.reload": _LAYERWISE_RELOAD,
    "vllm.model_executor.model_loader.reload.layerwise": _LAYERWISE_RELOAD,
    "vllm.model_executor.model_loader.reload.meta": {},
    # verl's FP8 rollout helpers import it at module level; rlserve's FP8 is its --quantization fp8, and verl's
    # FP8 arguments (--hf_overrides with a quantization_config) are refused by name at the command line.
    "vllm.model_executor.layers.linear": {"LinearBase": Refused(_NO_VLLM_LAYERS)},
    # verl's worker extension tests `isinstance(vllm_config.quant_config, Fp8Config)`: rlserve's have no quant_config.
    "vllm.model_executor.layers.quantization.fp8": {"Fp8Config": Refused(_NO_VLLM_LAYERS)},
    # verl's worker extension calls it after writing a weight sync's tensors with `model.load_weights`.
    "vllm.model_executor.model_loader.utils": {
        "process_weights_after_loading": "rlserve.model.loader:process_weights_after_loading"
    },
    "vllm.config.parallel": {"ParallelConfig": "rlserve.weight_transfer.base:ParallelConfigLike"},
    "vllm.platforms": {
        "current_platform": "rlserve.platforms:current_platform",
        "Platform": "rlserve.platforms:Platform",
    },
    "vllm.utils.nccl": {"_nccl_has_no_cache": "rlserve.weight_transfer.nccl_library:has_nccl_no_cache"},
    "vllm.config.weight_transfer": {"WeightTransferConfig": "rlserve.config:WeightTransferConfig"},
    "vllm.utils.network_utils": {"get_ip": "rlserve.net:get_ip", "get_open_port": "rlserve.net:get_open_port"},
    # verl's `verl.third_party.vllm` re-exports it and uses none of its names: importable, each name refused.
    "vllm.distributed.parallel_state": {},
    "vllm.distributed.utils": "rlserve.distributed.utils",
    "vllm.distributed.device_communicators.pynccl": "rlserve.distributed.device_communicators.pynccl",
    "vllm.distributed.device_communicators.pynccl_wrapper": "rlserve.distributed.device_communicators.pynccl_wrapper",
    "vllm.distributed.weight_transfer": "rlserve.distributed.weight_transfer",
    "vllm.distributed.weight_transfer.base": "rlserve.distributed.weight_transfer.base",
    "vllm.distributed.weight_transfer.clients": "rlserve.distributed.weight_transfer.clients",
    "vllm.distributed.weight_transfer.factory": "rlserve.distributed.weight_transfer.factory",
    "vllm.distributed.weight_transfer.ipc_engine": "rlserve.distributed.weight_transfer.ipc_engine",
    "vllm.distributed.weight_transfer.modelexpress_engine": "rlserve.distributed.weight_transfer.modelexpress_engine",
    "vllm.distributed.weight_transfer.nccl_common": "rlserve.distributed.weight_transfer.nccl_common",
    "vllm.distributed.weight_transfer.nccl_engine": "rlserve.distributed.weight_transfer.nccl_engine",
    "vllm.distributed.weight_transfer.packed_tensor": "rlserve.distributed.weight_transfer.packed_tensor",
    "vllm.distributed.weight_transfer.sparse_nccl_engine": "rlserve.distributed.weight_transfer.sparse_nccl_engine",
    # `vllm serve`, as TRL's `trl vllm-serve` and `VLLMClient`'s docs start it.
    "vllm.entrypoints.cli.main": Entry("rlserve.vllm_cli"),
    # vLLM's API server hosted in a framework's own process (verl's vLLMHttpServer).
    "vllm.entrypoints.cli.serve": {
        "ServeSubcommand": f"{_ENTRYPOINTS}:ServeSubcommand",
        "cmd_init": f"{_ENTRYPOINTS}:cmd_init",
        "run_headless": f"{_ENTRYPOINTS}:run_headless",
    },
    "vllm.entrypoints.openai.api_server": {
        "build_app": f"{_ENTRYPOINTS}:build_app",
        "init_app_state": f"{_ENTRYPOINTS}:init_app_state",
    },
    # verl imports it at module level and calls it only for gpt-oss (VERL_USE_GPT_OSS=1).
    "vllm.entrypoints.openai.parser.harmony_utils": {"get_encoding": Refused(_NO_HARMONY)},
    "vllm.inputs": {"TokensPrompt": _TOKENS_PROMPT},
    "vllm.usage.usage_lib": {"UsageContext": "rlserve.engine.frontend.args:UsageContext"},
    "vllm.utils.argparse_utils": {"FlexibleArgumentParser": "rlserve.engine.frontend.args:FlagParser"},
}


# Every proper prefix of a table path: the packages above the table's modules.
PACKAGES = frozenset(path.rsplit(".", depth)[0] for path in MODULES for depth in range(1, path.count(".") + 1))
