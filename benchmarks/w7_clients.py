"""W7's HTTP clients, one process each: `python benchmarks/w7_clients.py` reads a job (JSON, one line) on stdin,
connects, prints `ready`, waits for a `go` line, sends the job's prompts over `concurrency` connections and prints
the result as one JSON line: {"tokens", "t0", "t1"} (output tokens, wall-clock first send and last answer).

A script of its own that imports nothing heavy (no torch): W7 starts eight of these per measurement, and they are
released together once all are ready instead of after a guessed delay."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx


async def _one(http: httpx.AsyncClient, body: dict, stream: bool) -> int:
    if not stream:
        response = await http.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]
    tokens = 0
    async with http.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "return_token_weight_versions": True}
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                tokens += sum(len(c.get("token_weight_versions") or []) for c in json.loads(line[6:])["choices"])
    return tokens


async def send_all(job: dict, go: asyncio.Future | None = None) -> dict:
    """Send job["prompts"] over job["concurrency"] connections (after `go`, if given)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in job["prompts"]:
        queue.put_nowait(p)
    concurrency = job["concurrency"]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    common = dict(model=job["model"], max_tokens=job["output_len"], temperature=1.0, top_p=1.0, ignore_eos=True)
    total = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal total
        while not queue.empty():
            prompt = queue.get_nowait()
            tokens = await _one(http, {**common, "prompt": prompt}, job["stream"])
            total += tokens  # not `total += await ...`: that reads total before the await and loses updates

    async with httpx.AsyncClient(base_url=job["url"], limits=limits, timeout=None) as http:
        if go is not None:
            await go
        t0 = time.time()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        t1 = time.time()
    return {"tokens": total, "t0": t0, "t1": t1}


async def _main() -> None:
    job = json.loads(sys.stdin.readline())
    loop = asyncio.get_running_loop()
    go = loop.run_in_executor(None, sys.stdin.readline)  # the `go` line
    print("ready", flush=True)
    print(json.dumps(await send_all(job, go)), flush=True)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options; the job comes on stdin
    asyncio.run(_main())
