"""The command lines with which RL frameworks start `vllm serve`, built as each framework's launcher code builds them
(the commit or release is named on each function): tests/server/test_vllm_flags.py parses them, and
tests/server/test_framework_launch.py starts `rlserve serve` with them."""

from __future__ import annotations

import json
from typing import Any

from rlserve.server import vllm_flags
from rlserve.server.vllm_flags import VllmFlag


def namespace_as_flags(values: dict[str, Any], release: str) -> list[str]:
    """The command line that parses, under `release`'s vLLM parser, to these Namespace values: how SkyRL and prime-rl
    drive vLLM (they set a Namespace's fields and call parse_args(args=[], namespace=...)). None is vLLM's default,
    left out; a switch takes the spelling `release` has for its value."""
    flags = vllm_flags.vllm_flags()
    argv: list[str] = []
    for dest, value in values.items():
        if value is None:
            continue
        flag = flags[dest]
        spellings = [option for option in flag.options if _has(flag, option, release) and option.startswith("--")]
        if flag.is_switch:
            argv.append(next(option for option in spellings if flag.options[option] is bool(value)))
        elif isinstance(value, list):
            argv += [spellings[0], *map(str, value)]
        else:
            argv += [spellings[0], json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def _has(flag: VllmFlag, option: str, release: str) -> bool:
    releases = vllm_flags.vllm_releases()
    index = releases.index(release)
    for part in flag.releases[option].split(","):
        first, _, last = part.partition("-")
        if releases.index(first) <= index <= releases.index(last or first):
            return True
    return False


def skyrl_flags(model: str) -> list[str]:
    """SkyRL a9564572, skyrl/backends/skyrl_train/inference_servers/utils.py build_vllm_cli_args (the `overrides`
    dict) with SkyRL's config defaults (skyrl/train/config/config.py: InferenceEngineConfig, colocate_all=True so
    the weight sync is "ipc" and sleep mode on), then vllm_server_actor.py's distributed_executor_backend ("ray"),
    under the vLLM SkyRL pins (0.26.0)."""
    overrides = dict(
        model=model,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        dtype="bfloat16",
        data_parallel_size=1,
        seed=42,
        gpu_memory_utilization=0.8,
        enable_prefix_caching=True,
        enforce_eager=False,
        max_num_batched_tokens=8192,
        enable_expert_parallel=False,
        max_num_seqs=1024,
        enable_sleep_mode=True,
        enable_return_routed_experts=False,
        weight_transfer_config={"backend": "ipc"},
        worker_extension_cls="skyrl.backends.skyrl_train.inference_servers.new_inference_worker_wrap."
        "NewInferenceWorkerWrap",
        generation_config="vllm",
        served_model_name=None,
        language_model_only=False,
        mm_processor_cache_gb=0,
        kv_cache_metrics=True,
        trust_remote_code=True,
        enable_lora=False,
        distributed_executor_backend="ray",
    )
    return namespace_as_flags(overrides, "0.26.0")


def prime_rl_flags(model: str) -> list[str]:
    """prime-rl 559b4477, packages/prime-rl-configs/src/prime_rl/configs/inference.py InferenceConfig.to_namespace()
    with its defaults (VllmConfig; model Qwen/Qwen3-0.6B, whose parsers resolve to hermes and none;
    enable_fp32_lm_head on), under the latest vLLM it takes (>=0.26.0). Its ServerConfig's liveness_timeout_seconds
    is read by prime-rl's own server wrapper, not by vLLM's parser: no flag."""
    namespace = dict(
        host=None,
        port=8000,
        model=model,
        dtype="auto",
        max_model_len=None,
        enforce_eager=False,
        trust_remote_code=False,
        tool_call_parser="hermes",
        tensor_parallel_size=1,
        data_parallel_size=1,
        data_parallel_size_local=None,
        data_parallel_rpc_port=13345,
        api_server_count=1,
        seed=0,
        gpu_memory_utilization=0.9,
        enable_prefix_caching=None,
        enable_lora=False,
        max_loras=8,
        max_cpu_loras=100,
        max_lora_rank=None,
        enable_expert_parallel=False,
        all2all_backend="allgather_reducescatter",
        enable_eplb=False,
        enable_dbo=False,
        enable_return_routed_experts=False,
        enable_auto_tool_choice=True,
        logprobs_mode="processed_logprobs",
        additional_config={"fp32_lm_head": True},
    )
    return namespace_as_flags(namespace, "0.33.0")


def pipelinerl_flags(model: str) -> list[str]:
    """PipelineRL 58d39345, pipelinerl/launch.py run_actor_llm's cmd after `python -m pipelinerl.entrypoints.run_vllm1`
    with conf/base.yaml's vllm_kwargs (through _append_vllm_kwargs: "" is a bare flag) and debug.mode on (which
    appends --disable-weight-updates)."""
    cmd = ["--model", model, "--host", "0.0.0.0", "--port", "8080", "--seed", "42", "--actor-llm-idx", "0"]
    cmd += ["--weight-update-group-init-method", "tcp://localhost:9000", "--weight-update-group-world-size", "2"]
    cmd += ["--quantization", "bf16_last_layer_fp32"]
    kwargs = {
        "dtype": "bfloat16",
        "gpu-memory-utilization": 0.9,
        "max-num-seqs": 64,
        "max-num-batched-tokens": 1024,
        "logprobs-mode": "processed_logprobs",
        "enable-prefix-caching": False,
        "async-scheduling": False,
        "enable-chunked-prefill": "",
        "return-tokens-as-token-ids": "",
        "tensor-parallel-size": 1,
        "pipeline-parallel-size": 1,
        "generation-config": "vllm",
        "max_model_len": 10000,
    }
    for key, value in kwargs.items():  # _append_vllm_kwargs
        if isinstance(value, bool):
            cmd.append(f"--{key}" if value else f"--no-{key}")
            continue
        cmd.append(f"--{key}")
        if value not in [None, ""]:
            cmd.append(str(value))
    return [*cmd, "--disable-weight-updates"]


def verl_flags(model: str, response_length: int = 512) -> list[str]:
    """verl 0.9.1 (the package on the index), verl/workers/rollout/vllm_rollout/vllm_async_server.py's `args` with
    verl/trainer/config/rollout/rollout.yaml's defaults (tensor_model_parallel_size 1 here, one device) through
    utils.build_cli_args_from_config: `--key` as written (underscores), True a bare flag, a False whose vLLM default
    is False left out, a dict as JSON. `response_length` is verl's rollout.response_length (data.max_response_length,
    512 by default), its max_new_tokens."""
    override_generation_config = {"temperature": 1.0, "top_k": -1, "top_p": 1, "repetition_penalty": 1.0}
    args = {
        "dtype": "bfloat16",
        "load_format": "dummy",
        "distributed_executor_backend": "mp",
        "worker_extension_cls": "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension",
        "max_num_seqs": 256,
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 8192,
        "enable_prefix_caching": True,
        "enable_sleep_mode": True,
        "logprobs_mode": "processed_logprobs",
        "gpu_memory_utilization": 0.5,
        "disable_log_stats": True,
        "tensor_parallel_size": 1,
        "seed": 42,
        "override_generation_config": json.dumps({**override_generation_config, "max_new_tokens": response_length}),
        "hf_overrides": {},
        "scheduling_policy": "fcfs",
        "compilation_config": json.dumps({"cudagraph_mode": "FULL_AND_PIECEWISE"}),
    }
    cmd = [model]
    for key, value in args.items():
        if isinstance(value, bool):
            cmd += [f"--{key}"] if value else []
        else:
            cmd += [f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return cmd
