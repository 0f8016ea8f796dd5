"""Weight-transfer backends that receive what prime-rl's and PipelineRL's trainers broadcast, in their wire formats,
over a group formed as vLLM's `StatelessProcessGroup` + `PyNcclCommunicator` (`stateless_group.py`).

Both are engine backends like `nccl` (0.24 shape: tensors go through the engine's loader, which checks each batch
before writing any of it and records what it wrote), used by the framework routes
(`rlserve/server/framework_routes.py`).

- `prime_rl` (prime-rl 559b4477, `prime_rl/transports/weights/nccl.py` sends, `.../worker/nccl.py` receives): the
  group is rank 0 the trainer, rank `rank_offset + worker + 1` of `inference_world_size + 1`. One update is an int64
  count of state dicts (the non-layer weights, then one per layer), and per state dict an int64 byte count, the
  pickled metadata `{torch.dtype: [(name, torch.Size, numel), ...]}` as uint8, then one concatenated tensor per dtype.
  The metadata arrives in the stream, so it is checked per state dict (by the loader), not before the first byte.
  With `quantize_in_weight_transfer` (an engine serving block-wise fp8 only) the trainer's
  `preprocess_layer_quantized` sends each layer in vLLM's kernel format (`convert_layer_to_vllm_kernel(...,
  quantize_fp8=True)`): 2-d projection weights float8_e4m3fn with fp32 `weight_scale_inv` [rows/128, cols/128], fused
  projections under their fused names (`gate_up_proj` = gate and up stacked, quantized as one tensor); the non-layer
  weights as they are. The fused ones are split into checkpoint tensors (`unfuse_weights`), then checked and
  loaded as any FP8 update (its scales straight into the engine's: nothing requantized).
- `pipelinerl` (PipelineRL 58d39345, `pipelinerl/vllm1.py`): rank `1 + actor_llm_idx * actor_ngpus + worker`; the
  trainer posts the metadata (`parameters_info`) over HTTP and broadcasts each parameter in that order, in its dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch

from rlserve.dtypes import dtype_from_name, dtype_name
from rlserve.weight_transfer.base import (
    LoadWeightsFn,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightUpdateRefused,
)
from rlserve.weight_transfer.base import WeightTransferUpdateInfo as _UpdateInfo
from rlserve.weight_transfer.framework_group import StatelessGroupMember
from rlserve.weight_transfer.nccl import DEFAULT_TIMEOUT_S, MAX_WORLD_SIZE
from rlserve.weight_transfer.stateless_group import decode_store_value

MAX_METADATA_BYTES = 64 << 20  # one state dict's pickled names and shapes; far above any model's
MAX_STATE_DICTS = 1 << 16  # layers + 1
# A state dict claiming more bytes than this many times the model's own weights is not in step with the model (an
# fp32 trainer sending to an 8-bit engine sends 4x): the stream is closed rather than an allocation attempted.
MAX_BYTES_PER_MODEL_BYTE = 4
FP8_KERNEL_FORMAT_NEEDS = (
    "quantize_in_weight_transfer: true sends FP8 weights with 128x128 block scales (weight_scale_inv); this engine "
    "does not serve them: start it with --quantization fp8 (or an fp8 checkpoint), or set it to false"
)


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}: must be an integer {bound}, got {value!r}")


class _StatelessBackend(WeightTransferEngine):
    """What both share: one group member per worker, joined by `init_transfer_engine`."""

    def __init__(self, config, vllm_config=None, device=None, model=None, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__(config, vllm_config, device, model)
        self.timeout_s = timeout_s
        self.group: StatelessGroupMember | None = None

    def _join(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        self.shutdown()  # a second init (a new trainer run) replaces the old group
        self.group = StatelessGroupMember.join(host, port, rank, world_size, self.device, timeout_s)

    def _require_group(self) -> StatelessGroupMember:
        if self.group is None:
            raise self._not_initialized()
        return self.group

    def _receive(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        self._require_group().broadcast(tensor).wait()
        return tensor

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        self.group = None


# --- prime-rl ---------------------------------------------------------------------------------------------------


@dataclass
class PrimeRLInitInfo(WeightTransferInitInfo):
    """prime-rl's `/init_broadcaster` body. `timeout`: seconds the rendezvous and each receive wait (prime-rl's
    store timeout). `session_id` names a NIXL session; prime-rl's NCCL receiver discards it, and so does this one."""

    host: str
    port: int
    rank_offset: int
    inference_world_size: int
    timeout: float = DEFAULT_TIMEOUT_S
    quantize_in_weight_transfer: bool = False
    session_id: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.quantize_in_weight_transfer, bool):
            raise ValueError(
                f"quantize_in_weight_transfer: must be true or false, got {self.quantize_in_weight_transfer!r}"
            )
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: must be a host name or address, got {self.host!r}")
        _check_int("port", self.port, 1, 65535)
        _check_int("inference_world_size", self.inference_world_size, 1, MAX_WORLD_SIZE - 1)  # and the trainer
        _check_int("rank_offset", self.rank_offset, 0, self.inference_world_size - 1)
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) or not self.timeout > 0:
            raise ValueError(f"timeout: must be a number of seconds > 0, got {self.timeout!r}")


@dataclass
class PrimeRLUpdateInfo(_UpdateInfo):
    """Empty: prime-rl's metadata comes in the broadcast stream itself."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.names:
            raise ValueError("names: prime-rl's trainer sends the metadata in its broadcast, not in update_info")


class PrimeRLBroadcastEngine(_StatelessBackend):
    init_info_cls = PrimeRLInitInfo
    update_info_cls = PrimeRLUpdateInfo
    kernel_format = False  # quantize_in_weight_transfer: the trainer sends FP8 layers under vLLM's kernel names

    def init_transfer_engine(self, init_info: PrimeRLInitInfo) -> None:
        if init_info.quantize_in_weight_transfer:  # refused before the rendezvous: the trainer is told at once
            scheme = getattr(self.model, "fp8_scheme", None)
            if scheme is None or not scheme.block_wise:
                raise ValueError(FP8_KERNEL_FORMAT_NEEDS)
        self.kernel_format = init_info.quantize_in_weight_transfer
        rank = init_info.rank_offset + self.worker_index + 1  # rank 0 is the trainer's broadcaster
        self._join(init_info.host, init_info.port, rank, init_info.inference_world_size + 1, init_info.timeout)
        self._max_state_dict_bytes = MAX_BYTES_PER_MODEL_BYTE * _model_bytes(self.model)

    def receive_weights(self, update_info: PrimeRLUpdateInfo, load_weights: LoadWeightsFn) -> None:
        """Receive every state dict the trainer sends. Each is checked against the model before it is loaded; one
        refused (or a failed load) does not stop the stream: the rest is received and dropped, so the trainer's
        broadcast completes and the group stays in step, and the error is raised at the end. Refused before any
        state dict was loaded, it is a WeightUpdateRefused: the model is unchanged."""
        count = self._receive_int("the count of state dicts", MAX_STATE_DICTS)
        error: Exception | None = None
        loaded_any = False
        for _ in range(count):
            weights = self._receive_state_dict()
            if error is not None:
                continue
            try:
                if self.kernel_format:  # vLLM kernel names for fused projections: split into checkpoint tensors
                    weights = self.model.unfuse_weights(weights)
                self._check(weights)
            except ValueError as e:
                error = e if loaded_any else WeightUpdateRefused(str(e))
                continue
            try:
                load_weights(weights)
                loaded_any = True
            except Exception as e:  # noqa: BLE001 (raised once the stream is drained)
                error = e
        if error is not None:
            raise error

    def _check(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        check = getattr(self.model, "check_weights", None)  # rlserve's models: names, shapes, dtypes
        if check is not None:
            check((name, tuple(t.shape), t.dtype) for name, t in weights)

    def _receive_int(self, what: str, high: int) -> int:
        value = int(self._receive((1,), torch.long).item())
        if not 0 <= value <= high:
            raise ConnectionError(f"prime-rl stream out of step: {what} is {value}, outside 0..{high}")
        return value

    def _receive_state_dict(self) -> list[tuple[str, torch.Tensor]]:
        size = self._receive_int("a state dict's metadata size", MAX_METADATA_BYTES)
        raw = self._receive((size,), torch.uint8)
        try:
            groups = _parse_metadata(decode_store_value(raw.cpu().numpy().tobytes()))
        except ValueError as e:  # the dtype groups' sizes are unknown: the stream cannot be followed
            raise ConnectionError(f"prime-rl stream out of step: {e}") from e
        claimed = sum(dtype.itemsize * sum(numel for _, _, numel in items) for dtype, items in groups)
        if self._max_state_dict_bytes and claimed > self._max_state_dict_bytes:
            raise ConnectionError(
                f"prime-rl stream out of step: a state dict of {claimed} bytes, more than "
                f"{MAX_BYTES_PER_MODEL_BYTE}x this model's weights"
            )
        weights: list[tuple[str, torch.Tensor]] = []
        for dtype, items in groups:
            flat = self._receive((sum(numel for _, _, numel in items),), dtype)
            offset = 0
            for name, shape, numel in items:
                weights.append((name, flat[offset : offset + numel].view(shape)))
                offset += numel
        return weights


def _parse_metadata(metadata: Any) -> list[tuple[torch.dtype, list[tuple[str, tuple[int, ...], int]]]]:
    """prime-rl's `{dtype: [(name, shape, numel), ...]}`, checked (numel is the shape's product)."""
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata is a {type(metadata).__name__}, not a dict of dtypes")
    groups = []
    for dtype, items in metadata.items():
        if not isinstance(dtype, torch.dtype) or not isinstance(items, list):
            raise ValueError(f"metadata entry {dtype!r}: expected a torch dtype and a list")
        parsed = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], str)):
                raise ValueError(f"metadata item {item!r}: expected (name, shape, numel)")
            name, shape, numel = item
            if not all(type(d) is int and d >= 0 for d in shape) or type(numel) is not int:
                raise ValueError(f"metadata of {name!r}: shape {shape!r}, numel {numel!r}")
            if math.prod(shape) != numel:
                raise ValueError(f"metadata of {name!r}: numel {numel} is not the product of shape {list(shape)}")
            parsed.append((name, tuple(shape), numel))
        groups.append((dtype, parsed))
    return groups


def _model_bytes(model: torch.nn.Module | None) -> int:
    """The bytes of the model's weights as a whole (every rank's part); 0 when unknown."""
    if model is None:
        return 0
    tp = getattr(getattr(model, "tp", None), "size", 1)
    return tp * sum(p.numel() * p.element_size() for p in model.parameters())


# --- PipelineRL -------------------------------------------------------------------------------------------------


@dataclass
class PipelineRLInitInfo(WeightTransferInitInfo):
    """PipelineRL's flags: `--weight-update-group-init-method tcp://HOST:PORT`, `--weight-update-group-world-size`,
    `--actor-llm-idx`; `actor_ngpus` is its `torch.cuda.device_count()`, the workers of one engine."""

    init_method: str
    world_size: int
    actor_llm_idx: int = 0
    actor_ngpus: int = 1

    def __post_init__(self) -> None:
        parsed = urlparse(self.init_method) if isinstance(self.init_method, str) else None
        if parsed is None or parsed.scheme != "tcp":
            raise ValueError(f"init_method: expected tcp://HOST:PORT, got {self.init_method!r}")
        _check_int("world_size", self.world_size, 2)
        _check_int("actor_llm_idx", self.actor_llm_idx, 0)
        _check_int("actor_ngpus", self.actor_ngpus, 1)

    @property
    def address(self) -> tuple[str, int]:
        parsed = urlparse(self.init_method)
        return parsed.hostname or "localhost", parsed.port or 9000  # PipelineRL's defaults


class PipelineRLBroadcastEngine(_StatelessBackend):
    """The update info is the usual names / dtype_names / shapes (the engine checks them before the first byte),
    built from PipelineRL's `parameters_info`; each tensor is one broadcast, in that order."""

    init_info_cls = PipelineRLInitInfo
    update_info_cls = _UpdateInfo

    def init_transfer_engine(self, init_info: PipelineRLInitInfo) -> None:
        rank = 1 + init_info.actor_llm_idx * init_info.actor_ngpus + self.worker_index
        host, port = init_info.address
        self._join(host, port, rank, init_info.world_size, self.timeout_s)

    def receive_weights(self, update_info: _UpdateInfo, load_weights: LoadWeightsFn) -> None:
        error: Exception | None = None
        for name, dtype, shape in zip(update_info.names, update_info.dtypes, update_info.shapes, strict=True):
            tensor = self._receive(shape, dtype)
            if error is None:
                try:
                    load_weights([(name, tensor)])
                except Exception as e:  # noqa: BLE001 (raised once every broadcast is received)
                    error = e
        if error is not None:
            raise error


def pipelinerl_update_info(parameters_info: list[dict[str, Any]]) -> dict[str, Any]:
    """PipelineRL's `parameters_info` ([{name, shape, dtype: "torch.bfloat16"}]) as update info."""
    return {
        "names": [p["name"] for p in parameters_info],
        "dtype_names": [dtype_name_of(p["dtype"]) for p in parameters_info],
        "shapes": [list(p["shape"]) for p in parameters_info],
    }


def dtype_name_of(text: str) -> str:
    """`str(torch.bfloat16)` ("torch.bfloat16", PipelineRL's spelling) or "bfloat16" -> "bfloat16"."""
    return dtype_name(dtype_from_name(text.removeprefix("torch.")))
