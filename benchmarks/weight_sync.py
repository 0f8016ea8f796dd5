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

# This script is the engine side; the trainer process is in weight_sync_trainer.py, what both use in
# weight_sync_shared.py.

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from weight_sync_shared import (
    MIB,
    MODELS,
    TIMEOUT_S,
    MemoryProbe,
    broadcast_buckets,
    make_weights,
    receive_message,
    send_message,
    synchronize,
)
from weight_sync_trainer import trainer_main

from rlserve.config import WeightTransferConfig
from rlserve.dtypes import dtype_name
from rlserve.engine.wire.process import free_port
from rlserve.weight_transfer import (
    IPCWeightTransferEngine,
    NCCLWeightTransferEngine,
    plan_buckets,
    tensor_sha256,
)
from rlserve.weight_transfer.packed import slot_buffers

DEFAULT_BUFFERS = {
    "ipc": (512 * MIB, 1024 * MIB),
    "nccl": (64 * MIB, 256 * MIB, 1024 * MIB),
    "gloo": (4 * MIB, 16 * MIB),
}
DEFAULT_UPDATES = {"ipc": 100, "nccl": 20, "gloo": 10}


def copy_ceilings(weights: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    """Device copy bandwidth (bytes read + written) over a buffer of the model's size, and the time to copy all
    weights tensor by tensor (what an unpacked load has to do at least)."""
    nbytes = sum(t.nbytes for t in weights.values())
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copies = {name: torch.empty_like(t) for name, t in weights.items()}

    def timed(fn: Callable[[], None]) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
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
    # ipc: where an update's time goes, medians over the updates: the trainer's packing (all but its round trips),
    # the engine's phases (PhaseTimedIPCEngine), and the messages (the round trips less the engine's phases).
    phases_s: dict[str, float] | None = None
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
    if backend == "ipc":  # num_buffers has no meaning for ipc: one staging buffer, per update or kept (`keep`)
        return [{"packed": False, "buffer": buffers[-1], "num_buffers": 1, "updates": updates, "keep": False}] + [
            {"packed": True, "buffer": b, "num_buffers": 1, "updates": updates, "keep": keep}
            for keep in (False, True)
            for b in buffers
        ]
    return [
        {"packed": packed, "buffer": b, "num_buffers": n, "updates": updates, "keep": False}
        for packed in (False, True)
        for b in buffers
        for n in num_buffers
    ]


def _devices(backend: str) -> tuple[torch.device, torch.device]:
    """The trainer's device and the engine's."""
    if backend == "ipc":
        return torch.device("cuda", 0), torch.device("cuda", 0)
    if backend == "nccl":
        if torch.cuda.device_count() < 2:
            raise SystemExit("--backend nccl needs two GPUs (NCCL refuses two ranks on one GPU); use ipc on one")
        return torch.device("cuda", 0), torch.device("cuda", 1)
    return torch.device("cpu"), torch.device("cpu")


class PhaseTimedIPCEngine(IPCWeightTransferEngine):
    """The ipc engine with each engine-side phase of an update timed on the host (what the trainer waits for): the
    mapping of the trainer's export (of each tensor's, unpacked), the loader's copies launched, the synchronize
    before the answer (the copies running), the mapping released after the last chunk. Seconds add up per update in
    `phase_s`."""

    PHASES = ("map", "load", "sync", "release")

    def __init__(self, config: WeightTransferConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.phase_s = dict.fromkeys(self.PHASES, 0.0)

    def _timed(self, phase: str, call: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return call()
        finally:
            self.phase_s[phase] += time.perf_counter() - started

    def take_phases(self) -> dict[str, float]:
        phases, self.phase_s = self.phase_s, dict.fromkeys(self.PHASES, 0.0)
        phases["sync"] -= phases["release"]  # _finish releases after its synchronize: counted apart
        return phases

    def receive_weights(self, update_info: Any, load_weights: Callable[..., None]) -> None:
        super().receive_weights(update_info, lambda weights: self._timed("load", lambda: load_weights(weights)))

    def _map_buffer(self, handle: dict[str, Any], index: int, required: bool) -> torch.Tensor | None:
        return self._timed("map", lambda: super(PhaseTimedIPCEngine, self)._map_buffer(handle, index, required))

    def _rebuild(self, handle: dict[str, Any], index: int, required: bool) -> torch.Tensor | None:  # unpacked
        return self._timed("map", lambda: super(PhaseTimedIPCEngine, self)._rebuild(handle, index, required))

    def _finish(self, update_info: Any, index: int) -> None:
        self._timed("sync", lambda: super(PhaseTimedIPCEngine, self)._finish(update_info, index))

    def _release(self) -> None:
        self._timed("release", super()._release)


def _receiving_engine(backend: str, device: torch.device, port: int) -> Any:
    """The engine's transfer engine, joined to the trainer (nccl/gloo: through the group at `port`)."""
    config = WeightTransferConfig("ipc" if backend == "ipc" else "nccl")
    if backend == "ipc":
        engine: Any = PhaseTimedIPCEngine(config, device)
        engine.init_transfer_engine(engine.parse_init_info({}))
    else:
        engine = NCCLWeightTransferEngine(config, device, timeout_s=TIMEOUT_S)
        engine.init_transfer_engine(
            engine.parse_init_info({"master_address": "127.0.0.1", "master_port": port, "world_size": 2})
        )
    return engine


@dataclass(frozen=True)
class EngineSide:
    """This process's end of the transfer: the receiving engine, the weights it must end up with, the preallocated
    tensors it receives into, and the pipe to the trainer."""

    backend: str
    engine: Any
    conn: Connection
    device: torch.device
    expected: dict[str, torch.Tensor]
    target: dict[str, torch.Tensor]
    reps: int  # timed runs of each raw broadcast ceiling

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        # One multi-tensor copy, as the engine's loader (LlamaForCausalLM.load_weights) does.
        torch._foreach_copy_([self.target[name] for name, _ in weights], [tensor for _, tensor in weights])

    def raw_broadcast(self, sizes: list[int], num_buffers: int) -> float:
        """Median seconds of the raw bucket sequence `sizes`, the trainer sending concurrently."""
        bufs = slot_buffers(sizes, num_buffers, self.device)
        send_message(self.conn, {"cmd": "raw", "sizes": sizes, "num_buffers": num_buffers, "reps": self.reps})
        raw = []
        for _ in range(self.reps):
            send_message(self.conn, {"go": True})
            t0 = time.perf_counter()
            broadcast_buckets(self.engine.model_update_group, bufs, sizes)
            synchronize(self.device)
            raw.append(time.perf_counter() - t0)
        return statistics.median(raw[1:])

    def receive_update(self, cmd: dict[str, Any]) -> float | None:
        """One full update; nccl/gloo: the seconds from the go signal until `receive_weights` returned (ipc: None,
        the trainer times it)."""
        if self.backend == "ipc":
            while True:  # one message per chunk (packed) or one per update (unpacked)
                message = receive_message(self.conn)
                update_info = self.engine.parse_update_info(message["update_info"])
                self.engine.receive_weights(update_info, self.load_weights)
                send_message(self.conn, {"ok": True})
                if update_info.is_last_chunk:
                    return None
        update_info = self.engine.parse_update_info(_update_info(self.expected, cmd))
        send_message(self.conn, {"go": True})
        t0 = time.perf_counter()
        self.engine.receive_weights(update_info, self.load_weights)
        synchronize(self.device)
        return time.perf_counter() - t0

    def measure(self, cmd: dict[str, Any], nbytes: int, ceiling_s: float) -> Row:
        """One configuration's updates into zeroed targets, checked bit for bit after."""
        raw_buckets_s = None
        if self.backend != "ipc" and cmd["packed"]:  # measured next to its configuration, under the same load
            raw_buckets_s = self.raw_broadcast(bucket_sizes(self.expected, cmd["buffer"]), cmd["num_buffers"])
        for t in self.target.values():
            t.zero_()
        memory = MemoryProbe(self.device)
        memory.start()
        send_message(self.conn, {"cmd": "run", **cmd})
        engine_times, engine_phases = [], []
        for _ in range(cmd["updates"]):
            seconds = self.receive_update(cmd)
            if seconds is not None:
                engine_times.append(seconds)
            if self.backend == "ipc":
                engine_phases.append(self.engine.take_phases())
            memory.after_update()
        done = receive_message(self.conn)
        times = done["times"] if self.backend == "ipc" else engine_times
        seconds = statistics.median(times[1:] if len(times) > 1 else times)  # the first update warms up
        phases_s = None
        if self.backend == "ipc":
            per_update = [
                {"pack": total - trips, **engine, "messages": trips - sum(engine.values())}
                for total, trips, engine in zip(times, done["round_trips"], engine_phases, strict=True)
            ][1:] or engine_phases
            phases_s = {phase: statistics.median(u[phase] for u in per_update) for phase in per_update[0]}
        trainer_mem, engine_mem = done["memory"], memory.report()
        # Checked after the memory readings: torch.equal allocates temporaries of the largest tensor's size.
        bad = [name for name, t in self.expected.items() if not torch.equal(self.target[name], t)]
        if bad:
            raise AssertionError(f"{cmd}: {len(bad)} tensors differ after the updates, e.g. {bad[:3]}")
        return Row(
            backend=self.backend,
            mode=("packed, kept" if cmd["keep"] else "packed") if cmd["packed"] else "unpacked",
            buffer_mib=cmd["buffer"] / MIB if cmd["packed"] or self.backend != "ipc" else None,
            num_buffers=cmd["num_buffers"] if self.backend != "ipc" else None,
            seconds=seconds,
            gbps=nbytes / seconds / 1e9,
            fraction=ceiling_s / seconds,
            raw_buckets_s=raw_buckets_s,
            fraction_of_raw_buckets=None if raw_buckets_s is None else raw_buckets_s / seconds,
            phases_s=phases_s,
            trainer_peak_extra_mib=trainer_mem["peak_extra_mib"],
            engine_peak_extra_mib=engine_mem["peak_extra_mib"],
            trainer_mem_first_last_mib=_pair(trainer_mem),
            engine_mem_first_last_mib=_pair(engine_mem),
        )


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
    trainer_device, engine_device = _devices(backend)
    if engine_device.type == "cuda":
        torch.cuda.set_device(engine_device)
    if threads:
        torch.set_num_threads(threads)

    expected = make_weights(MODELS[model], engine_device)
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

    port = free_port()
    spec = {"backend": backend, "model": model, "trainer_device": str(trainer_device), "port": port, "threads": threads}
    ctx = multiprocessing.get_context("spawn")
    engine_end, trainer_end = ctx.Pipe()
    trainer = ctx.Process(target=trainer_main, args=(trainer_end, json.dumps(spec)), daemon=True)
    trainer.start()
    engine = _receiving_engine(backend, engine_device, port)
    side = EngineSide(backend, engine, engine_end, engine_device, expected, target, reps=max(3, updates // 2))
    rows: list[Row] = []
    try:
        if backend != "ipc":
            info["raw_broadcast_s"] = side.raw_broadcast([nbytes], 1)
            info["raw_broadcast_gbps"] = nbytes / info["raw_broadcast_s"] / 1e9
        ceiling_s = info["copy_floor_s"] if backend == "ipc" else info["raw_broadcast_s"]

        configs = _configs(backend, buffers, updates, list(num_buffers))
        for cmd in [c for c in configs if c["packed"] or not packed_only]:
            rows.append(side.measure(cmd, nbytes, ceiling_s))
            print(f"done: {cmd} -> {rows[-1].seconds:.4f} s", file=sys.stderr, flush=True)
        if sparse:
            rows.append(_engine_sparse(engine, engine_end, target, updates, nbytes, ceiling_s, info))
        send_message(engine_end, {"cmd": "exit"})
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

    send_message(conn, {"cmd": "sparse", "updates": updates})
    for _ in range(updates + 1):
        while True:  # the first update (v0, full) comes in several chunks
            update_info = engine.parse_update_info(receive_message(conn)["update_info"])
            engine.receive_weights(update_info, load)
            send_message(conn, {"ok": True})
            if update_info.is_last_chunk:
                break
    done = receive_message(conn)
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
    for r in rows:
        if r.phases_s is not None:
            phases = ", ".join(f"{phase} {s * 1e3:.2f}" for phase, s in r.phases_s.items())
            print(f"{r.mode} {_fmt(r.buffer_mib, '.0f')} MiB, ms per update (medians): {phases}")


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
