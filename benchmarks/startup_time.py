"""Start-up time of `rlserve serve`: seconds from starting the server process to its first served completion.

CPU:  python benchmarks/startup_time.py --device cpu --preset tiny
GPU:  python benchmarks/startup_time.py --device cuda --preset qwen3-0.6b-shape

The model directory is built first (random weights, `rlserve.toy.make_model_dir`, not timed; or `--model-dir`). Then
`python -m rlserve.cli serve DIR` starts on a free 127.0.0.1 port with the engine's defaults for the device (extra
`serve` flags through `--serve-arg=--flag=value`, repeatable); the clock starts just before the process does, so the
interpreter's start and the imports count. Reported: seconds until /health first answers 200, and until the first
/v1/completions request (a short text prompt, `--max-tokens` tokens, EOS ignored) has returned; with
`--serve-arg=--log-level=info`, also the start-up timeline read from the server's log (each phase's line, seconds
after the process was started: the front end's imports, the fork server's, the core's load, KV cache, graphs and
warm-up, serving). The server runs in a
process group of its own, killed at the end whatever happened (also on SIGTERM, as `timeout` sends), so neither it nor
its engine-core process outlives this script. The exit status is non-zero when the server fails to start or to
answer within `--timeout` seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rlserve.engine.wire.process import free_port

API_KEY_ENV = "RLSERVE_API_KEY"


def build_model(preset: str, dtype_name: str) -> str:
    import torch

    from rlserve.toy import make_model_dir

    path = tempfile.mkdtemp(prefix="rlserve-startup-model-")
    return str(make_model_dir(path, preset=preset, dtype=getattr(torch, dtype_name)))


def stop(proc: subprocess.Popen) -> None:
    """Terminate the server's whole process group (the server, its engine core, any helper), then kill what is left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group, even when the server itself exited
    except ProcessLookupError:
        pass
    proc.wait()


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--model-dir", default=None, help="an existing model directory (default: build one)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to the first completion before giving up")
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `rlserve serve` argument, repeatable; write it as --serve-arg=--flag=value",
    )
    ap.add_argument("--log", default=None, help="write the server's output here (default: a temporary file)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    return ap


def main() -> int:
    args = _parser().parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")

    model_dir = args.model_dir or build_model(args.preset, dtype)
    port = free_port()
    log = Path(args.log) if args.log else Path(tempfile.mkdtemp(prefix="rlserve-startup-")) / "server.log"
    cmd = [sys.executable, "-m", "rlserve.cli", "serve", model_dir, "--device", args.device, "--dtype", dtype]
    cmd += ["--port", str(port), "--log-level", "warning", *args.serve_arg]
    api_key = os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = dict(model=model_dir, prompt="Hello, world", max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    url = f"http://127.0.0.1:{port}"

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)  # so that `finally` stops the server when this script is told to stop
    print(f"starting: {' '.join(cmd)}", flush=True)
    result: dict = dict(device=args.device, preset=args.preset, dtype=dtype, serve_args=args.serve_arg, ok=False)
    with log.open("wb") as out:
        t0 = time.perf_counter()
        started_at = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = t0 + args.timeout
        health_s = None
        with httpx.Client(base_url=url, headers=headers, timeout=max(1.0, args.timeout)) as http:
            while health_s is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}) before answering /health")
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"/health did not answer 200 within {args.timeout:g} s")
                try:
                    if http.get("/health", timeout=2).status_code == 200:
                        health_s = time.perf_counter() - t0
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            t1 = time.perf_counter()
            response = http.post("/v1/completions", json=body, timeout=max(1.0, deadline - t1))
            first_s = time.perf_counter() - t0
            response.raise_for_status()
            tokens = response.json()["usage"]["completion_tokens"]
        if tokens != args.max_tokens:
            raise RuntimeError(f"the first completion had {tokens} tokens, expected {args.max_tokens}")
        request_s = first_s - (t1 - t0)
        result.update(ok=True, health_s=health_s, first_completion_s=first_s, request_s=request_s)
        print(
            f"startup: preset={args.preset} device={args.device} dtype={dtype} "
            f"serve_args={' '.join(args.serve_arg) or '-'}: /health 200 after {health_s:.2f} s, "
            f"first completion ({tokens} tokens) after {first_s:.2f} s (the request itself {request_s:.2f} s)",
            flush=True,
        )
        result["timeline"] = timeline(log, started_at)
        for offset, process, message in result["timeline"]:
            print(f"  {offset:6.2f} s  {process:<20} {message}", flush=True)
        return_code = 0
    except (Exception, SystemExit) as e:
        result["error"] = repr(e)
        print(f"startup FAILED: {e!r}\n--- server log (tail) ---\n{_tail(log)}", file=sys.stderr, flush=True)
        return_code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) and e.code else 1
    finally:
        stop(proc)
    result["server_exit"] = proc.returncode
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return return_code


# rlserve.log.FORMAT's start: "2026-12-07 02:40:10,567 INFO rlserve-engine-core rlserve.x.y: message".
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO (\S+) (\S+): (.*)$")


def timeline(log: Path, started_at: float) -> list[tuple[float, str, str]]:
    """The server's start-up timeline from its log at --log-level info: each rlserve line up to the one that says it
    serves, as (seconds after the server's process was started, process, message). The core's phases (load, KV
    cache, graphs, warm-up) and the lines that say `start-up:` (the imports, the fork server's preload, the
    tokenizer) are among them."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        match = _LOG_LINE.match(line)
        if match is None:
            continue
        stamp, process, _, message = match.groups()
        at = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        rows.append((round(at - started_at, 3), process, message[:150]))
        if message.startswith("serving "):
            break
    return rows


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(no log: {e!r})"


if __name__ == "__main__":
    sys.exit(main())
