"""GPU time of one call, as a decode step sees it: replayed from a CUDA graph, without the host's launch cost.

Used by fp8_gemm.py and moe_layer_profile.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

# Calls captured per CUDA graph: a replay's time over this is one call's GPU time, without the host's launch cost
# (what a decode step, which replays graphs, sees; an eager call of a small kernel measures mostly its launch).
CALLS_PER_GRAPH = 10


def median_ms(fn: Callable[[], object], iters: int) -> float:
    fn()  # compiles Triton kernels and picks cuBLASLt's algorithms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / CALLS_PER_GRAPH)
    return statistics.median(times)
