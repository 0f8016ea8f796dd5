"""The typed messages between the front end (LLM, AsyncLLM, API servers) and the engine core, and their wire form.

Everything travels as msgpack (msgspec structs, tagged): nothing received is unpickled. A step's outputs travel in
columns: token ids and logprobs as raw little-endian buffers, not as Python lists of objects, so the core's cost of
sending a step and the front end's cost of reading it stay flat at large batches.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import msgspec
import numpy as np

from rlserve.lora.request import LoRARequest
from rlserve.outputs import PositionLogprobsData, npy_bytes
from rlserve.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step adds to one request (the core's in-memory form; see StepOutputs for the wire form)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobsData | None]
    new_prompt_logprobs: list[PositionLogprobsData] | None
    weight_version: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    timestamp: float = 0.0  # the core's time.monotonic() at the step that produced it (same host as the front end)
    # (queued, scheduled, first token) times of the core, on the request's first output that carries a token only
    first_token: tuple[float, float, float] | None = None
    error: str | None = None  # why the core refused the request (it then ends with finish_reason "abort")
    routed_experts: np.ndarray | None = None  # [tokens, layers, top_k], on the finishing output (see outputs.py)
    error_retryable: bool = False  # the refusal is transient (a pause): the same request succeeds later


PAUSE_MODES = ("abort", "wait", "keep")
# Why a new request is refused (retryable) during a pause in mode abort or wait (vLLM 0.33 refuses rather than queues).
PAUSED_REFUSAL = "generation is paused (mode abort or wait); retry after it resumes"
# vLLM's "wait" (sleep once the requests in flight finish) is not offered: a sleeping core restores the pause
# state it fell asleep in, so it would wake paused.
SLEEP_MODES = ("abort", "keep")
# vLLM's own worker methods that collective_rpc reaches (by name, over HTTP too): the core runs them itself, since
# they change what it keeps track of (its config, the weights written).
ENGINE_RPC_METHODS = ("update_config", "reload_weights", "reset_weights")


def resolve_pause_mode(mode: str, wait_for_inflight_requests: bool | None = None) -> str:
    """The pause mode asked for, checked; vLLM's deprecated `wait_for_inflight_requests=True` spells mode="wait"."""
    if wait_for_inflight_requests:
        mode = "wait"
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode: pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return mode


# ---- front end -> core ----


class AddRequest(msgspec.Struct, array_like=True):
    """Samples of one prompt: `request_ids[i]` runs with `params[i]` (the n samples of a request)."""

    request_ids: list[str]
    prompt_token_ids: bytes  # int32
    params: list[SamplingParams]
    cache_salt: str | None = None  # the prompt's prefix-cache namespace (vLLM's)
    lora_request: LoRARequest | None = None  # the adapter the samples run with

    @classmethod
    def of(
        cls,
        request_ids: list[str],
        prompt_token_ids: list[int],
        params: list[SamplingParams],
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AddRequest:
        return cls(request_ids, encode_token_ids(prompt_token_ids), params, cache_salt, lora_request)


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    """Queue prompts together: the core takes them all in before its next step, so the prompts of one
    `LLM.generate` call start in one batch, as they would in process."""

    requests: list[AddRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True, array_like=True):
    """A control call (pause, weight update, sleep, ...): `method` names an EngineCoreService method."""

    call_id: int
    method: str
    args: list[Any]


# ---- core -> front end ----


class UtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    value: Any = None
    error_type: str | None = None  # "ValueError", "RuntimeError", ...: the front end raises the same kind
    error: str | None = None


class PackedLogprobs(msgspec.Struct, array_like=True):
    """Rows of PositionLogprobsData in columns."""

    num_topk: bytes  # int32 per row
    topk_ids: bytes  # int32, all rows' top-k concatenated
    topk_values: bytes  # float32 (the engine's values are fp32 or narrower: no rounding)
    token_values: bytes  # float32 per row
    token_ranks: bytes  # int32 per row


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """One step's EngineCoreOutputs for one front end, in columns (one entry per output unless noted)."""

    request_ids: list[str]
    num_new_tokens: bytes  # int32
    new_token_ids: bytes  # int32, concatenated
    has_logprobs: bytes  # uint8: then every new token of the output has a row in `logprobs`
    logprobs: PackedLogprobs | None
    num_prompt_logprobs: bytes  # int32: rows in `prompt_logprobs` (0: None)
    prompt_logprobs: PackedLogprobs | None
    weight_versions: list[str]
    finish_reasons: list[str | None]
    stop_reasons: list[int | str | None]
    num_cached_tokens: bytes  # int32
    timestamps: bytes  # float64
    first_token_rows: bytes  # int32: the outputs that carry a `first_token` (a request's first, so few per step)
    first_token_times: bytes  # float64: (queued, scheduled, first token) per row of first_token_rows
    error_rows: bytes  # int32: the outputs that carry an `error` (refusals: rare, so a sparse column)
    errors: list[str]  # one per row of error_rows
    errors_retryable: bytes  # uint8 per row of error_rows
    routed_rows: bytes = b""  # int32: the outputs that carry `routed_experts` (finishing ones, when enabled)
    routed_experts: list[bytes] = []  # one .npy (no pickle) per row of routed_rows


class EngineStatus(msgspec.Struct, tag=True, array_like=True):
    """Sent to every front end when it changes (and to each on first contact): what /health reports without asking
    the core, whose loop may be inside a long weight transfer."""

    not_serving: str | None  # why generation is refused (EngineCore.not_serving), None while it serves
    rejecting_new_requests: bool = False  # a pause in mode abort or wait refuses new requests (retryable)


CoreInput = AddRequests | AbortRequests | UtilityCall
CoreOutput = StepOutputs | UtilityResult | EngineStatus


def _i32(values: list[int]) -> bytes:
    return np.asarray(values, dtype=np.int32).tobytes()


def _f32(values: list[float]) -> bytes:
    return np.asarray(values, dtype=np.float32).tobytes()


def _ints(buf: bytes) -> list[int]:
    return np.frombuffer(buf, dtype=np.int32).tolist()


def _floats(buf: bytes) -> list[float]:
    return np.frombuffer(buf, dtype=np.float32).tolist()


def _f64(values: list[float]) -> bytes:
    return np.asarray(values, dtype=np.float64).tobytes()


def _doubles(buf: bytes) -> list[float]:
    return np.frombuffer(buf, dtype=np.float64).tolist()


def _pack_logprobs(rows: list[PositionLogprobsData]) -> PackedLogprobs | None:
    if not rows:
        return None
    return PackedLogprobs(
        num_topk=_i32([len(r.topk_ids) for r in rows]),
        topk_ids=_i32([t for r in rows for t in r.topk_ids]),
        topk_values=_f32([v for r in rows for v in r.topk_values]),
        token_values=_f32([r.token_value for r in rows]),
        token_ranks=_i32([r.token_rank for r in rows]),
    )


def _unpack_logprobs(packed: PackedLogprobs | None) -> list[PositionLogprobsData]:
    if packed is None:
        return []
    counts = _ints(packed.num_topk)
    ids, values = _ints(packed.topk_ids), _floats(packed.topk_values)
    token_values, token_ranks = _floats(packed.token_values), _ints(packed.token_ranks)
    rows, offset = [], 0
    for k, value, rank in zip(counts, token_values, token_ranks, strict=True):
        rows.append(PositionLogprobsData(ids[offset : offset + k], values[offset : offset + k], value, rank))
        offset += k
    return rows


def pack_outputs(outputs: list[EngineCoreOutput]) -> StepOutputs:
    logprob_rows: list[PositionLogprobsData] = []
    prompt_rows: list[PositionLogprobsData] = []
    has_logprobs = []
    first_token_rows: list[int] = []
    first_token_times: list[float] = []
    error_rows: list[int] = []
    errors: list[str] = []
    routed_rows: list[int] = []
    routed_experts: list[bytes] = []
    errors_retryable: list[bool] = []
    for i, o in enumerate(outputs):
        if o.routed_experts is not None:
            routed_rows.append(i)
            routed_experts.append(npy_bytes(o.routed_experts))
        if o.first_token is not None:
            first_token_rows.append(i)
            first_token_times += o.first_token
        if o.error is not None:
            error_rows.append(i)
            errors.append(o.error)
            errors_retryable.append(o.error_retryable)
        with_logprobs = bool(o.new_logprobs) and o.new_logprobs[0] is not None
        has_logprobs.append(with_logprobs)
        if with_logprobs:
            logprob_rows += o.new_logprobs
        if o.new_prompt_logprobs:
            prompt_rows += o.new_prompt_logprobs
    return StepOutputs(
        request_ids=[o.request_id for o in outputs],
        num_new_tokens=_i32([len(o.new_token_ids) for o in outputs]),
        new_token_ids=_i32([t for o in outputs for t in o.new_token_ids]),
        has_logprobs=np.asarray(has_logprobs, dtype=np.uint8).tobytes(),
        logprobs=_pack_logprobs(logprob_rows),
        num_prompt_logprobs=_i32([len(o.new_prompt_logprobs or ()) for o in outputs]),
        prompt_logprobs=_pack_logprobs(prompt_rows),
        weight_versions=[o.weight_version for o in outputs],
        finish_reasons=[o.finish_reason for o in outputs],
        stop_reasons=[o.stop_reason for o in outputs],
        num_cached_tokens=_i32([o.num_cached_tokens for o in outputs]),
        timestamps=_f64([o.timestamp for o in outputs]),
        first_token_rows=_i32(first_token_rows),
        first_token_times=_f64(first_token_times),
        error_rows=_i32(error_rows),
        errors=errors,
        errors_retryable=np.asarray(errors_retryable, dtype=np.uint8).tobytes(),
        routed_rows=_i32(routed_rows),
        routed_experts=routed_experts,
    )


def unpack_outputs(step: StepOutputs) -> list[EngineCoreOutput]:
    counts = _ints(step.num_new_tokens)
    token_ends = list(accumulate(counts))
    tokens = _ints(step.new_token_ids)
    has_logprobs = np.frombuffer(step.has_logprobs, dtype=np.uint8).tolist()
    logprob_rows = _unpack_logprobs(step.logprobs)
    prompt_counts = _ints(step.num_prompt_logprobs)
    prompt_rows = _unpack_logprobs(step.prompt_logprobs)
    cached = _ints(step.num_cached_tokens)
    timestamps = _doubles(step.timestamps)
    outputs = []
    lp_offset = prompt_offset = 0
    for i, request_id in enumerate(step.request_ids):
        end = token_ends[i]
        new_tokens = tokens[end - counts[i] : end]
        if has_logprobs[i]:
            new_logprobs = logprob_rows[lp_offset : lp_offset + counts[i]]
            lp_offset += counts[i]
        else:
            new_logprobs = [None] * counts[i]
        prompt_logprobs = None
        if prompt_counts[i]:
            prompt_logprobs = prompt_rows[prompt_offset : prompt_offset + prompt_counts[i]]
            prompt_offset += prompt_counts[i]
        outputs.append(
            EngineCoreOutput(
                request_id,
                new_tokens,
                new_logprobs,
                prompt_logprobs,
                step.weight_versions[i],
                step.finish_reasons[i],
                step.stop_reasons[i],
                cached[i],
                timestamps[i],
            )
        )
    times = _doubles(step.first_token_times)
    for j, row in enumerate(_ints(step.first_token_rows)):
        outputs[row].first_token = (times[3 * j], times[3 * j + 1], times[3 * j + 2])
    retryable = np.frombuffer(step.errors_retryable, dtype=np.uint8).tolist()
    for row, error, transient in zip(_ints(step.error_rows), step.errors, retryable, strict=True):
        outputs[row].error = error
        outputs[row].error_retryable = bool(transient)
    for row, array in zip(_ints(step.routed_rows), step.routed_experts, strict=True):
        outputs[row].routed_experts = np.load(io.BytesIO(array), allow_pickle=False)
    return outputs


def encode_token_ids(token_ids: list[int]) -> bytes:
    return _i32(token_ids)


def decode_token_ids(buf: bytes) -> list[int]:
    return _ints(buf)


# The most elements of one tensor or array a collective_rpc result may carry as a list (each costs the core's loop):
# larger results belong in a file the method writes.
MAX_RESULT_ARRAY_ELEMENTS = 1 << 22


def _array_as_list(value: Any) -> Any:
    """msgspec's hook for what it cannot encode itself: a tensor or a numpy array (or scalar) as nested lists,
    anything else refused by type."""
    import torch  # the core has it loaded; a front end only gets here with a result to convert

    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        size = value.numel() if isinstance(value, torch.Tensor) else value.size
        if size > MAX_RESULT_ARRAY_ELEMENTS:
            raise ValueError(
                f"a {type(value).__name__} of {size} elements is more than {MAX_RESULT_ARRAY_ELEMENTS} that a result "
                "carries as a list; write it to a file and return the path"
            )
        return value.detach().cpu().tolist() if isinstance(value, torch.Tensor) else value.tolist()
    raise TypeError(f"a {type(value).__module__}.{type(value).__qualname__} is not plain data")


def plain_data(value: Any, what: str) -> Any:
    """`value` as data the core's messages carry (msgpack): containers, numbers, strings, bytes, tensors and arrays
    as lists; a ValueError naming `what` for anything else (an object, a 65-bit integer)."""
    try:
        data = msgspec.to_builtins(value, builtin_types=(bytes, bytearray), enc_hook=_array_as_list)
        msgspec.msgpack.encode(data)  # the integers msgpack cannot carry fail here rather than at the send
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise ValueError(
            f"{what} returned what the engine core cannot send ({e}); return numbers, strings, lists, dicts or tensors"
        ) from None
    return data


class Codec:
    """msgpack encoders/decoders for each direction (reused: msgspec's are cheapest when kept)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.input_decoder = msgspec.msgpack.Decoder(CoreInput)
        self.output_decoder = msgspec.msgpack.Decoder(CoreOutput)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self.encoder.encode(message)
