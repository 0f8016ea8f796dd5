"""The engine-side cost of a full weight update with FP8 quantization against bf16: the model's `load_weights` of a
whole bf16 checkpoint already on the device (what every backend calls once the bytes have arrived), into a bf16 model
(a copy) and into FP8 models (quantized into the same storage), medians of --repeats in one call. The transfer
itself is the same bytes for all of them (the trainer sends bf16; W4, benchmarks/weight_sync.py, measures it), so
the update time with quantization is W4's transfer plus this column's FP8 load, against W4's plus the bf16 load.

    python benchmarks/fp8_update.py --device cuda --preset qwen3-8b-shape --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlserve.model.fp8 import Fp8Scheme
from rlserve.model.loader import build_model, initialize_dummy_weights, load_hf_config
from rlserve.toy import make_config_dir


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="qwen3-8b-shape")
    ap.add_argument("--repeats", type=int, default=3, help="timed updates per model, after one untimed")
    ap.add_argument("--out", default=None, help="write the medians (seconds per method) as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = load_hf_config(str(make_config_dir(Path(tempfile.mkdtemp()) / args.preset, args.preset)))
    source = build_model(cfg, torch.bfloat16, device)
    initialize_dummy_weights(source)
    weights = [(name, tensor.clone()) for name, tensor in source.checkpoint_weights()]  # the trainer's bf16 tensors
    del source
    gigabytes = sum(t.numel() * t.element_size() for _, t in weights) / 1e9
    print(f"{args.preset}: {len(weights)} bf16 tensors, {gigabytes:.1f} GB, on {device}", flush=True)
    medians = {}
    for method in ("none", "fp8", "fbgemm_fp8"):
        model = build_model(cfg, torch.bfloat16, device, fp8=None if method == "none" else Fp8Scheme(method))
        seconds = []
        for _ in range(args.repeats + 1):
            _synchronize(device)
            start = time.perf_counter()
            model.load_weights(weights)
            _synchronize(device)
            seconds.append(time.perf_counter() - start)
        medians[method] = statistics.median(seconds[1:])
        print(f"[{method}] load_weights of the whole model: {medians[method] * 1e3:.0f} ms (median of {args.repeats})")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for method, s in medians.items():
        print(f"{method}: {s * 1e3:.0f} ms, {s / medians['none']:.2f}x bf16's")
    if args.out:
        Path(args.out).write_text(json.dumps({"preset": args.preset, "repeats": args.repeats, "median_s": medians}))


if __name__ == "__main__":
    main()
