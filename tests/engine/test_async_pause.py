"""AsyncLLM pause semantics that a trainer's control loop relies on: no call may hang on traffic it does not own."""

from __future__ import annotations

import asyncio
import time

from rlserve import SamplingParams
from rlserve.engine.async_llm import AsyncLLM

RESUME_TO_RETURN_LIMIT_S = 5.0  # generous for a loaded CI machine; the traffic below runs for up to 30 s


def test_resume_ends_a_pending_wait_pause_under_steady_traffic(qwen3_dir) -> None:
    """pause(mode="wait") waits for the requests in flight; a resume from another controller ends that pause, and the
    pending call returns at once, even though new requests keep the engine busy (with the rule "return when nothing is
    in flight" alone, it would wait for the traffic to stop)."""
    engine = AsyncLLM(str(qwen3_dir), num_kv_blocks=512, max_num_seqs=8)
    stop_traffic = asyncio.Event()
    started = 0

    async def worker(w: int) -> None:  # one request after another; the four workers' requests overlap
        nonlocal started
        deadline = time.monotonic() + 30
        while not stop_traffic.is_set() and time.monotonic() < deadline:
            started += 1
            params = SamplingParams(temperature=0.0, max_tokens=150 + 97 * w, ignore_eos=True)
            async for _ in engine.generate({"prompt_token_ids": [5 + w, 7, 9]}, params, request_id=f"r{started}"):
                pass

    async def go() -> float:
        load = asyncio.gather(*(worker(w) for w in range(4)))
        while started < 4:
            await asyncio.sleep(0.01)
        pausing = asyncio.create_task(engine.pause_generation(mode="wait"))
        await asyncio.sleep(0.05)
        assert not pausing.done()  # the requests in flight have not finished
        await engine.resume_generation()
        t0 = time.monotonic()
        await asyncio.wait_for(pausing, 20)
        waited = time.monotonic() - t0
        assert not await engine.is_paused()
        stop_traffic.set()
        await load
        return waited

    try:
        waited = asyncio.run(go())
    finally:
        engine.shutdown()
    assert waited < RESUME_TO_RETURN_LIMIT_S, waited
