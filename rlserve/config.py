"""Frozen configuration objects shared by the engine, the runner and the weight-transfer backends.

Each `EngineConfig` field's `metadata` holds its `help` (and `choices` where the values are a fixed set):
rlserve.engine.frontend.args derives the command-line flags from them, so a field and its flag cannot drift apart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args

LogprobsMode = Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)
MODEL_DTYPES = ("float32", "bfloat16", "float16")
DTYPES = ("auto", *MODEL_DTYPES)
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# vLLM's --load-format values that rlserve implements: "auto" and "safetensors" read the checkpoint's safetensors
# files; "dummy" reads none (random weights of the right shapes) for a trainer that pushes the real ones first.
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# --quantization values rlserve implements (vLLM's names): FP8 projections block-wise 128x128 (fp8, DeepSeek-V3's
# and Qwen3-FP8's layout) or per-channel (fbgemm_fp8), both with activations quantized per token (rlserve.model.fp8);
# and PipelineRL's bf16_last_layer_fp32, which is the engine fields it sets: bf16 weights and activations, the LM head
# (and so the logprobs) in fp32.
QUANTIZATIONS = ("fp8", "fbgemm_fp8", "bf16_last_layer_fp32")
QUANTIZATION_FIELDS = {"bf16_last_layer_fp32": {"dtype": "bfloat16", "lm_head_dtype": "float32"}}


@dataclass(frozen=True)
class WeightTransferConfig:
    """Which weight-transfer backend the engine creates (`nccl`, `ipc`, or a registered name)."""

    backend: str = "nccl"


# vLLM 0.33's profilers (ProfilerConfig.profiler) that rlserve does not implement, and why.
UNSUPPORTED_PROFILERS = {
    "cuda": "cudaProfilerStart/Stop for an outside profiler (nsys) is not implemented; use 'torch', or nsys with "
    "its own capture range",
    "proton": "the Triton Proton profiler is not implemented; use 'torch'",
}
TORCH_PROFILER_ACTIVITIES = ("CPU", "CUDA")
# vLLM 0.33's ProfilerConfig keys that rlserve does not implement (refused by name, with why), and those it takes only
# at the value that says what rlserve does anyway.
_PROTON = "the Triton Proton profiler is not implemented (profiler 'torch' only)"
UNSUPPORTED_PROFILER_KEYS = {
    **{
        key: _PROTON
        for key in (
            "proton_profiler_dir",
            "proton_context",
            "proton_data",
            "proton_backend",
            "proton_mode",
            "proton_hook",
            "proton_output_format",
            "proton_graph_attribution",
        )
    },
    "torch_profiler_dump_cuda_time_total": "rlserve writes the trace only, no summary table",
    "capture_torch_profiler": "CUDA-graph capture is not profiled",
    "detailed_trace_annotation": "steps are annotated with their number of requests and tokens only",
    "warmup_iterations": "no torch.profiler schedule; delay_iterations and max_iterations bound the trace",
    "active_iterations": "no torch.profiler schedule; delay_iterations and max_iterations bound the trace",
    "wait_iterations": "no torch.profiler schedule; delay_iterations and max_iterations bound the trace",
}
FIXED_PROFILER_KEYS = {"ignore_frontend": (True, "rlserve traces the engine-core processes only, never the front end")}


def _is_uri(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and len(scheme) > 1  # "C://" is a drive letter


@dataclass(frozen=True)
class ProfilerConfig:
    """vLLM 0.33's `--profiler-config` (vllm.config.ProfilerConfig), the torch profiler part: `start_profile` /
    `stop_profile` record a torch.profiler trace of every engine-core process (each data-parallel rank and
    tensor-parallel rank) into `torch_profiler_dir`, one Chrome trace per rank. `profiler=None` (the default) is
    profiling off, as in vLLM. Build it from a dict with `from_dict`, which names any key rlserve lacks."""

    profiler: str | None = None  # "torch"
    torch_profiler_dir: str = ""  # made absolute here (vLLM's rule)
    torch_profiler_activities: tuple[str, ...] | None = None  # default: CPU, and CUDA on a GPU
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True  # .json.gz, else .json
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    delay_iterations: int = 0  # engine steps after start_profile before the trace starts
    max_iterations: int = 0  # engine steps traced before it stops by itself (0: until stop_profile)

    def __post_init__(self) -> None:
        if isinstance(self.profiler, str) and self.profiler in UNSUPPORTED_PROFILERS:
            why = UNSUPPORTED_PROFILERS[self.profiler]
            raise ValueError(f"profiler_config.profiler: {self.profiler!r} is not supported: {why}")
        if self.profiler not in (None, "torch"):
            raise ValueError(f"profiler_config.profiler: must be 'torch' or null, got {self.profiler!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"profiler_config.{f.name}: must be true or false, got {value!r}")
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"profiler_config.{f.name}: must be an integer >= 0, got {value!r}")
        if not isinstance(self.torch_profiler_dir, str):
            raise ValueError(f"profiler_config.torch_profiler_dir: must be a string, got {self.torch_profiler_dir!r}")
        if self.profiler is None:
            for name in ("torch_profiler_dir", "torch_profiler_activities"):
                if getattr(self, name):
                    raise ValueError(f"profiler_config.{name}: only applicable when profiler is 'torch'")
            return
        if not self.torch_profiler_dir:
            raise ValueError("profiler_config.torch_profiler_dir: must be set when profiler is 'torch'")
        if _is_uri(self.torch_profiler_dir):
            raise ValueError(
                f"profiler_config.torch_profiler_dir: a local directory, got {self.torch_profiler_dir!r} (rlserve "
                "writes traces with plain file I/O)"
            )
        object.__setattr__(self, "torch_profiler_dir", os.path.abspath(os.path.expanduser(self.torch_profiler_dir)))
        activities = self.torch_profiler_activities
        if activities is not None:
            activities = tuple(activities) if isinstance(activities, (list, tuple)) else (activities,)
            bad = [a for a in activities if a not in TORCH_PROFILER_ACTIVITIES]
            if not activities or bad or len(set(activities)) != len(activities):
                raise ValueError(
                    f"profiler_config.torch_profiler_activities: a non-empty list of distinct "
                    f"{list(TORCH_PROFILER_ACTIVITIES)}, got {list(activities)}"
                )
            object.__setattr__(self, "torch_profiler_activities", activities)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ProfilerConfig:
        """vLLM's JSON form; keys of vLLM's that rlserve does not implement are refused by name, with why."""
        known = {f.name for f in fields(cls)}
        kept = {}
        for key, value in values.items():
            if key in known:
                kept[key] = value
            elif key in FIXED_PROFILER_KEYS:
                fixed, why = FIXED_PROFILER_KEYS[key]
                if value != fixed:
                    raise ValueError(f"profiler_config.{key}: only {json.dumps(fixed)} is supported ({why})")
            elif key in UNSUPPORTED_PROFILER_KEYS:
                raise ValueError(f"profiler_config.{key}: not supported ({UNSUPPORTED_PROFILER_KEYS[key]})")
            else:
                raise ValueError(f"profiler_config.{key}: unknown key (neither vLLM nor rlserve has it)")
        return cls(**kept)

    @property
    def enabled(self) -> bool:
        return self.profiler is not None


def _option(default: Any, help: str, choices: tuple[str, ...] | None = None, human_readable: bool = False) -> Any:
    """A field with its command-line help (and allowed values, checked by EngineConfig too). `human_readable`: a
    count of tokens or bytes, which its flag also takes as vLLM writes them (`4k` = 4000, `4K` = 4096)."""
    return field(default=default, metadata={"help": help, "choices": choices, "human_readable": human_readable})


def resolve_device(device: str) -> str:
    """`auto` is CUDA when torch finds a GPU, else the CPU (vLLM's behaviour: a GPU machine never silently gets the
    CPU); any other value is kept."""
    if device != "auto":
        return device
    import torch  # here, not at the top: this module stays importable (and the flags parseable) without torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(metadata={"help": "Hugging Face model directory or hub id (rlserve.hub.resolve_model)"})
    dtype: str = _option("auto", "weights and activations (auto: the checkpoint's)", DTYPES)
    device: str = _option("auto", "auto (CUDA when torch finds a GPU, else CPU), cpu or cuda[:N]")
    seed: int = _option(0, "seed of the engine's random state")
    max_model_len: int | None = _option(
        None, "longest sequence, prompt and output (default: the model's)", human_readable=True
    )
    # None: chosen for the device in the engine's process (rlserve.engine.core.device_defaults, vLLM 0.33's tiers).
    max_num_seqs: int | None = _option(
        None, "most requests in one step (default: 1024 on a GPU of >= 70 GiB but an A100 or a GB10, else 256)"
    )
    max_num_batched_tokens: int | None = _option(
        None,
        "most tokens in one step (default: 16384 on a GPU of >= 70 GiB but an A100 or a GB10, else 8192)",
        human_readable=True,
    )
    block_size: int = _option(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _option(
        None, "KV cache size in blocks (default: from --gpu-memory-utilization, or --cpu-kv-cache-bytes on CPU)"
    )
    gpu_memory_utilization: float = _option(0.9, "fraction of the GPU's memory the engine may use")
    cpu_kv_cache_bytes: int = _option(1 << 30, "KV cache size in bytes on CPU", human_readable=True)
    enable_prefix_caching: bool = _option(True, "reuse the KV of prompt prefixes other requests computed")
    enable_chunked_prefill: bool = _option(True, "split long prompts over several steps")
    max_logprobs: int = _option(
        20, "most logprobs (and prompt_logprobs) a request may ask for; -1: up to the vocabulary size (vLLM's)"
    )
    logprobs_mode: LogprobsMode = _option("raw_logprobs", "what logprobs report", LOGPROBS_MODES)
    lm_head_dtype: str | None = _option(
        None, "float32 runs the LM head in fp32 (default: the model's dtype)", ("float32", "auto")
    )
    quantization: str | None = _option(
        None,
        "fp8: the decoder's projections (and a MoE model's experts) in FP8 with 128x128 block scales "
        "(weight_scale_inv), activations per token and 128 features; fbgemm_fp8: per-channel weight scales "
        "(weight_scale), activations per token. A checkpoint in the model dtype is quantized at load and on every "
        "weight update; an FP8 checkpoint (its config's quantization_config) loads as it is, also without this. "
        "The LM head stays in the model dtype. "
        "bf16_last_layer_fp32: dtype bfloat16 with lm_head_dtype float32",
        QUANTIZATIONS,
    )
    enforce_eager: bool = _option(False, "no CUDA graphs")
    async_scheduling: bool = _option(
        True,
        "schedule and launch step N+1 before reading back step N, so host work overlaps device work",
    )
    attention_backend: str = _option("auto", "attention kernels", ATTENTION_BACKENDS)
    batch_invariant: bool = _option(
        False,
        "compute every request the same way whatever the batch (rlserve.model.batch_invariant): tokens and logprobs "
        "do not depend on what else runs, and equal rlserve's trainer-side forward (rlserve.rl.train_forward) bit "
        "for bit; slower",
    )
    grouped_prefix_attention: bool = _option(
        False,
        "decode attention reads the KV blocks that sequences share at the start of their context (a GRPO group's "
        "prompt, a conversation's earlier turns) once per step for the whole group, merging by log-sum-exp "
        "(Hydragen-style; same results within rounding; a second decode CUDA graph per batch size); off by default "
        "until measured on a GPU; not with batch_invariant or tensor_parallel_size > 1",
    )
    enable_return_routed_experts: bool = _option(
        False,
        "return, with each finished sample, the experts a MoE model's router chose for each token and layer (vLLM's "
        "option; CompletionOutput.routed_experts), so a trainer can replay that routing",
    )
    stream_interval: int = _option(
        1,
        "tokens per streamed output (vLLM's option): larger values cut per-token work for many concurrent streams; "
        "requests with stop strings still stream every token",
    )
    worker_extension_cls: str | None = _option(
        None, "'package.module:Class' whose methods join the worker, for collective_rpc (vLLM's option)"
    )
    weight_transfer_config: WeightTransferConfig | None = _option(
        None, 'JSON, e.g. \'{"backend": "nccl"}\'; enables live weight updates'
    )
    # Not a flag (`rlserve serve --allowed-weight-dirs` sets it): the directories under which the core itself lets
    # load_weights_from_dir and reload_weights(weights_path=...) read a checkpoint, whoever calls; None (the Python
    # API's default, its caller owning the process) allows any.
    allowed_weight_dirs: tuple[str, ...] | None = None
    profiler_config: ProfilerConfig | None = _option(
        None,
        'JSON, vLLM\'s, e.g. \'{"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}\': start_profile/'
        "stop_profile (and POST /start_profile, /stop_profile with the RL API) write a torch.profiler trace of every "
        "engine-core process there",
    )
    tensor_parallel_size: int = _option(
        1,
        "GPUs one engine core splits the model over (vLLM's option): rank 0 in the core process, the others in "
        "processes of their own; on CUDA the core's ranks take consecutive GPUs from its device on, on CPU they share "
        "the host (gloo)",
    )
    data_parallel_size: int = _option(
        1,
        "engine cores behind the one front end (vLLM's option), each a process with a whole copy of the model: on "
        "CUDA core i runs on cuda:i; requests go to the least-loaded core, requests sharing a prefix to the same one",
    )
    data_parallel_backend: str = _option(
        "mp",
        "how the data-parallel engine cores are started (vLLM's option): mp, processes of this host; ray, Ray actors "
        "in a placement group of one bundle per rank (a GPU each on CUDA), across the nodes of the cluster "
        "(RAY_ADDRESS, else a local one); needs the ray extra",
        ("mp", "ray"),
    )
    # Which of the data_parallel_size cores this config is for: set by the front end for each core it starts
    # (for_data_parallel_rank), never a flag (vLLM's --data-parallel-rank starts one core of an externally
    # load-balanced deployment, which rlserve does not offer).
    data_parallel_rank: int = field(default=0, metadata={"help": "index of this engine core among the DP ranks"})
    data_parallel_lockstep: bool = _option(
        False,
        "every core steps while any core has work, idle ones running dummy steps (vLLM's DP waves, which expert-"
        "parallel MoE needs); pause is then agreed by all cores in two phases. Needs data_parallel_size > 1",
    )
    enable_expert_parallel: bool = _option(
        False,
        "a MoE model's experts split over the data-parallel cores (vLLM's option; rlserve.model.expert_parallel): "
        "attention stays data-parallel, each sparse layer exchanges tokens between the cores. Needs "
        "data_parallel_size > 1, turns on data_parallel_lockstep, and runs without async scheduling or CUDA graphs",
    )
    data_parallel_sync_interval: int = _option(
        32, "in lockstep: steps between the cores' checks of whether any has work left (a wave ends at a check)"
    )
    data_parallel_master_ip: str = _option(
        "127.0.0.1", "in lockstep: the address rank 0 serves the cores' rendezvous on (vLLM's --data-parallel-address)"
    )
    data_parallel_master_port: int = _option(
        0, "in lockstep: the port of that rendezvous (0: the front end picks a free one)"
    )
    load_format: str = _option(
        "auto",
        "how the weights are loaded (vLLM's option): auto/safetensors read the checkpoint; dummy starts with random "
        "weights and reads none, for a trainer that sends the real ones first (or collective_rpc reload_weights)",
        LOAD_FORMATS,
    )
    revision: str | None = _option(
        None, "branch, tag or commit of a Hugging Face hub model (default: main); ignored for a directory"
    )
    weight_transfer_timeout_s: float = _option(
        60.0,
        "seconds the weight-transfer rendezvous (init_weight_transfer_engine) and each receive of an update may wait "
        "for the trainer; a trainer silent or gone for longer has its update abandoned",
    )
    enable_lora: bool = _option(
        False,
        "serve LoRA adapters (vLLM's option): requests name one (lora_request), add_lora/remove_lora load and unload "
        "them; a dense decoder on one GPU (not with tensor_parallel_size, data_parallel_size > 1 or expert parallel)",
    )
    max_loras: int = _option(1, "adapters loaded at once (vLLM's option): each projection holds this many slots")
    max_lora_rank: int = _option(16, "largest adapter rank served (vLLM's option): the slots' rank")
    weight_update_snapshot: bool = _option(
        False,
        "keep a host copy of the weights at each start_weight_update (host memory: one model's worth), so that an "
        "abandoned update restores them; without it, an update abandoned after writing refuses generation until a "
        "full update",
    )

    def __post_init__(self) -> None:
        # Resolved once, here, so the config every process receives names the device it runs on.
        object.__setattr__(self, "device", resolve_device(self.device))
        for f in fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")
        self._apply_quantization()
        positive_counts = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_logprobs", "stream_interval")
        for name in (*positive_counts, "tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1 and name != "max_logprobs":  # None: the device's default
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0 (or -1: no cap below the vocabulary), got {self.max_logprobs}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.weight_transfer_timeout_s > 0:  # NaN too
            raise ValueError(f"weight_transfer_timeout_s must be > 0, got {self.weight_transfer_timeout_s}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be in 0..{self.data_parallel_size - 1}, got {self.data_parallel_rank}"
            )
        if self.enable_expert_parallel:
            if self.data_parallel_size < 2:
                raise ValueError(
                    "enable_expert_parallel: needs data_parallel_size > 1 (the experts are split over the "
                    "data-parallel ranks)"
                )
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "enable_expert_parallel: not with tensor_parallel_size > 1 yet (MoE layers are not "
                    "tensor-parallel, so a rank's experts would need splitting over its tensor-parallel ranks too)"
                )
            # The layers' exchanges need every rank in every forward: lockstep, whether or not it was asked for, and
            # one forward per step on every rank, which async scheduling does not keep (a batch's first step launches
            # two, its last none).
            object.__setattr__(self, "data_parallel_lockstep", True)
            object.__setattr__(self, "async_scheduling", False)
        if self.data_parallel_lockstep and self.data_parallel_size < 2:
            # With one core there is no peer to keep in step: the flag would do nothing, so it is refused.
            raise ValueError(
                "data_parallel_lockstep: needs data_parallel_size > 1 (one engine core has no peer to step with)"
            )
        profiler = self.profiler_config
        if profiler is not None:
            if not isinstance(profiler, ProfilerConfig):
                raise ValueError(f"profiler_config: expected a ProfilerConfig (or its JSON), got {profiler!r}")
            if "CUDA" in (profiler.torch_profiler_activities or ()) and not self.device.startswith("cuda"):
                raise ValueError(
                    f"profiler_config.torch_profiler_activities: CUDA needs a CUDA device, not {self.device}"
                )
        if self.max_loras < 1 or self.max_lora_rank < 1:
            name = "max_loras" if self.max_loras < 1 else "max_lora_rank"
            raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.enable_lora:
            if self.enable_expert_parallel:
                raise ValueError("enable_lora: not with enable_expert_parallel (adapters need a dense decoder)")
            for name in ("tensor_parallel_size", "data_parallel_size"):
                if getattr(self, name) > 1:
                    raise ValueError(f"enable_lora: not with {name} > 1 yet (adapters live on one rank)")
        self._check_grouped_prefix_attention()
        if self.data_parallel_sync_interval < 1:
            raise ValueError(f"data_parallel_sync_interval must be >= 1, got {self.data_parallel_sync_interval}")
        if not self.data_parallel_lockstep:
            lockstep_only = ("data_parallel_sync_interval", "data_parallel_master_ip", "data_parallel_master_port")
            for f in fields(self):
                if f.name in lockstep_only and getattr(self, f.name) != f.default:
                    raise ValueError(f"{f.name}: only used with data_parallel_lockstep (independent ranks never sync)")
        tp, first_gpu = self.tensor_parallel_size, self.data_parallel_rank * self.tensor_parallel_size
        own_gpus = {f"cuda:{i}" for i in range(first_gpu, first_gpu + tp)}  # its tensor-parallel ranks'
        if self.data_parallel_size > 1 and self.device.startswith("cuda:") and self.device not in own_gpus:
            raise ValueError(
                f"device: data-parallel core {self.data_parallel_rank} runs on cuda:{first_gpu}, not {self.device}; "
                "give device cuda and pick the GPUs with CUDA_VISIBLE_DEVICES"
            )

    def _check_grouped_prefix_attention(self) -> None:
        if not self.grouped_prefix_attention:
            return
        if self.batch_invariant:
            raise ValueError(
                "grouped_prefix_attention: not with batch_invariant (splitting a sequence's keys into a shared prefix "
                "and its own part changes the order of its sums, so its bits would depend on the batch)"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                "grouped_prefix_attention: not with tensor_parallel_size > 1 yet (the groups are found on rank 0 and "
                "are not sent to the other ranks)"
            )

    def _apply_quantization(self) -> None:
        """bf16_last_layer_fp32 is the fields it sets (a conflicting value given for one is refused); FP8 GEMMs are
        not batch-invariant."""
        for name, value in QUANTIZATION_FIELDS.get(self.quantization, {}).items():
            given = getattr(self, name)
            if given not in (value, next(f.default for f in fields(self) if f.name == name)):
                raise ValueError(f"quantization {self.quantization} sets {name} {value}, but {name} {given} was given")
            object.__setattr__(self, name, value)
        if self.quantization in ("fp8", "fbgemm_fp8") and self.batch_invariant:
            raise ValueError(
                f"quantization {self.quantization}: not with batch_invariant (the FP8 GEMMs are not batch-invariant)"
            )

    # What vLLM worker code reads of a `vllm_config` beyond rlserve's fields: extensions get this config as their
    # worker's and model runner's `vllm_config` (verl's reads both of these).
    @property
    def model_config(self) -> EngineConfig:
        """vLLM's model part of its config: rlserve's one config holds the model's settings."""
        return self

    @property
    def speculative_config(self) -> None:
        """vLLM's: rlserve has no speculative decoding (extensions check it before syncing a drafter's weights)."""
        return None

    def for_data_parallel_rank(self, rank: int) -> EngineConfig:
        """The config of engine core `rank`: on CUDA it takes the rank's own GPUs (tensor_parallel_size of them from
        cuda:rank*tensor_parallel_size on), on CPU it shares the host."""
        device = f"cuda:{rank * self.tensor_parallel_size}" if self.device.startswith("cuda") else self.device
        return replace(self, data_parallel_rank=rank, device=device)


@contextmanager
def set_current_vllm_config(vllm_config: EngineConfig) -> Iterator[None]:
    """vLLM's context for code that reads the engine's config ambiently (kernels built while weights are processed),
    which worker extensions wrap weight loads in (`set_current_vllm_config(self.vllm_config)`). rlserve's layers are
    given their settings when built and read none ambiently, so there is nothing to set; the argument is checked,
    since code that passes anything but the worker's `vllm_config` expects vLLM's config objects."""
    if not isinstance(vllm_config, EngineConfig):
        raise TypeError(
            f"set_current_vllm_config: vllm_config: expected the worker's vllm_config, got {type(vllm_config)!r}"
        )
    yield
