"""W4 weight sync: a full update of the model's weights from a trainer process into engine-side tensors.

GPU, colocated:  python benchmarks/weight_sync.py --backend ipc --out ipc.json        (trainer and engine on cuda:0)
GPU, two GPUs:   python benchmarks/weight_sync.py --backend nccl --out nccl.json      (trainer cuda:0, engine cuda:1)
CPU:             python benchmarks/weight_sync.py --backend gloo                      (the nccl backend over gloo)
GPU, sparse:     python benchmarks/weight_sync.py --backend ipc --sparse --out sparse.json

--sparse (ipc) adds the delta update of rlserve's sparse_nccl format (flat int32 indices + bf16 values per tensor)
against the full update, at a measured change fraction: the trainer process holds fp32 master weights equal to the
bf16 weights, takes one Adam step at lr 1e-6 on a Qwen3 model of the shape (transformers, a forward and backward of
random tokens), and the changed bf16 values are the ones that differ from before the step. Each sparse update goes to
the other version (v0 -> v1 -> v0 ...): the trainer diffs against the version it sent last (`SparseDelta`), shares
the patches through CUDA IPC in one packed buffer, and the engine scatters them into its weights; its seconds run
from the diff to the engine's scatter returning.

The trainer is a separate process holding the model's weights as separate tensors with HF names; the engine side
(this process) receives into its own preallocated tensors through a `load_weights` that copies, as the engine's
loader does. The model is built from its shapes alone (no rlserve engine involved): by default `qwen3-0.6b-shape`
(BENCHMARKS.md) in bf16, `small` for gloo. The target is zeroed before each configuration and checked bit for bit
against the same weights regenerated here after it.

Seconds are per full update (median): for ipc the trainer's `trainer_send_weights` call, which returns once the
engine has loaded every chunk; for nccl/gloo from the engine's go signal until its `receive_weights` returned, the
trainer sending concurrently. GB/s = model bytes / seconds. The ceiling measured in the same run: for ipc a device
copy of the model's size (floor = bytes read + written at the copy bandwidth) and the per-tensor copy of all weights;
for nccl/gloo a raw broadcast of the model's size over the same group ("raw"), and per packed configuration the same
bucket sequence broadcast without packing or unpacking ("raw buckets": bucket i from/into buffer i % bufs, bufs
broadcasts in flight), so "of raw buckets" isolates the packing and unpacking not hidden behind the transfer.
Memory (CUDA): peak allocated above each
side's resident weights during the configuration, and allocated after the first and after the last update (after
`torch.cuda.ipc_collect()`), which must be equal. The control channel is a pipe carrying JSON bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from rlserve.config import WeightTransferConfig
from rlserve.dtypes import dtype_name
from rlserve.engine.wire.process import free_port
from rlserve.weight_transfer import (
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    plan_buckets,
    tensor_sha256,
)
from rlserve.weight_transfer.packed import slot_buffers
from rlserve.weight_transfer.sparse_nccl import SparseDelta

MIB = 1 << 20
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = True


MODELS = {
    "qwen3-0.6b-shape": ModelShape(151936, 1024, 3072, 28, 16, 8, 128),
    "small": ModelShape(32000, 512, 1536, 8, 8, 4, 64),
}

DEFAULT_BUFFERS = {
    "ipc": (512 * MIB, 1024 * MIB),
    "nccl": (64 * MIB, 256 * MIB, 1024 * MIB),
    "gloo": (4 * MIB, 16 * MIB),
}
DEFAULT_UPDATES = {"ipc": 100, "nccl": 20, "gloo": 10}


def param_shapes(m: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3's checkpoint tensors in checkpoint order (tied embeddings: no lm_head.weight)."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (m.vocab, m.hidden))]
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    for i in range(m.layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (m.hidden,)),
            (p + "self_attn.q_proj.weight", (q, m.hidden)),
            (p + "self_attn.k_proj.weight", (kv, m.hidden)),
            (p + "self_attn.v_proj.weight", (kv, m.hidden)),
            (p + "self_attn.o_proj.weight", (m.hidden, q)),
            (p + "self_attn.q_norm.weight", (m.head_dim,)),
            (p + "self_attn.k_norm.weight", (m.head_dim,)),
            (p + "post_attention_layernorm.weight", (m.hidden,)),
            (p + "mlp.gate_proj.weight", (m.intermediate, m.hidden)),
            (p + "mlp.up_proj.weight", (m.intermediate, m.hidden)),
            (p + "mlp.down_proj.weight", (m.hidden, m.intermediate)),
        ]
    shapes.append(("model.norm.weight", (m.hidden,)))
    if not m.tied:
        shapes.append(("lm_head.weight", (m.vocab, m.hidden)))
    return shapes


def make_weights(m: ModelShape, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights from `seed`; the same on every device of one type (the generator is device-independent)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        for name, shape in param_shapes(m)
    }


# --- measurement helpers --------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MemoryProbe:
    """Allocator readings on one side of the transfer (CUDA only; None on CPU, whose allocator keeps no stats)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cuda"
        self.resident = 0
        self.first: int | None = None
        self.last: int | None = None

    def start(self) -> None:
        if self.enabled:
            torch.cuda.ipc_collect()
            torch.cuda.synchronize(self.device)
            self.resident = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.first = self.last = None

    def after_update(self) -> None:
        if self.enabled:
            torch.cuda.ipc_collect()
            allocated = torch.cuda.memory_allocated(self.device)
            self.first = allocated if self.first is None else self.first
            self.last = allocated

    def report(self) -> dict[str, float | None]:
        if not self.enabled:
            return {"peak_extra_mib": None, "first_mib": None, "last_mib": None}
        peak = torch.cuda.max_memory_allocated(self.device) - self.resident
        return {"peak_extra_mib": peak / MIB, "first_mib": self.first / MIB, "last_mib": self.last / MIB}


def copy_ceilings(weights: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    """Device copy bandwidth (bytes read + written) over a buffer of the model's size, and the time to copy all
    weights tensor by tensor (what an unpacked load has to do at least)."""
    nbytes = sum(t.nbytes for t in weights.values())
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copies = {name: torch.empty_like(t) for name, t in weights.items()}

    def timed(fn: Callable[[], None]) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    def per_tensor() -> None:
        for name, t in weights.items():
            copies[name].copy_(t)

    for _ in range(3):
        timed(lambda: dst.copy_(src))
        timed(per_tensor)
    big = statistics.median(timed(lambda: dst.copy_(src)) for _ in range(10))
    each = statistics.median(timed(per_tensor) for _ in range(10))
    return {"copy_bw_gbps": 2 * nbytes / big / 1e9, "copy_floor_s": big, "per_tensor_s": each}


def bucket_sizes(weights: dict[str, torch.Tensor], buffer_size_bytes: int) -> list[int]:
    sizes = [t.nbytes for t in weights.values()]
    return [sum(sizes[i] for i in bucket) for bucket in plan_buckets(sizes, buffer_size_bytes)]


def broadcast_buckets(group: Any, buffers: list[torch.Tensor], sizes: list[int]) -> None:
    """The raw bucket sequence, the same on both sides: bucket i from/into buffer i % len(buffers), as many in
    flight as there are buffers (a broadcast into a buffer is issued once the previous one in it is done)."""
    in_flight: deque[Any] = deque()
    for i, size in enumerate(sizes):
        if len(in_flight) == len(buffers):
            in_flight.popleft().wait()
        in_flight.append(group.broadcast(buffers[i % len(buffers)][:size]))
    while in_flight:
        in_flight.popleft().wait()


# --- control channel: JSON bytes over a pipe (no pickle) ----------------------------------------------------------


def _send(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn: Connection) -> dict[str, Any]:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError("the other side of the benchmark went silent")
    message = json.loads(conn.recv_bytes())
    if "error" in message:
        raise RuntimeError(f"trainer failed: {message['error']}")
    return message


def _request(conn: Connection, message: dict[str, Any]) -> dict[str, Any]:
    _send(conn, message)
    return _recv(conn)


# --- trainer process ----------------------------------------------------------------------------------------------


def _trainer_main(conn: Connection, spec: str) -> None:
    try:
        _trainer(conn, json.loads(spec))
    except Exception as e:
        _send(conn, {"error": repr(e)})
        raise


def _trainer(conn: Connection, spec: dict[str, Any]) -> None:
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["trainer_device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    weights = make_weights(MODELS[spec["model"]], device)
    memory = MemoryProbe(device)
    group = None
    if spec["backend"] != "ipc":
        group = NCCLWeightTransferEngine.trainer_init(
            {"master_address": "127.0.0.1", "master_port": spec["port"], "world_size": 2, "timeout_s": TIMEOUT_S}
        )
    while True:
        cmd = _recv(conn)
        if cmd["cmd"] == "exit":
            break
        if cmd["cmd"] == "raw":  # the ceilings: one broadcast of the model's size, or the bucket sequence
            buffers = slot_buffers(cmd["sizes"], cmd["num_buffers"], device)
            for _ in range(cmd["reps"]):
                _recv(conn)  # go
                broadcast_buckets(group, buffers, cmd["sizes"])
                _sync(device)
            del buffers
            continue
        if cmd["cmd"] == "sparse":
            _trainer_sparse(conn, weights, cmd, MODELS[spec["model"]])
            continue
        memory.start()
        times = []
        for _ in range(cmd["updates"]):
            if spec["backend"] == "ipc":
                args = IPCTrainerSendWeightsArgs(
                    send_mode=lambda info: _request(conn, {"update_info": info}),
                    packed=cmd["packed"],
                    packed_buffer_size_bytes=cmd["buffer"],
                )
                t0 = time.perf_counter()
                IPCWeightTransferEngine.trainer_send_weights(iter(weights.items()), args)
            else:
                _recv(conn)  # go
                args = NCCLTrainerSendWeightsArgs(
                    group=group,
                    packed=cmd["packed"],
                    packed_buffer_size_bytes=cmd["buffer"],
                    packed_num_buffers=cmd["num_buffers"],
                )
                t0 = time.perf_counter()
                NCCLWeightTransferEngine.trainer_send_weights(iter(weights.items()), args)
            _sync(device)
            times.append(time.perf_counter() - t0)
            memory.after_update()
        _send(conn, {"done": True, "times": times, "memory": memory.report()})
    if group is not None:
        group.shutdown()


def adam_step_version(
    weights: dict[str, torch.Tensor], shape: ModelShape, lr: float = 1e-6, batch: int = 4, seq: int = 512
) -> dict[str, torch.Tensor]:
    """The bf16 weights after one Adam step at `lr` on fp32 master weights equal to `weights`: a Qwen3 model of the
    shape, a forward and backward of random tokens (embedding rows of tokens not in the batch get no gradient, as
    in training)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, tie_word_embeddings=shape.tied,
    )  # fmt: skip
    device = next(iter(weights.values())).device
    with torch.device(device):
        model = Qwen3ForCausalLM(config).float()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    tokens = torch.randint(
        0, shape.vocab, (batch, seq), device=device, generator=torch.Generator(device).manual_seed(0)
    )
    model(input_ids=tokens, labels=tokens).loss.backward()
    torch.optim.Adam(model.parameters(), lr=lr).step()
    return {name: params[name].detach().to(torch.bfloat16) for name in weights}


def _trainer_sparse(conn: Connection, weights: dict[str, torch.Tensor], cmd: dict[str, Any], shape: ModelShape) -> None:
    device = next(iter(weights.values())).device
    versions = [weights, adam_step_version(weights, shape)]
    delta = SparseDelta(weights.items())

    def send(items: list[tuple[str, torch.Tensor]], buffer: int) -> None:
        args = IPCTrainerSendWeightsArgs(
            send_mode=lambda info: _request(conn, {"update_info": info}), packed=True, packed_buffer_size_bytes=buffer
        )
        IPCWeightTransferEngine.trainer_send_weights(iter(items), args)

    send(list(weights.items()), max(t.nbytes for t in weights.values()))  # the engine starts from v0
    times, changed, patch_bytes = [], 0, 0
    phases: dict[str, list[float]] = {"diff": [], "send and apply": [], "commit": []}
    for i in range(cmd["updates"]):
        _sync(device)
        t0 = time.perf_counter()
        patches = delta.patches(versions[(i + 1) % 2].items())
        _sync(device)
        t1 = time.perf_counter()
        items = [
            (f"{p.name}.{part}", t)
            for p in patches
            if p.indices.numel()
            for part, t in (("indices", p.indices), ("values", p.values))
        ]
        if not items:
            raise RuntimeError("the Adam step changed no bf16 value: nothing to send")
        patch_bytes = sum(t.nbytes for _, t in items)
        send(items, patch_bytes)  # one chunk: the engine pairs indices with values within it
        t2 = time.perf_counter()
        delta.commit(patches)
        _sync(device)
        t3 = time.perf_counter()
        times.append(t3 - t0)
        for phase, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            phases[phase].append(seconds)
        changed = sum(p.indices.numel() for p in patches)
    digest = {name: tensor_sha256(t) for name, t in versions[cmd["updates"] % 2].items()}
    medians = {phase: statistics.median(seconds[1:]) for phase, seconds in phases.items()}
    done = {"done": True, "times": times, "phases": medians, "changed": changed, "patch_bytes": patch_bytes}
    _send(conn, done | {"digest": digest})


# --- engine side (this process) -------------------------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    mode: str
    buffer_mib: float | None
    num_buffers: int | None
    seconds: float
    gbps: float
    fraction: float
    raw_buckets_s: float | None = None
    fraction_of_raw_buckets: float | None = None
    trainer_peak_extra_mib: float | None = None
    engine_peak_extra_mib: float | None = None
    trainer_mem_first_last_mib: tuple[float, float] | None = None
    engine_mem_first_last_mib: tuple[float, float] | None = None


def _update_info(weights: dict[str, torch.Tensor], cmd: dict[str, Any]) -> dict[str, Any]:
    return {
        "names": list(weights),
        "dtype_names": [dtype_name(t.dtype) for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        "packed": cmd["packed"],
        "packed_buffer_size_bytes": cmd["buffer"],
        "packed_num_buffers": cmd["num_buffers"],
    }


def _configs(backend: str, buffers: list[int], updates: int, num_buffers: list[int]) -> list[dict[str, Any]]:
    if backend == "ipc":  # num_buffers has no meaning for ipc: one staging buffer
        return [{"packed": False, "buffer": buffers[-1], "num_buffers": 1, "updates": updates}] + [
            {"packed": True, "buffer": b, "num_buffers": 1, "updates": updates} for b in buffers
        ]
    return [
        {"packed": packed, "buffer": b, "num_buffers": n, "updates": updates}
        for packed in (False, True)
        for b in buffers
        for n in num_buffers
    ]


def run(
    backend: str,
    model: str,
    buffers: list[int],
    updates: int,
    threads: int | None,
    sparse: bool = False,
    num_buffers: tuple[int, ...] = (1, 2),
    packed_only: bool = False,
) -> tuple[list[Row], dict[str, Any]]:
    if backend == "ipc":
        engine_device = trainer_device = torch.device("cuda", 0)
    elif backend == "nccl":
        if torch.cuda.device_count() < 2:
            raise SystemExit("--backend nccl needs two GPUs (NCCL refuses two ranks on one GPU); use ipc on one")
        trainer_device, engine_device = torch.device("cuda", 0), torch.device("cuda", 1)
    else:
        engine_device = trainer_device = torch.device("cpu")
    if engine_device.type == "cuda":
        torch.cuda.set_device(engine_device)
    if threads:
        torch.set_num_threads(threads)

    shape = MODELS[model]
    expected = make_weights(shape, engine_device)
    nbytes = sum(t.nbytes for t in expected.values())
    target = {name: torch.zeros_like(t) for name, t in expected.items()}
    info: dict[str, Any] = {
        "backend": backend,
        "model": model,
        "tensors": len(expected),
        "model_gb": nbytes / 1e9,
        "device": torch.cuda.get_device_name(engine_device) if engine_device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "intra_op_threads": torch.get_num_threads(),
    }
    if backend == "ipc":
        info.update(copy_ceilings(expected, engine_device))

    def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
        # One multi-tensor copy, as the engine's loader (LlamaForCausalLM.load_weights) does.
        torch._foreach_copy_([target[name] for name, _ in weights], [tensor for _, tensor in weights])

    port = free_port()
    spec = {"backend": backend, "model": model, "trainer_device": str(trainer_device), "port": port, "threads": threads}
    ctx = multiprocessing.get_context("spawn")
    engine_end, trainer_end = ctx.Pipe()
    trainer = ctx.Process(target=_trainer_main, args=(trainer_end, json.dumps(spec)), daemon=True)
    trainer.start()
    config = WeightTransferConfig("ipc" if backend == "ipc" else "nccl")
    if backend == "ipc":
        engine: Any = IPCWeightTransferEngine(config, engine_device)
        engine.init_transfer_engine(engine.parse_init_info({}))
    else:
        engine = NCCLWeightTransferEngine(config, engine_device, timeout_s=TIMEOUT_S)
        engine.init_transfer_engine(
            engine.parse_init_info({"master_address": "127.0.0.1", "master_port": port, "world_size": 2})
        )
    reps = max(3, updates // 2)

    def raw_broadcast(sizes: list[int], num_buffers: int) -> float:
        """Median seconds of the raw bucket sequence `sizes`, the trainer sending concurrently."""
        bufs = slot_buffers(sizes, num_buffers, engine_device)
        _send(engine_end, {"cmd": "raw", "sizes": sizes, "num_buffers": num_buffers, "reps": reps})
        raw = []
        for _ in range(reps):
            _send(engine_end, {"go": True})
            t0 = time.perf_counter()
            broadcast_buckets(engine.group, bufs, sizes)
            _sync(engine_device)
            raw.append(time.perf_counter() - t0)
        return statistics.median(raw[1:])

    rows: list[Row] = []
    try:
        if backend != "ipc":
            info["raw_broadcast_s"] = raw_broadcast([nbytes], 1)
            info["raw_broadcast_gbps"] = nbytes / info["raw_broadcast_s"] / 1e9
        ceiling_s = info["copy_floor_s"] if backend == "ipc" else info["raw_broadcast_s"]

        configs = _configs(backend, buffers, updates, list(num_buffers))
        for cmd in [c for c in configs if c["packed"] or not packed_only]:
            raw_buckets_s = None
            if backend != "ipc" and cmd["packed"]:  # measured next to its configuration, under the same load
                raw_buckets_s = raw_broadcast(bucket_sizes(expected, cmd["buffer"]), cmd["num_buffers"])
            for t in target.values():
                t.zero_()
            memory = MemoryProbe(engine_device)
            memory.start()
            _send(engine_end, {"cmd": "run", **cmd})
            engine_times = []
            for _ in range(cmd["updates"]):
                if backend == "ipc":
                    while True:  # one message per chunk (packed) or one per update (unpacked)
                        message = _recv(engine_end)
                        update_info = engine.parse_update_info(message["update_info"])
                        engine.receive_weights(update_info, load_weights)
                        _send(engine_end, {"ok": True})
                        if update_info.is_last_chunk:
                            break
                else:
                    update_info = engine.parse_update_info(_update_info(expected, cmd))
                    _send(engine_end, {"go": True})
                    t0 = time.perf_counter()
                    engine.receive_weights(update_info, load_weights)
                    _sync(engine_device)
                    engine_times.append(time.perf_counter() - t0)
                memory.after_update()
            done = _recv(engine_end)
            times = done["times"] if backend == "ipc" else engine_times
            seconds = statistics.median(times[1:] if len(times) > 1 else times)  # the first update warms up
            trainer_mem, engine_mem = done["memory"], memory.report()
            # Checked after the memory readings: torch.equal allocates temporaries of the largest tensor's size.
            bad = [name for name, t in expected.items() if not torch.equal(target[name], t)]
            if bad:
                raise AssertionError(f"{cmd}: {len(bad)} tensors differ after the updates, e.g. {bad[:3]}")
            rows.append(
                Row(
                    backend=backend,
                    mode="packed" if cmd["packed"] else "unpacked",
                    buffer_mib=cmd["buffer"] / MIB if cmd["packed"] or backend != "ipc" else None,
                    num_buffers=cmd["num_buffers"] if backend != "ipc" else None,
                    seconds=seconds,
                    gbps=nbytes / seconds / 1e9,
                    fraction=ceiling_s / seconds,
                    raw_buckets_s=raw_buckets_s,
                    fraction_of_raw_buckets=None if raw_buckets_s is None else raw_buckets_s / seconds,
                    trainer_peak_extra_mib=trainer_mem["peak_extra_mib"],
                    engine_peak_extra_mib=engine_mem["peak_extra_mib"],
                    trainer_mem_first_last_mib=_pair(trainer_mem),
                    engine_mem_first_last_mib=_pair(engine_mem),
                )
            )
            print(f"done: {cmd} -> {rows[-1].seconds:.4f} s", file=sys.stderr, flush=True)
        if sparse:
            rows.append(_engine_sparse(engine, engine_end, target, updates, nbytes, ceiling_s, info))
        _send(engine_end, {"cmd": "exit"})
    finally:
        engine.shutdown()  # before waiting for the trainer: both sides leave the group at the same time
        trainer.join(TIMEOUT_S)
        if trainer.is_alive():
            trainer.kill()
            trainer.join(5)
    return rows, info


def _engine_sparse(
    engine: Any,
    conn: Connection,
    target: dict[str, torch.Tensor],
    updates: int,
    nbytes: int,
    ceiling_s: float,
    info: dict[str, Any],
) -> Row:
    """The engine's end of the sparse run: a full update to v0, then patches scattered in place."""

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        indices: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            base, _, part = name.rpartition(".")
            if part == "indices":
                indices[base] = tensor
            elif part == "values":
                target[base].view(-1).index_copy_(0, indices.pop(base).long(), tensor)
            else:
                target[name].copy_(tensor)

    _send(conn, {"cmd": "sparse", "updates": updates})
    for _ in range(updates + 1):
        while True:  # the first update (v0, full) comes in several chunks
            update_info = engine.parse_update_info(_recv(conn)["update_info"])
            engine.receive_weights(update_info, load)
            _send(conn, {"ok": True})
            if update_info.is_last_chunk:
                break
    done = _recv(conn)
    bad = [name for name, t in target.items() if tensor_sha256(t) != done["digest"][name]]
    if bad:
        raise AssertionError(f"sparse: {len(bad)} tensors differ from the trainer's version, e.g. {bad[:3]}")
    numel = nbytes // 2
    info.update(
        sparse_changed=done["changed"],
        sparse_changed_fraction=done["changed"] / numel,
        sparse_bytes=done["patch_bytes"],
        sparse_phases_s=done["phases"],
        full_bytes=nbytes,
    )
    seconds = statistics.median(done["times"][1:])
    return Row("ipc", "sparse", done["patch_bytes"] / MIB, None, seconds, nbytes / seconds / 1e9, ceiling_s / seconds)


def _pair(memory: dict[str, float | None]) -> tuple[float, float] | None:
    return None if memory["first_mib"] is None else (memory["first_mib"], memory["last_mib"])


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return "→".join(format(v, spec) for v in value)
    return format(value, spec)


def print_table(rows: list[Row], info: dict[str, Any]) -> None:
    print(
        f"\nW4 weight sync: backend={info['backend']} model={info['model']} ({info['tensors']} tensors, "
        f"{info['model_gb']:.3f} GB) device={info['device']} torch={info['torch']} "
        f"intra-op threads={info['intra_op_threads']}"
    )
    if info["backend"] == "ipc":
        print(
            f"ceiling: device copy {info['copy_bw_gbps']:.0f} GB/s (read+write) -> floor "
            f"{info['copy_floor_s'] * 1e3:.3f} ms; per-tensor copy of all weights {info['per_tensor_s'] * 1e3:.3f} ms"
        )
    if "sparse_changed" in info:
        print(
            f"sparse: one Adam step at lr 1e-6 changed {info['sparse_changed']} bf16 values "
            f"({info['sparse_changed_fraction']:.2%}); a sparse update carries {info['sparse_bytes'] / MIB:.1f} MiB "
            f"against {info['full_bytes'] / MIB:.1f} MiB full (its row: buffer = patch MiB, GB/s = model bytes / s)"
        )
        phases = ", ".join(f"{phase} {s * 1e3:.2f} ms" for phase, s in info["sparse_phases_s"].items())
        print(f"sparse, median per phase on the trainer: {phases}")
    if info["backend"] != "ipc":  # nccl/gloo measure a raw broadcast as their ceiling; ipc the copy above
        print(
            f"ceiling: raw broadcast of the model's size {info['raw_broadcast_s'] * 1e3:.3f} ms "
            f"({info['raw_broadcast_gbps']:.2f} GB/s)"
        )
    header = (
        "mode",
        "buffer MiB",
        "bufs",
        "seconds",
        "GB/s",
        "of ceiling",
        "raw buckets s",
        "of raw buckets",
        "trainer +MiB",
        "engine +MiB",
        "trainer MiB 1st→last",
        "engine MiB 1st→last",
    )
    lines = [
        (
            r.mode,
            _fmt(r.buffer_mib, ".0f"),
            _fmt(r.num_buffers, "d"),
            f"{r.seconds:.4f}",
            f"{r.gbps:.2f}",
            f"{r.fraction:.1%}",
            _fmt(r.raw_buckets_s, ".4f"),
            _fmt(r.fraction_of_raw_buckets, ".1%"),
            _fmt(r.trainer_peak_extra_mib, ".0f"),
            _fmt(r.engine_peak_extra_mib, ".0f"),
            _fmt(r.trainer_mem_first_last_mib, ".0f"),
            _fmt(r.engine_mem_first_last_mib, ".0f"),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    for line in (header, *lines):
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("ipc", "nccl", "gloo"), required=True)
    parser.add_argument(
        "--model", choices=sorted(MODELS), default=None, help="default: qwen3-0.6b-shape (small for gloo)"
    )
    parser.add_argument("--buffer-mib", type=int, nargs="+", default=None, help="packed buffer sizes to try")
    parser.add_argument("--updates", type=int, default=None, help="updates per configuration")
    parser.add_argument(
        "--num-buffers",
        type=int,
        nargs="+",
        default=[1, 2],
        help="nccl/gloo: packed_num_buffers to try; 1 = no overlap (receive, load, receive...), >= 2 = the next "
        "bucket received while one is loaded",
    )
    parser.add_argument("--packed-only", action="store_true", help="nccl/gloo: leave out the unpacked rows")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads per process (default for gloo: 1; both processes and gloo's own threads share "
        "the cores, and oversubscribed OpenMP copies ran 20x slower on a 2-core machine)",
    )
    parser.add_argument("--sparse", action="store_true", help="ipc: also the sparse (delta) update; see above")
    parser.add_argument("--out", default=None, help="write the rows and the run's info as JSON")
    args = parser.parse_args()
    if args.backend in ("ipc", "nccl") and not torch.cuda.is_available():
        raise SystemExit(f"--backend {args.backend} needs CUDA; --backend gloo runs on CPU")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    model = args.model or ("small" if args.backend == "gloo" else "qwen3-0.6b-shape")
    buffers = [b * MIB for b in args.buffer_mib] if args.buffer_mib else list(DEFAULT_BUFFERS[args.backend])
    updates = args.updates or DEFAULT_UPDATES[args.backend]
    threads = args.threads or (1 if args.backend == "gloo" else None)
    if args.sparse and args.backend != "ipc":
        raise SystemExit("--sparse runs with --backend ipc (one GPU)")
    rows, info = run(
        args.backend, model, buffers, updates, threads, args.sparse, tuple(args.num_buffers), args.packed_only
    )
    print_table(rows, info)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": [asdict(r) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
