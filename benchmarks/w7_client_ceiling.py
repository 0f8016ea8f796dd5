"""W7's load client against a server that answers instantly: the most output tokens per second W7's clients can
take in, so that a W7 figure is known to measure the server, not its clients (issue 33).

CPU:  python benchmarks/w7_client_ceiling.py
GPU host (as gpu_server.sh runs it beside W7):  python benchmarks/w7_client_ceiling.py --num-prompts 1024 \
          --output-len 256 --repeats 3

The clients are W7's own (benchmarks/w7_clients.py, `--client-processes` processes released together, as
server_throughput.py runs them) with W7's requests; the server is `--server-processes` uvicorn processes on one
listening socket, each a bare ASGI app that answers /v1/completions without an engine: non-streaming, one JSON body
with the usage; streaming, one SSE event per token in rlserve's chunk shape (each written on its own, the loop
yielding between events so that the streams interleave as an engine's steps make them), then [DONE]. Reported per
mode: output tok/s per repetition and their median, and the clients' CPU time over their wall time (near one core
per client process: the clients are the bound; well under: the instant server is, add --server-processes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import socket
import statistics
import sys
import time

import httpx
from server_throughput import _send_from_processes
from workloads import w7_prompts

from rlserve.engine.wire.process import free_port

VOCAB = 151_936  # qwen3-0.6b-shape's: W7's prompts are token ids below it
START_TIMEOUT_S = 60.0


def _chunk_event(index: int) -> bytes:
    chunk = {
        "id": "cmpl-instant",
        "object": "text_completion",
        "created": 0,
        "model": "instant",
        "choices": [{"index": index, "text": "a", "finish_reason": None, "token_weight_versions": ["0"]}],
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


async def instant_completions(scope: dict, receive, send) -> None:
    """The ASGI app: /health, and /v1/completions answered at once with the request's max_tokens tokens."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    request = json.loads(body)
    tokens = request["max_tokens"]
    if not request.get("stream"):
        answer = {"choices": [{"index": 0, "text": "a" * tokens}], "usage": {"completion_tokens": tokens}}
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    event = _chunk_event(0)
    for _ in range(tokens):
        await send({"type": "http.response.body", "body": event, "more_body": True})
        await asyncio.sleep(0)  # the other streams' events next, as one engine step emits one event per stream
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _serve(sock: socket.socket) -> None:
    import uvicorn

    config = uvicorn.Config(instant_completions, log_level="warning", http="httptools", loop="uvloop", lifespan="on")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the instant server did not answer /health within {START_TIMEOUT_S:g} s")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the client processes once they were waited for
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=None, help="concurrent HTTP clients (default: all prompts)")
    ap.add_argument(
        "--client-processes",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) // 2)),
        help="as server_throughput.py's (default: half the cores, at most 8)",
    )
    ap.add_argument("--server-processes", type=int, default=max(1, (os.cpu_count() or 2) // 4))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    args.concurrency = args.concurrency or args.num_prompts

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    port = free_port()
    sock.bind(("127.0.0.1", port))
    sock.listen(4096)
    sock.set_inheritable(True)
    context = multiprocessing.get_context("spawn")
    servers = [context.Process(target=_serve, args=(sock,), daemon=True) for _ in range(args.server_processes)]
    for server in servers:
        server.start()
    url = f"http://127.0.0.1:{port}"
    results: dict[str, tuple[list[float], float]] = {}
    try:
        _wait_healthy(url)
        for mode in ("non-streaming", "streaming"):
            mode_args = argparse.Namespace(**{**vars(args), "stream": mode == "streaming"})
            rates, busy = [], []
            for seed in range(args.repeats):
                prompts = w7_prompts(args.num_prompts, args.input_len, VOCAB, seed)
                cpu, started = _children_cpu_s(), time.perf_counter()
                rates.append(_send_from_processes(url, prompts, mode_args, "instant"))
                wall = time.perf_counter() - started
                busy.append((_children_cpu_s() - cpu) / (wall * min(args.client_processes, len(prompts))))
            results[mode] = (rates, statistics.median(busy))
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.join(10)
            if server.is_alive():
                server.kill()
                server.join()
        sock.close()

    print(
        f"\nW7 client ceiling (instant server): prompts={args.num_prompts} in={args.input_len} out={args.output_len} "
        f"concurrency={args.concurrency} client_processes={args.client_processes} "
        f"server_processes={args.server_processes} repeats={args.repeats}"
    )
    print("| mode          | output tok/s per repetition   | median tok/s | client CPU / wall per process |")
    print("|---------------|-------------------------------|--------------|-------------------------------|")
    for mode, (rates, busy) in results.items():
        reps = ", ".join(f"{r:.0f}" for r in rates)
        print(f"| {mode:<13} | {reps:<29} | {statistics.median(rates):>12.0f} | {busy:>29.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
