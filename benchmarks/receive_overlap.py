"""The engine's `nccl` receive path on one GPU: how much of a bucket's unpacking hides behind the next bucket's
transfer.

    python benchmarks/receive_overlap.py --out overlap.json [--trace trace.json]

NCCL refuses two ranks on one GPU, so a two-GPU `nccl` update cannot run here; this runs the engine's real receive
code (`PackedReceiver`: alternating buffers, receives on one CUDA stream, loads on another, ordered by events) with
the link emulated: a bucket's "broadcast" copies the trainer's packed bucket into the receive buffer on the receive
stream, then spins (`torch.cuda._sleep`) until bytes / `--link-gbps` has passed since it started (default 335 GB/s:
the raw two-H200 broadcast measured on 2026-11-29, 1.192 GB in 3.56 ms). The load is the W4 benchmark's (one
`_foreach_copy_` of the bucket's views into the model's tensors, as the engine's loader does).

Per configuration (buffer size x buffers): the update's time (median), the emulated raw broadcast of the model's size
("raw", the ceiling issue 21 measures against), the same bucket sequence received without loading ("raw buckets"),
the unpack time per bucket when it runs alone, and the overlap: the share of the unpack time that did not add to the
update, (raw buckets + unpack - update) / unpack. What this cannot show: a real NCCL receive runs its own kernel on
some SMs and writes HBM at the link's rate during the whole transfer, where the emulation writes it at once and then
spins one thread, so contention between receive and unpack is understated.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from typing import Any

import torch
from weight_sync_shared import MIB, MODELS, make_weights

from rlserve.weight_transfer import plan_buckets
from rlserve.weight_transfer.packed import PackedReceiver, TensorMeta, pack_tensors, unpack_tensors


class _EmulatedWork:
    """An NCCL Work on CUDA: `wait` makes the current stream wait for the receive's stream."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True


class EmulatedLink:
    """Receives the trainer's packed buckets in order, each taking bytes / link rate on the stream it is issued on."""

    def __init__(self, buckets: list[torch.Tensor], link_gbps: float) -> None:
        self.buckets = buckets
        self.link_gbps = link_gbps
        self.next = 0
        self.cycles_per_s = _sleep_rate()
        self.copy_s = [_timed(lambda b=b: torch.empty_like(b).copy_(b)) for b in buckets]

    def receive(self, view: torch.Tensor) -> _EmulatedWork:
        index = self.next % len(self.buckets)
        self.next += 1
        source = self.buckets[index]
        view.copy_(source)
        remaining = source.numel() / (self.link_gbps * 1e9) - self.copy_s[index]
        if remaining > 0:
            torch.cuda._sleep(int(remaining * self.cycles_per_s))
        return _EmulatedWork()


def _timed(fn: Any, repeats: int = 5) -> float:
    """Median seconds of `fn` on the current stream (CUDA events), after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _sleep_rate() -> float:
    """Cycles per second `torch.cuda._sleep` spins at (the SM clock under load)."""
    cycles = 20_000_000
    return cycles / _timed(lambda: torch.cuda._sleep(cycles))


class Model:
    """The trainer's weights (W4's random bf16 weights of the shape) and the engine's tensors they load into."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.weights = make_weights(MODELS[name], device)
        self.metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in self.weights.items()]
        self.nbytes = sum(t.nbytes for t in self.weights.values())
        self.target = {n: torch.zeros_like(t) for n, t in self.weights.items()}

    def load_weights(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        torch._foreach_copy_([self.target[name] for name, _ in batch], [tensor for _, tensor in batch])

    def packed_buckets(self, buffer_mib: int) -> tuple[list[list[int]], list[torch.Tensor]]:
        """The trainer's side: the bucket plan for this buffer size and each bucket packed."""
        tensors = list(self.weights.values())
        buckets = plan_buckets([m.nbytes for m in self.metas], buffer_mib * MIB)
        return buckets, [pack_tensors([tensors[i] for i in bucket]) for bucket in buckets]


def run(model: Model, buffers_mib: list[int], num_buffers: list[int], link_gbps: float, updates: int) -> dict:
    device = torch.device("cuda", 0)
    raw_link = EmulatedLink([pack_tensors(list(model.weights.values()))], link_gbps)
    raw_buffer = torch.empty(model.nbytes, dtype=torch.uint8, device=device)
    raw_s = _timed(lambda: raw_link.receive(raw_buffer))
    receiver = PackedReceiver()
    rows = []
    for buffer_mib in buffers_mib:
        buckets, packed = model.packed_buckets(buffer_mib)
        link = EmulatedLink(packed, link_gbps)
        unpack_s = [
            _timed(lambda p=p, b=b: model.load_weights(unpack_tensors(p, [model.metas[i] for i in b])))
            for p, b in zip(packed, buckets, strict=True)
        ]
        for bufs in num_buffers:
            receive = partial(receiver.receive, model.metas, link.receive)
            settings = (buffer_mib * MIB, bufs, device, True)
            raw_buckets_s = _timed(partial(receive, lambda batch: None, *settings), repeats=updates)
            for t in model.target.values():
                t.zero_()
            update_s = _timed(partial(receive, model.load_weights, *settings), repeats=updates)
            if any(not torch.equal(model.target[n], w) for n, w in model.weights.items()):
                raise AssertionError(f"{buffer_mib} MiB x {bufs}: the received weights differ from the trainer's")
            unpack_total = sum(unpack_s)
            rows.append(
                {
                    "buffer_mib": buffer_mib,
                    "num_buffers": bufs,
                    "buckets": len(buckets),
                    "update_s": update_s,
                    "raw_buckets_s": raw_buckets_s,
                    "unpack_s": unpack_total,
                    "unpack_per_bucket_s": statistics.median(unpack_s),
                    "of_raw": raw_s / update_s,
                    "of_raw_buckets": raw_buckets_s / update_s,
                    "overlap": (raw_buckets_s + unpack_total - update_s) / unpack_total,
                }
            )
    return {"raw_s": raw_s, "rows": rows}


def trace(path: str, model: Model, buffer_mib: int, bufs: int, link_gbps: float) -> None:
    """One update under the profiler, as a Chrome trace: the receive and unpack streams side by side."""
    device = torch.device("cuda", 0)
    _, packed = model.packed_buckets(buffer_mib)
    link = EmulatedLink(packed, link_gbps)
    receiver = PackedReceiver()

    def update() -> None:
        receiver.receive(model.metas, link.receive, model.load_weights, buffer_mib * MIB, bufs, device, packed=True)
        torch.cuda.synchronize()

    update()  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        update()
    prof.export_chrome_trace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b-shape", choices=sorted(MODELS))
    ap.add_argument("--buffer-mib", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--num-buffers", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--link-gbps", type=float, default=335.0, help="emulated link rate (GB/s)")
    ap.add_argument("--updates", type=int, default=10, help="timed updates per configuration")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--trace", default=None, help="write a Chrome trace of one 64 MiB x 2 update here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device: on the CPU, gloo's figures are in weight_sync.py --backend gloo")
    model = Model(args.model, torch.device("cuda", 0))
    result = run(model, args.buffer_mib, args.num_buffers, args.link_gbps, args.updates)
    result |= {
        "model": args.model,
        "model_gb": model.nbytes / 1e9,
        "tensors": len(model.metas),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "link_gbps": args.link_gbps,
    }
    print(
        f"{args.model} ({len(model.metas)} tensors, {model.nbytes / 1e9:.3f} GB) on {result['device']}, torch "
        f"{torch.__version__}; link emulated at {args.link_gbps:.0f} GB/s: raw {result['raw_s'] * 1e3:.3f} ms"
    )
    columns = "buffer MiB  bufs  buckets  update ms  raw buckets ms  unpack ms (per bucket)  of raw  of raw buckets"
    print(columns + "  overlap")
    for r in result["rows"]:
        print(
            f"{r['buffer_mib']:>10}  {r['num_buffers']:>4}  {r['buckets']:>7}  {r['update_s'] * 1e3:>9.3f}  "
            f"{r['raw_buckets_s'] * 1e3:>14.3f}  {r['unpack_s'] * 1e3:>9.3f} ({r['unpack_per_bucket_s'] * 1e3:.3f})  "
            f"{r['of_raw']:>6.1%}  {r['of_raw_buckets']:>14.1%}  {r['overlap']:>7.1%}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.trace:
        trace(args.trace, model, 64, 2, args.link_gbps)


if __name__ == "__main__":
    main()
