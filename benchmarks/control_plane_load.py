"""The control plane under load (issue 20.6): many kept-alive streaming clients while a controller cycles pause(keep),
pause(wait) and pause(abort) with resume, and a trainer process pushes full `nccl` (gloo on CPU) updates, one of
which it dies in (SIGKILL after a few tensors). Counts every request's fate and the control calls' latencies.

CPU:  OMP_NUM_THREADS=1 python benchmarks/control_plane_load.py --clients 1000
GPU:  python3 benchmarks/control_plane_load.py --device cuda --clients 1000 --preset small

A real `rlserve serve` (tiny random model, `--enable-rl-api`, `--weight-update-snapshot` so the abandoned update
restores the previous weights, a short `--weight-transfer-timeout-s`) on 127.0.0.1; the streaming clients run in
`--client-processes` processes of this script, each request a `/v1/completions` stream of `--max-tokens` tokens, the
next sent on the same connection as soon as one ends. A request's fate:
  done       its stream ended with a finish reason and [DONE], with max_tokens tokens (or fewer when stopped)
  aborted    finish reason "abort" (an abort pause ended it), then [DONE]
  refused    503 before the stream began, or an error event with code 503 (engine paused or not serving): retried
  lost       a transport error (no answer, a reset) or a stream that ended without [DONE]
  duplicated more tokens than asked for, or tokens after the choice's finish reason
  5xx        any other status >= 500 or error event >= 500
  4xx        any other status >= 400
The control calls go through `rlserve.rl.client.AsyncRLServeClient` (which retries its idempotent calls after a
transport error). The run passes (exit 0) when nothing was lost, duplicated or answered 5xx, every update but the
killed one completed, and the server serves a completion at the end; the table prints last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from rlserve.engine.wire.process import free_port, reserve_port

API_KEY = "load-key"
MODEL_NAME = "toy"
MODES = ("keep", "wait", "abort")
TRANSFER_TIMEOUT_S = 5.0
SERVER_START_TIMEOUT_S = 300.0
CLIENT_STOP_TIMEOUT_S = 120.0


# ---- a client process: `--client-worker`, a JSON job on stdin, "ready", then "go"; "stop" ends it ----


async def _one_request(http: httpx.AsyncClient, body: dict, max_tokens: int) -> str:
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 503:
                await response.aread()
                return "refused"
            if response.status_code >= 500:
                return "5xx"
            if response.status_code >= 400:
                return "4xx"
            tokens, finish, done, late = 0, None, False, False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        code = int(event["error"].get("code") or 500)
                        return "refused" if code == 503 else "5xx" if code >= 500 else "4xx"
                    for choice in event["choices"]:
                        new = len(choice.get("token_weight_versions") or [])
                        late = late or (finish is not None and new > 0)
                        tokens += new
                        finish = choice.get("finish_reason") or finish
            if late or tokens > max_tokens:
                return "duplicated"
            if not done or finish is None:
                return f"lost: the stream ended without {'[DONE]' if finish else 'a finish reason'}"
            return "aborted" if finish == "abort" else "done"
    except httpx.TransportError as e:
        return f"lost: {type(e).__name__} {e}"[:160]


async def _client_worker() -> None:
    job = json.loads(sys.stdin.readline())
    loop = asyncio.get_running_loop()
    go = loop.run_in_executor(None, sys.stdin.readline)
    limits = httpx.Limits(max_connections=job["connections"], max_keepalive_connections=job["connections"])
    headers = {"Authorization": f"Bearer {API_KEY}"}
    fates: Counter[str] = Counter()
    body = {"model": MODEL_NAME, "prompt": "the control plane", "max_tokens": job["max_tokens"], "stream": True}
    body["return_token_weight_versions"] = True  # one version per token: counts each chunk's tokens
    body.update(temperature=1.0, ignore_eos=True)
    async with httpx.AsyncClient(base_url=job["url"], limits=limits, timeout=None, headers=headers) as http:
        print("ready", flush=True)
        await go
        stop = loop.run_in_executor(None, sys.stdin.readline)

        async def connection() -> None:
            while not stop.done():
                fate = await _one_request(http, body, job["max_tokens"])
                fates[fate] += 1
                if fate == "refused" or fate.startswith("lost"):
                    await asyncio.sleep(0.05)  # a client backs off before sending again

        await asyncio.gather(*(connection() for _ in range(job["connections"])))
    print(json.dumps(fates), flush=True)


# ---- a trainer process: `--trainer-worker PORT CHECKPOINT SEND` ----


def _trainer_worker(port: int, checkpoint: str, send: int) -> None:
    """Joins the engine's group as rank 0, waits for a line, then sends the checkpoint's tensors in sorted order; with
    `send` >= 0 it stops after that many, says "partial" and waits to be killed."""
    import torch
    from safetensors.torch import load_file

    from rlserve.weight_transfer import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

    torch.set_num_threads(1)
    print("ready", flush=True)
    init_info = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "timeout_s": 120}
    group = NCCLWeightTransferEngine.trainer_init(init_info)
    print("joined", flush=True)
    weights = load_file(checkpoint)
    sys.stdin.readline()

    def tensors():
        for i, name in enumerate(sorted(weights)):
            if i == send:
                print("partial", flush=True)
                time.sleep(120)  # bounded: killed long before
                raise SystemExit("not killed")
            yield name, weights[name]

    NCCLWeightTransferEngine.trainer_send_weights(tensors(), NCCLTrainerSendWeightsArgs(group=group))
    print("sent", flush=True)


# ---- the controller (this process) ----


def _tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


class Trainer:
    """One trainer process for one update."""

    def __init__(self, checkpoint: Path, send: int) -> None:
        # Held until the trainer's store is up: a port from free_port was once taken by another process's connection
        # in between (EADDRINUSE under the parallel test suite).
        self._reservation = reserve_port()
        self.port = self._reservation.getsockname()[1]
        cmd = [sys.executable, __file__, "--trainer-worker", str(self.port), str(checkpoint), str(send)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    async def expect(self, word: str) -> None:
        line = (await asyncio.to_thread(self.proc.stdout.readline)).strip()
        if line != word:
            raise RuntimeError(f"trainer said {line!r}, expected {word!r}")
        if word == "joined":
            self._reservation.close()

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        self._reservation.close()
        self.proc.kill()
        self.proc.wait()


async def _update(client, checkpoint: Path, update_info: dict, version: str, kill: bool, log: list[str]) -> float:
    """A full update by a fresh trainer process (pause keep -> start -> update -> finish -> resume); with `kill` the
    trainer dies after a few tensors and the engine must abandon the update by itself. Returns the seconds taken."""
    from rlserve.rl.client import RLServeError

    start = time.perf_counter()
    trainer = Trainer(checkpoint, 3 if kill else -1)
    try:
        await trainer.expect("ready")
        init_info = {"master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": 1, "world_size": 2}
        joined = asyncio.create_task(client.init_weight_transfer_engine(init_info))
        await trainer.expect("joined")
        await joined
        await client.pause("keep")
        await client.start_weight_update()
        received = asyncio.create_task(client.update_weights(update_info))
        trainer.go()
        if kill:
            await trainer.expect("partial")
            trainer.stop()
            try:
                await received
                raise RuntimeError("the engine accepted an update whose trainer died")
            except RLServeError as e:
                log.append(f"killed trainer: update_weights -> {e.status_code}: {str(e)[:160]}")
        else:
            await received
            await trainer.expect("sent")
            await client.finish_weight_update(version)
        await client.resume()
    finally:
        trainer.stop()
    return time.perf_counter() - start


async def _control(args: argparse.Namespace, url: str, checkpoint: Path, update_info: dict) -> dict:
    from rlserve.rl.client import AsyncRLServeClient

    latencies: dict[str, list[float]] = {m: [] for m in (*MODES, "resume", "update")}
    log: list[str] = []
    async with AsyncRLServeClient(url, api_key=API_KEY) as client:
        for cycle in range(args.cycles):
            await asyncio.sleep(args.hold_s)
            if cycle in args.update_cycles or cycle == args.kill_cycle:
                kill = cycle == args.kill_cycle
                latencies["update"].append(await _update(client, checkpoint, update_info, f"v{cycle}", kill, log))
                continue
            mode = MODES[cycle % len(MODES)]
            start = time.perf_counter()
            await client.pause(mode, clear_cache=False)
            latencies[mode].append(time.perf_counter() - start)
            await asyncio.sleep(args.hold_s)
            start = time.perf_counter()
            await client.resume()
            latencies["resume"].append(time.perf_counter() - start)
    return {"latencies": latencies, "log": log}


def _start_server(args: argparse.Namespace, model_dir: Path, workdir: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    cmd = [sys.executable, "-m", "rlserve.cli", "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--device", args.device, "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--enable-rl-api"]
    cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"}), "--weight-update-snapshot"]
    cmd += ["--weight-transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--max-num-seqs", str(args.clients)]
    log = workdir / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=2) as http:  # one client for every poll: httpx.get makes one (TLS context and all)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                if http.get(f"{url}/health").status_code == 200:
                    return proc, url, log
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    raise TimeoutError("the server did not become healthy")


def _stop_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1000:.0f} / {max(values) * 1000:.0f} ms (n={len(values)})"


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--clients", type=int, default=1000, help="concurrent streaming connections in all")
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cycles", type=int, default=12, help="control cycles (pauses of each mode in turn, updates)")
    parser.add_argument("--update-cycles", type=int, nargs="*", default=[3, 9], help="cycles that push an update")
    parser.add_argument("--kill-cycle", type=int, default=6, help="the cycle whose trainer is killed mid-update")
    parser.add_argument("--hold-s", type=float, default=1.0, help="seconds between control calls")
    parser.add_argument("--client-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trainer-worker", nargs=3, metavar=("PORT", "CHECKPOINT", "SEND"), help=argparse.SUPPRESS)
    return parser.parse_args()


def _full_update_info(checkpoint: Path) -> dict:
    """/update_weights' body for every tensor of the checkpoint, one tensor per bucket (a trainer dying part-way
    leaves some written)."""
    from safetensors.torch import load_file

    from rlserve.dtypes import dtype_name

    weights = load_file(checkpoint)
    names = sorted(weights)
    return {
        "names": names,
        "dtype_names": [dtype_name(weights[n].dtype) for n in names],
        "shapes": [list(weights[n].shape) for n in names],
        "packed_buffer_size_bytes": 1,
        "packed_num_buffers": 1,
    }


def _start_clients(args: argparse.Namespace, url: str, clients: list[subprocess.Popen]) -> None:
    """Starts the client processes (into `clients`, which the caller kills however this ends) and sets them going
    once every one is ready."""
    per = -(-args.clients // args.client_processes)
    for _ in range(args.client_processes):
        job = {"url": url, "connections": per, "max_tokens": args.max_tokens}
        worker = subprocess.Popen(
            [sys.executable, __file__, "--client-worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        worker.stdin.write(json.dumps(job) + "\n")
        worker.stdin.flush()
        clients.append(worker)
    for worker in clients:
        if worker.stdout.readline().strip() != "ready":
            raise RuntimeError("a client process failed to start")
    for worker in clients:
        worker.stdin.write("go\n")
        worker.stdin.flush()


def _stop_clients(clients: list[subprocess.Popen], log: list[str]) -> Counter[str]:
    """Stops the client processes and adds up their requests' fates (a lost request's reason goes to `log`)."""
    for worker in clients:
        worker.stdin.write("stop\n")
        worker.stdin.flush()
    fates: Counter[str] = Counter()
    for worker in clients:
        line = worker.stdout.readline()
        if not line:
            raise RuntimeError(f"a client process failed (exit {worker.wait(CLIENT_STOP_TIMEOUT_S)})")
        for fate, count in json.loads(line).items():
            fates[fate.split(":")[0]] += count
            if ":" in fate:  # a lost request's reason
                log.append(f"{count} x {fate}")
    return fates


@dataclass(frozen=True)
class LoadRun:
    """What one run under load came to."""

    fates: Counter[str]
    latencies: dict[str, list[float]]  # the control calls', by kind
    log: list[str]
    elapsed_s: float
    rss_start_mib: float
    rss_end_mib: float
    final_status: int  # of a completion after the load
    health: int


def _run_under_load(
    args: argparse.Namespace, server_pid: int, url: str, checkpoint: Path, update_info: dict
) -> LoadRun:
    """The clients stream while the controller cycles; then a last completion and /health."""
    clients: list[subprocess.Popen] = []
    try:
        rss_start = _tree_rss_mib(server_pid)
        _start_clients(args, url, clients)
        started = time.perf_counter()
        control = asyncio.run(_control(args, url, checkpoint, update_info))
        fates = _stop_clients(clients, control["log"])
        elapsed = time.perf_counter() - started
        rss_end = _tree_rss_mib(server_pid)
        final = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": "still there?", "max_tokens": 4},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
        health = httpx.get(f"{url}/health", timeout=10).status_code
    finally:
        for worker in clients:
            worker.kill()
            worker.wait()
    return LoadRun(fates, control["latencies"], control["log"], elapsed, rss_start, rss_end, final.status_code, health)


def _report(args: argparse.Namespace, run: LoadRun, server_log: Path) -> bool:
    """Prints the log and the table; whether the run passed."""
    fates, latencies = run.fates, run.latencies
    updates_done = len(latencies["update"]) - (1 if args.kill_cycle < args.cycles else 0)
    ok = (
        fates["lost"] == 0
        and fates["duplicated"] == 0
        and fates["5xx"] == 0
        and run.final_status == 200
        and run.health == 200
    )
    for line in run.log:
        print(line)
    print(f"server log: {server_log}")
    print(
        f"\ncontrol plane under load: {args.clients} streaming clients in {args.client_processes} processes, "
        f"max_tokens {args.max_tokens}, {args.cycles} cycles, device {args.device}, preset {args.preset}, "
        f"{run.elapsed_s:.0f} s"
    )
    print("| figure | value |\n|---|---|")
    total = sum(fates.values())
    print(f"| requests | {total} ({total / run.elapsed_s:.0f}/s) |")
    for fate in ("done", "aborted", "refused", "lost", "duplicated", "5xx", "4xx"):
        print(f"| {fate} | {fates[fate]} |")
    for mode in MODES:
        print(f"| pause({mode}) call to return, median / max | {_stats(latencies[mode])} |")
    print(f"| resume, median / max | {_stats(latencies['resume'])} |")
    print(f"| full updates (trainer process start to resume), median / max | {_stats(latencies['update'])} |")
    print(f"| updates completed / killed mid-update | {updates_done} / {int(args.kill_cycle < args.cycles)} |")
    print(f"| server RSS, start -> end | {run.rss_start_mib:.0f} -> {run.rss_end_mib:.0f} MiB |")
    print(f"| final completion / health | {run.final_status} / {run.health} |")
    print(f"| verdict | {'PASS' if ok else 'FAIL'} |")
    return ok


def main() -> int:
    args = _parse_args()
    if args.client_worker:
        asyncio.run(_client_worker())
        return 0
    if args.trainer_worker:
        port, checkpoint, send = args.trainer_worker
        _trainer_worker(int(port), checkpoint, int(send))
        return 0

    from rlserve.toy import make_model_dir

    workdir = Path(tempfile.mkdtemp(prefix="rlserve-load-"))
    model_dir = make_model_dir(workdir / "toy", preset=args.preset)
    checkpoint = model_dir / "model.safetensors"
    update_info = _full_update_info(checkpoint)
    proc, url, server_log = _start_server(args, model_dir, workdir)
    try:
        run = _run_under_load(args, proc.pid, url, checkpoint, update_info)
    finally:
        _stop_group(proc)
    return 0 if _report(args, run, server_log) else 1


if __name__ == "__main__":
    sys.exit(main())
