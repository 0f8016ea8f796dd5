"""W7 (server): the W1 workload through the HTTP server by concurrent clients, relative to `LLM.generate` offline.

CPU (defaults):  python benchmarks/server_throughput.py
GPU:             python benchmarks/server_throughput.py --device cuda --preset qwen3-0.6b-shape \
                     --num-prompts 1024 --input-len 256 --output-len 256

Both sides get the same engine arguments and, per repetition, the same fresh random prompts (fresh so the prefix
cache of an earlier repetition cannot help). The server runs in its own process (`rlserve serve`); the clients are
`--concurrency` httpx tasks spread over `--client-processes` processes, each sending one non-streaming (or
`--stream`) /v1/completions at a time with token-id prompts, temperature 1.0, top-p 1.0, EOS ignored. Reported:
output tokens/s per repetition, their median, and the server/offline ratio of medians; then, per server set-up,
each role's CPU per output token and its busiest process's CPU share of the wall time (benchmarks/process_cpu.py):
the API server and the engine core, to tell which of them bounds the server. Flags of `rlserve serve` that
are not engine flags reach the server alone through `--server-arg=--flag=value` (repeatable), e.g.
`--server-arg=--api-server-count=2`.

Several server set-ups against one offline measurement: `--variant "stream --api-server-count=4 --stream-interval=4"`
(repeatable; `stream` makes the clients stream, the rest are server flags). Variants with the same server flags share
one server.

On a CPU shared with other work, torch's intra-op threads can stall each other and cut throughput tenfold at random;
`--cpu-threads 1` (both sides) gives figures that mean something there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from process_cpu import ROLES, cpu_by_role, role_usage
from w7_clients import send_all
from workloads import w1_sampling, w7_prompts

from rlserve import LLM
from rlserve.engine.frontend.args import add_engine_arguments, engine_flags, engine_kwargs
from rlserve.engine.wire.process import free_port
from rlserve.toy import make_model_dir

SERVER_START_TIMEOUT_S = 600.0
CLIENTS = Path(__file__).with_name("w7_clients.py")
CLIENT_TIMEOUT_S = 30.0  # for a client process to exit after its result


def engine_args(args: argparse.Namespace) -> dict:
    return {**engine_kwargs(args), "max_model_len": args.input_len + args.output_len + 16}


_T0 = time.monotonic()


def progress(message: str) -> None:
    """A line on stderr as each phase ends: a run cut off by a time limit still shows how far it got."""
    print(f"[{time.monotonic() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


def run_offline(model_dir: str, args: argparse.Namespace, prompt_sets: list[list[list[int]]]) -> list[float]:
    llm = LLM(model_dir, **engine_args(args))
    progress("offline engine started")
    params = w1_sampling(args.output_len)
    llm.generate([{"prompt_token_ids": p} for p in prompt_sets[0][:4]], params, use_tqdm=False)  # warm-up
    rates = []
    for prompts in prompt_sets[1:]:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        rates.append(sum(len(c.token_ids) for o in outs for c in o.outputs) / dt)
        progress(f"offline: {rates[-1]:.0f} tok/s")
    llm.shutdown()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rates


def start_server(
    model_dir: str, args: argparse.Namespace, server_args: list[str], port: int, log: Path
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlserve.cli", "serve", model_dir, "--port", str(port), "--log-level", "warning"]
    cmd += engine_flags(**engine_args(args))
    cmd += server_args  # server-only flags (not engine fields), e.g. --api-server-count=2
    env = dict(os.environ)
    if args.cpu_threads:
        env["OMP_NUM_THREADS"] = str(args.cpu_threads)  # torch's intra-op threads in the server process
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    with httpx.Client(timeout=2) as http:  # one client for every poll: httpx.get makes one (TLS context and all)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                if http.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return proc
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"server not healthy after {SERVER_START_TIMEOUT_S:g} s")


@dataclass(frozen=True)
class Repetition:
    """One measured repetition: output tok/s, and per role (process_cpu.ROLES) the CPU microseconds spent per output
    token by all its processes and the busiest one's share of the wall time (near 1.0: that process is the bound)."""

    tok_s: float
    us_per_token: dict[str, float]
    busiest_share: dict[str, float]


def _send_from_processes(url: str, prompts: list[list[int]], args: argparse.Namespace, model: str) -> float:
    """The prompts split over `--client-processes` client processes (benchmarks/w7_clients.py), released together
    once all are connected: one Python process cannot drive a thousand connections (httpx's pool scans every
    connection per request) as fast as the server answers them."""
    n = min(args.client_processes, len(prompts))
    concurrency = -(-args.concurrency // n)
    procs = [
        subprocess.Popen([sys.executable, str(CLIENTS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    try:
        for i, proc in enumerate(procs):
            job = dict(
                url=url, prompts=prompts[i::n], model=model, concurrency=concurrency, output_len=args.output_len,
                stream=args.stream,
            )  # fmt: skip
            proc.stdin.write(json.dumps(job) + "\n")
            proc.stdin.flush()
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a W7 client process failed to start")
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        parts = []
        for proc in procs:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a W7 client process failed (exit {proc.wait(CLIENT_TIMEOUT_S)})")
            parts.append(json.loads(line))
    finally:
        for proc in procs:
            try:
                proc.wait(CLIENT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    total = sum(p["tokens"] for p in parts)
    t0, t1 = min(p["t0"] for p in parts), max(p["t1"] for p in parts)
    expected = len(prompts) * args.output_len
    if total != expected:
        raise RuntimeError(f"the server returned {total} tokens, expected {expected}")
    return total / (t1 - t0)


def run_server(
    model_dir: str, args: argparse.Namespace, server_args: list[str], streams: list[bool], prompt_sets: list
) -> dict[bool, list[Repetition]]:
    """One server with `server_args`, measured with each client mode in `streams`: {stream: repetitions}."""
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="rlserve-w7-")) / "server.log"
    proc = start_server(model_dir, args, server_args, port, log)
    progress(f"server {' '.join(server_args) or '(defaults)'} healthy")
    url = f"http://127.0.0.1:{port}"
    try:
        rates = {}
        for stream in streams:
            mode = argparse.Namespace(**{**vars(args), "stream": stream})
            warm_up = dict(url=url, prompts=prompt_sets[0][:4], model=model_dir, concurrency=4, stream=stream)
            asyncio.run(send_all({**warm_up, "output_len": args.output_len}))
            rates[stream] = []
            for prompts in prompt_sets[1:]:
                before, t0 = cpu_by_role(proc.pid), time.monotonic()
                tok_s = _send_from_processes(url, prompts, mode, model_dir)
                usage, wall_s = role_usage(before, cpu_by_role(proc.pid)), time.monotonic() - t0
                tokens = len(prompts) * args.output_len
                rates[stream].append(
                    Repetition(
                        tok_s,
                        {role: total * 1e6 / tokens for role, (total, _) in usage.items()},
                        {role: busiest / wall_s for role, (_, busiest) in usage.items()},
                    )
                )
                progress(f"server {'stream ' if stream else ''}{' '.join(server_args)}: {tok_s:.0f} tok/s")
        return rates
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def print_process_cpu(measured: list[tuple[str, tuple]], server: dict[tuple, list[Repetition]]) -> None:
    """Per measured (name, variant): each role's CPU per output token and its busiest process's share, medians."""
    print("\nThe server's processes in those repetitions (medians): CPU microseconds per output token of a role's")
    print("processes, and its busiest process's CPU time over the wall time (near 1.0: that process is the bound)")
    header = " | ".join(f"{role + ' us/token':>22} | {role + ' busiest':>20}" for role in ROLES)
    print(f"| {'mode':<52} | {header} |")
    print(f"|{'-' * 54}|" + "|".join(f"{'-' * 24}|{'-' * 22}" for _ in ROLES) + "|")
    for name, v in measured:
        reps = server[v]
        cells = " | ".join(
            f"{statistics.median(r.us_per_token[role] for r in reps):>22.1f} | "
            f"{statistics.median(r.busiest_share[role] for r in reps):>20.2f}"
            for role in ROLES
        )
        print(f"| {name:<52} | {cells} |")


def _parse_variant(spec: str) -> tuple[bool, tuple[str, ...]]:
    words = spec.split()
    flags = tuple(w for w in words if w != "stream")
    if any(not w.startswith("--") for w in flags):
        raise SystemExit(f"--variant {spec!r}: expected 'stream' and --flag=value words")
    return "stream" in words, flags


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=None, help="concurrent HTTP clients (default: all prompts)")
    ap.add_argument(
        "--client-processes",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) // 2)),
        help="processes the clients are spread over (default: half the cores, at most 8)",
    )
    ap.add_argument("--stream", action="store_true", help="clients stream (SSE) instead of waiting for the whole")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--cpu-threads", type=int, default=None, help="torch intra-op threads, both sides")
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `rlserve serve` argument for the server side only, repeatable; write it as --server-arg=--flag=v",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="SPEC",
        help='a server set-up to measure, repeatable: "[stream] [--serve-flag=value ...]" (instead of --stream and '
        "--server-arg)",
    )
    # --dtype not given: bfloat16 on cuda, float32 on cpu (the toy model is made in it too).
    add_engine_arguments(ap, defaults={"device": "cpu", "max_num_seqs": 1024, "max_num_batched_tokens": 16384})
    args = ap.parse_args()
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    if "dtype" not in vars(args):
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.concurrency = args.concurrency or args.num_prompts

    model_dir = args.model_dir
    if model_dir is None:
        path = tempfile.mkdtemp(prefix="rlserve-w7-model-")
        model_dir = str(make_model_dir(path, preset=args.preset, dtype=getattr(torch, args.dtype)))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    # Set 0 warms up; sets 1..repeats are measured, the same ones on both sides.
    prompt_sets = [w7_prompts(args.num_prompts, args.input_len, vocab, seed) for seed in range(args.repeats + 1)]

    variants = [_parse_variant(v) for v in args.variant] or [(args.stream, tuple(args.server_arg))]
    offline = run_offline(model_dir, args, prompt_sets)
    server: dict[tuple[bool, tuple[str, ...]], list[Repetition]] = {}
    for server_args in dict.fromkeys(flags for _, flags in variants):  # one server per set of flags, in order
        streams = [stream for stream, flags in variants if flags == server_args]
        for stream, rates in run_server(model_dir, args, list(server_args), streams, prompt_sets).items():
            server[stream, server_args] = rates
    off_med = statistics.median(offline)

    print(
        f"\nW7 server throughput: preset={args.preset} device={args.device} dtype={args.dtype} "
        f"prompts={args.num_prompts} in={args.input_len} out={args.output_len} concurrency={args.concurrency} "
        f"client_processes={args.client_processes} repeats={args.repeats} "
        f"cpu_threads={args.cpu_threads or torch.get_num_threads()}"
    )
    print(f"| {'mode':<52} | {'output tok/s per repetition':<28} | {'median tok/s':>12} | {'vs offline':>10} |")
    print(f"|{'-' * 54}|{'-' * 30}|{'-' * 14}|{'-' * 12}|")
    names = [" ".join(["server", *(["stream"] if stream else []), *flags]) for stream, flags in variants]
    measured = list(zip(names, variants, strict=True))
    rows = [("offline", offline)] + [(name, [r.tok_s for r in server[v]]) for name, v in measured]
    for name, rates in rows:
        reps = ", ".join(f"{r:.0f}" for r in rates)
        med = statistics.median(rates)
        print(f"| {name:<52} | {reps:<28} | {med:>12.0f} | {med / off_med:>10.3f} |")
    print_process_cpu(measured, server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
