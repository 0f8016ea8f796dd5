"""Frozen configuration objects shared by the engine, the runner and the weight-transfer backends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
LogprobsMode = Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]
MODEL_DTYPES = ("float32", "bfloat16", "float16")
DTYPES = ("auto", *MODEL_DTYPES)


@dataclass(frozen=True)
class WeightTransferConfig:
    """Which weight-transfer backend the engine creates (`nccl`, `ipc`, or a registered name)."""

    backend: str = "nccl"


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from gpu_memory_utilization (GPU) or cpu_kv_cache_bytes
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_logprobs: int = 20
    logprobs_mode: LogprobsMode = "raw_logprobs"
    lm_head_dtype: str | None = None  # "float32" runs the LM head in fp32
    enforce_eager: bool = False
    # Schedule and launch step N+1 before reading back step N, so host work overlaps device work.
    async_scheduling: bool = True
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"
    # Every row computed the same way whatever the batch (rlserve.model.batch_invariant): a request's tokens and
    # logprobs do not depend on what else runs, and equal rlserve's trainer-side forward bit for bit. Slower.
    batch_invariant: bool = False
    # "package.module:Class" whose methods join the engine's worker, for collective_rpc (vLLM's worker_extension_cls).
    worker_extension_cls: str | None = None
    weight_transfer_config: WeightTransferConfig | None = field(default=None)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.lm_head_dtype not in (None, "float32", "auto"):
            raise ValueError(f"lm_head_dtype must be 'float32' or None, got {self.lm_head_dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_logprobs"):
            if getattr(self, name) < 1 and name != "max_logprobs":
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
