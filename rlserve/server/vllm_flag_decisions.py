"""What `rlserve serve` does with each flag of `vllm serve` in releases 0.22-0.33: one table, `DECISIONS`, one
decision per flag (vLLM's dest name; the flags themselves are vllm_flags.py's facts):

- `Implemented`: rlserve has the feature; its parser defines the flag (vLLM's other spellings become aliases of it).
- `NoOp`: accepted with any value, because it cannot change what rlserve computes or serves (the reason says why, in
  `--help` and in a start-up warning when given).
- `Refused`: a usage error naming the flag and the reason, unless given one of `accepted`, the values that ask for
  what rlserve does anyway (for a switch, "true" or "false").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Implemented:
    """rlserve's parser has the flag; `flag` names rlserve's spelling where it differs from vLLM's."""

    flag: str | None = None


@dataclass(frozen=True)
class NoOp:
    reason: str


@dataclass(frozen=True)
class Refused:
    reason: str
    accepted: tuple[str, ...] = ()


Decision = Implemented | NoOp | Refused

# ---- reasons, shared by the flags they apply to ----
_TEXT_ONLY = (
    "rlserve serves text-only models and refuses image, audio and video inputs: multimodal settings apply to nothing"
)
_LOGS = "logging only: rlserve's logs follow --log-level and --uvicorn-log-level; no request or output changes"
_NO_SERIES = (
    "adds vLLM Prometheus series rlserve does not export (GET /metrics lists what it has); no request or output changes"
)
_SPEED = "a vLLM kernel or compiler tuning knob rlserve's own kernels do not have; it changes speed, never outputs"
_ONE_HOST = (
    "rlserve runs its engine cores on one host, started by the front end: multi-node and externally load-balanced "
    "deployments are not supported"
)
_NO_PP = "pipeline and context parallelism are not supported yet (tensor and data parallelism are)"
_NO_SPEC = "speculative decoding is not supported yet"
_NO_KV_TRANSFER = (
    "KV cache transfer, offload and connectors are not supported: the KV cache lives in the engine core's device memory"
)
_NO_PLUGIN = "rlserve loads no plugin or user code into the server"
_NO_MAMBA = "rlserve has no Mamba/SSM models"
_NO_POOLING = "rlserve generates text; pooling, embedding and scoring models are not supported"
_NO_TLS = "rlserve serves plain HTTP on one port: put TLS, CORS, a root path or a Unix socket in a proxy in front"
_NOT_YET = "not implemented in rlserve yet"
_AUTO = ("auto",)
_OFF = ("false",)

DECISIONS: dict[str, Decision] = {
    # ---- rlserve's own flags with vLLM's names (serve_flags.py, or derived from EngineConfig in engine/args.py) ----
    **{
        dest: Implemented()
        for dest in (
            "api_server_count",
            "lora_modules",
            "chat_template",
            "trust_request_chat_template",
            "return_tokens_as_token_ids",
            "enable_auto_tool_choice",
            "tool_call_parser",
            "host",
            "port",
            "uvicorn_log_level",
            "api_key",
            "model",
            "trust_remote_code",
            "dtype",
            "seed",
            "revision",
            "max_model_len",
            "quantization",
            "enforce_eager",
            "enable_return_routed_experts",
            "max_logprobs",
            "logprobs_mode",
            "served_model_name",
            "generation_config",
            "enable_sleep_mode",
            "load_format",
            "attention_backend",
            "reasoning_parser",
            "tensor_parallel_size",
            "data_parallel_size",
            "data_parallel_backend",
            "enable_expert_parallel",
            "worker_extension_cls",
            "block_size",
            "gpu_memory_utilization",
            "enable_prefix_caching",
            "enable_lora",
            "max_loras",
            "max_lora_rank",
            "log_level",
            "max_num_batched_tokens",
            "max_num_seqs",
            "enable_chunked_prefill",
            "async_scheduling",
            "stream_interval",
            "profiler_config",
            "weight_transfer_config",
            "disable_log_stats",
            "override_generation_config",
            "additional_config",
            "distributed_executor_backend",
        )
    },  # fmt: skip
    "data_parallel_address": Implemented("--data-parallel-master-ip"),
    "dp_sync_interval": Implemented("--data-parallel-sync-interval"),
    "num_gpu_blocks_override": Implemented("--num-kv-blocks"),
    "pipeline_parallel_size": Refused(_NO_PP, ("1",)),
    # ---- no-ops: the reason says why the value cannot matter ----
    **{
        dest: NoOp(_TEXT_ONLY)
        for dest in (
            "mm_processor_cache_gb",
            "mm_processor_cache_type",
            "mm_shm_cache_max_object_size_mb",
            "mm_hasher_algorithm",
            "limit_mm_per_prompt",
            "media_io_kwargs",
            "mm_processor_kwargs",
            "mm_encoder_tp_mode",
            "mm_encoder_attn_backend",
            "mm_encoder_attn_dtype",
            "mm_encoder_fp8_scale_path",
            "mm_encoder_fp8_scale_save_path",
            "mm_encoder_fp8_scale_save_margin",
            "interleave_mm_strings",
            "skip_mm_profiling",
            "video_pruning_rate",
            "video_pruning_method",
            "mm_tensor_ipc",
            "mm_processor_device",
            "mm_ipc_gpu_memory_gb",
            "mm_device_do_normalize",
            "allowed_local_media_path",
            "allowed_media_domains",
            "disable_chunked_mm_input",
            "trust_request_mm_kwargs",
            "default_mm_loras",
            "enable_tower_connector_lora",
            "language_model_only",
        )
    },  # fmt: skip
    **{
        dest: NoOp(_LOGS)
        for dest in (
            "max_log_len",
            "enable_log_outputs",
            "enable_log_deltas",
            "log_error_stack",
            "enable_log_requests",
            "disable_uvicorn_access_log",
            "disable_access_log_for_endpoints",
            "aggregate_engine_logging",
            "enable_logging_iteration_details",
            "log_config_file",
            "logging_config",
        )
    },  # fmt: skip
    **{
        dest: NoOp(_NO_SERIES)
        for dest in (
            "kv_cache_metrics",
            "kv_cache_metrics_sample",
            "cudagraph_metrics",
            "enable_mfu_metrics",
            "show_hidden_metrics_for_version",
            "per_request_spec_decode_metrics",
            "enable_layerwise_nvtx_tracing",
        )
    },  # fmt: skip
    **{
        dest: NoOp(_SPEED)
        for dest in (
            "compilation_config",
            "cudagraph_capture_sizes",
            "max_cudagraph_capture_size",
            "enable_flashinfer_autotune",
            "ir_op_priority",
            "optimization_level",
            "performance_mode",
            "disable_custom_all_reduce",
            "max_parallel_loading_workers",
            "use_tqdm_on_load",
            "safetensors_load_strategy",
            "safetensors_prefetch_num_threads",
            "safetensors_prefetch_block_size",
            "renderer_num_workers",
            "numa_bind",
            "numa_bind_nodes",
            "numa_bind_cpus",
            "ray_workers_use_nsight",
            "enable_shm_tensor_arena",
            "disable_nccl_for_dp_synchronization",
            "monokernel",
            "enable_cumem_allocator",
            "jit_monitor_mode",
            "jit_monitor_verbose",
        )
    },  # fmt: skip
    "disable_cascade_attn": NoOp("rlserve has no cascade attention, so there is none to turn off"),
    "disable_hybrid_kv_cache_manager": NoOp("rlserve has one KV cache manager for every layer: nothing to disable"),
    "code_revision": NoOp("rlserve runs no code from the model repository (see --trust-remote-code)"),
    "allow_deprecated_quantization": NoOp(
        "it only allows deprecated vLLM methods; rlserve's --quantization names its own"
    ),
    "data_parallel_rpc_port": NoOp(
        "rlserve's front end reaches its data-parallel cores through pipes it creates on this host: no RPC port opens"
    ),
    "enable_scale_out": NoOp(
        "rlserve always serves /inference/v1/generate, /v1/completions/render and /v1/chat/completions/render (TRL "
        "sets it for these); vLLM's derender, /v1/messages/render, /v1/responses/render and "
        "/inference/v1/abort_requests are not implemented"
    ),
    "max_cpu_loras": NoOp(
        "rlserve keeps no CPU cache of adapters: an adapter sits in one of --max-loras device slots from its load "
        "until its unload"
    ),
    # ---- accepted only with the value that asks for what rlserve does anyway ----
    "all2all_backend": Refused(
        "rlserve's expert parallel always gathers every token on every rank and reduces the experts' outputs "
        "(rlserve.model.expert_parallel); other exchanges are not implemented",
        ("allgather_reducescatter", "naive"),
    ),
    "scheduling_policy": Refused(
        "rlserve schedules first come, first served; priority scheduling is not implemented", ("fcfs",)
    ),
    "hf_overrides": Refused("overriding the model's config.json is not implemented (only {} is accepted)", ("{}",)),
    "kv_cache_dtype": Refused("the KV cache is in the model's dtype; fp8 KV caches are not implemented", _AUTO),
    "runner": Refused("rlserve runs generative models only", ("auto", "generate")),
    "convert": Refused("rlserve converts no model into another kind", ("auto", "none")),
    "tokenizer_mode": Refused("rlserve uses the model's Hugging Face tokenizer", ("auto", "hf")),
    "config_format": Refused("rlserve reads Hugging Face config.json", ("auto", "hf")),
    "model_impl": Refused(
        "rlserve runs its own model classes, as vLLM's own implementation (not the Transformers backend)",
        ("auto", "vllm"),
    ),
    "worker_cls": Refused("rlserve's worker is its own (add methods with --worker-extension-cls)", ("auto",)),
    "response_role": Refused("chat completions answer as the assistant", ("assistant",)),
    "chat_template_content_format": Refused("message content is rendered as the chat template reads it", ("auto",)),
    "lora_dtype": Refused("adapters run in the model's dtype", _AUTO),
    "cpu_offload_gb": Refused("weights stay in device memory; offload is not implemented", ("0",)),
    "expert_placement_strategy": Refused("experts are placed in contiguous blocks per rank", ("linear",)),
    "sleep_mode_backend": Refused("rlserve's /sleep frees the KV cache and weights its own way", _AUTO),
    **{
        dest: Refused(f"not implemented in rlserve (only the default {_AUTO[0]})", _AUTO)
        for dest in (
            "moe_backend",
            "linear_backend",
            "sparse_indexer_topk_backend",
            "mamba_backend",
            "gdn_prefill_backend",
            "kda_prefill_backend",
            "kda_decode_backend",
            "mamba_ssu_algorithm",
        )
    },  # fmt: skip
    **{
        dest: Refused(_NOT_YET, _OFF)
        for dest in (
            "skip_tokenizer_init",
            "enable_prompt_embeds",
            "enable_dbo",
            "enable_eplb",
            "enable_elastic_ep",
            "fully_sharded_loras",
            "enable_fault_tolerance",
            "disable_sliding_window",
            "kv_sharing_fast_prefill",
            "enable_prompt_tokens_details",
            "enable_force_include_usage",
            "enable_server_load_tracking",
            "enable_tokenizer_info_endpoint",
            "tokens_only",
            "return_sampling_mask",
            "use_fp64_gumbel",
            "enable_trace_replay",
            "enable_mm_embeds",
            "mm_encoder_only",
            "exclude_tools_when_tool_choice_none",
            "enable_request_id_headers",
            "enable_offline_docs",
            "enable_flash_late_interaction",
            "headless",
            "grpc",
            "enable_hc_sp",
            "enable_batch_sharded_sampling",
            "enable_ep_weight_filter",
            "sleep_mode_offload_cudagraph",
            "enable_nccl_comm_suspend",
            "specialize_active_lora",
            "enable_mixed_moe_lora_format",
            "enable_moe_shared_loras",
            "enable_mamba_cache_stochastic_rounding",
            "enable_mamba_shared_prefix_checkpoint",
            "use_replayssm",
            "dcp_q_replicate",
            "long_prefill_token_threshold_adaptive",
            "scheduler_reserve_full_isl",
            "swa_bounded_replay",
            "cohere_is_reasoning_model",
            "fail_on_environ_validation",
            "disable_fastapi_docs",
            "allow_credentials",
            "enable_ssl_refresh",
            "data_parallel_hybrid_lb",
            "data_parallel_external_lb",
            "data_parallel_multi_port_external_lb",
        )
    },  # fmt: skip
    # ---- refused ----
    **{
        dest: Refused(_ONE_HOST)
        for dest in (
            "master_addr",
            "master_port",
            "nnodes",
            "node_rank",
            "data_parallel_rank",
            "data_parallel_start_rank",
            "data_parallel_size_local",
            "data_parallel_supervisor_port",
            "dp_supervisor_probe_interval_s",
            "dp_supervisor_probe_timeout_s",
            "dp_supervisor_probe_failure_threshold",
            "elastic_ep_max_dp_size",
            "device_ids",
            "distributed_timeout_seconds",
            "cpu_distributed_timeout_seconds",
        )
    },  # fmt: skip
    **{
        dest: Refused(_NO_PP)
        for dest in (
            "decode_context_parallel_size",
            "dcp_comm_backend",
            "dcp_kv_cache_interleave_size",
            "cp_kv_cache_interleave_size",
            "prefill_context_parallel_size",
            "ubatch_size",
            "dbo_decode_token_threshold",
            "dbo_prefill_token_threshold",
        )
    },  # fmt: skip
    **{dest: Refused(_NO_SPEC) for dest in ("speculative_config", "spec_method", "spec_model", "spec_tokens")},
    **{
        dest: Refused(_NO_KV_TRANSFER)
        for dest in (
            "kv_transfer_config",
            "kv_events_config",
            "ec_transfer_config",
            "ec_manager_config",
            "kv_offloading_size",
            "kv_offloading_backend",
            "offload_backend",
            "cpu_offload_params",
            "offload_group_size",
            "offload_num_in_group",
            "offload_prefetch_step",
            "offload_params",
            "kv_cache_memory_bytes",
            "prefix_cache_retention_interval",
            "kv_cache_dtype_skip_layers",
        )
    },  # fmt: skip
    **{
        dest: Refused(_NO_PLUGIN)
        for dest in (
            "tool_parser_plugin",
            "reasoning_parser_plugin",
            "logits_processors",
            "io_processor_plugin",
            "middleware",
            "model_class_overrides",
            "scheduler_cls",
            "tool_server",
        )
    },  # fmt: skip
    **{
        dest: Refused(_NO_MAMBA)
        for dest in (
            "mamba_cache_dtype",
            "mamba_ssm_cache_dtype",
            "mamba_block_size",
            "mamba_cache_mode",
            "mamba_cache_philox_rounds",
            "replayssm_buffer_len",
            "prefix_match_unit",
        )
    },  # fmt: skip
    **{dest: Refused(_NO_POOLING) for dest in ("pooler_config", "max_lora_cls_labels")},
    **{
        dest: Refused(_NO_TLS)
        for dest in (
            "ssl_keyfile",
            "ssl_certfile",
            "ssl_ca_certs",
            "ssl_cert_reqs",
            "ssl_ciphers",
            "root_path",
            "uds",
            "allowed_origins",
            "allowed_methods",
            "allowed_headers",
            "grpc_port",
            "h11_max_incomplete_event_size",
            "h11_max_header_count",
        )
    },  # fmt: skip
    "config": Refused("rlserve reads no YAML config file: give its flags on the command line"),
    "tokenizer": Refused("the tokenizer is the model directory's own"),
    "tokenizer_revision": Refused("the tokenizer is the model directory's own, at --revision"),
    "hf_config_path": Refused("the config is the model directory's own config.json"),
    "hf_token": Refused("set HF_TOKEN in the environment, which the Hugging Face hub client reads"),
    "download_dir": Refused("models download into the Hugging Face cache (HF_HOME / HF_HUB_CACHE)"),
    "ignore_patterns": Refused("rlserve downloads a model's safetensors and config files only"),
    "model_loader_extra_config": Refused("rlserve's loader takes no extra config"),
    "pt_load_map_location": Refused("rlserve loads safetensors only"),
    "quantization_config": Refused("online quantization is not implemented (see --quantization)"),
    "sleep_preserve_parameter_names": Refused(_NOT_YET),
    "default_chat_template_kwargs": Refused(_NOT_YET + ": send chat_template_kwargs with each request"),
    "reasoning_effort_map": Refused(_NOT_YET),
    "reasoning_config": Refused(_NOT_YET),
    "tool_strict_level": Refused(_NOT_YET),
    "sse_keep_alive_interval": Refused(_NOT_YET),
    "cohere_format": Refused("the Cohere API is not served"),
    "anthropic_disabled_thinking_effort": Refused("the Anthropic API is not served"),
    "fingerprint_mode": Refused(_NOT_YET),
    "fingerprint_value": Refused(_NOT_YET),
    "lora_target_modules": Refused("adapters apply to the modules their own adapter_config.json names"),
    "prefix_caching_hash_algo": Refused("rlserve hashes prefix blocks its own way"),
    "max_num_scheduled_tokens": Refused("use --max-num-batched-tokens, the most tokens in one step"),
    "max_num_active_seqs": Refused("use --max-num-seqs, the most requests in one step"),
    "max_num_queued_reqs": Refused(_NOT_YET),
    "max_num_queued_tokens": Refused(_NOT_YET),
    "long_prefill_token_threshold": Refused(_NOT_YET),
    "max_long_partial_prefills": Refused(_NOT_YET),
    "max_num_partial_prefills": Refused(_NOT_YET),
    "watermark": Refused(_NOT_YET),
    "watermark_config": Refused(_NOT_YET),
    "prefill_schedule_interval": Refused(_NOT_YET),
    "diffusion_config": Refused(_NO_POOLING),
    "attention_config": Refused("use --attention-backend"),
    "engram_config": Refused(_NOT_YET),
    "kernel_config": Refused(_NOT_YET),
    "structured_outputs_config": Refused("structured (guided) outputs are not implemented"),
    "aux_output_config": Refused(_NOT_YET),
    "watchdog_config": Refused(_NOT_YET),
    "shutdown_timeout": Refused(_NOT_YET),
    "eplb_config": Refused("the expert-parallel load balancer is not implemented"),
    "fault_tolerance_config": Refused(_NOT_YET),
    "otlp_traces_endpoint": Refused("rlserve exports no OpenTelemetry traces"),
    "collect_detailed_traces": Refused("rlserve exports no OpenTelemetry traces"),
    "custom_histogram_buckets": Refused(_NOT_YET),
    "enable_per_request_metrics": Refused(_NOT_YET, _OFF),
    "calculate_kv_scales": Refused("fp8 KV caches are not implemented, so there are no KV scales", _OFF),
    "enable_bf16x3_router_gemm": Refused(_NOT_YET, _OFF),
    "enable_mamba_fine_grained_prefix_cache": Refused(_NO_MAMBA, _OFF),
    "override_attention_dtype": Refused("attention runs in the model's dtype"),
}


def decision_of(dest: str) -> Decision:
    try:
        return DECISIONS[dest]
    except KeyError:
        raise KeyError(f"vLLM flag {dest!r} has no decision in rlserve.server.vllm_flag_decisions.DECISIONS") from None
