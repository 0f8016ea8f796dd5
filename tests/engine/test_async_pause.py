"""AsyncLLM pause semantics that a trainer's control loop relies on: no call may hang on traffic it does not own."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlserve import RequestOutputKind, SamplingParams
from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.engine.frontend.core_client import RetryableRequestError

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
            try:
                async for _ in engine.generate({"prompt_token_ids": [5 + w, 7, 9]}, params, request_id=f"r{started}"):
                    pass
            except RetryableRequestError:  # sent during the wait-pause, which refuses new requests: retried
                await asyncio.sleep(0.01)

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


PAUSE_REPETITIONS = 200
TOKEN_WAIT_S = 30.0  # bound on waiting for the streams to move again after a resume


def test_no_token_arrives_between_keep_pause_and_resume(qwen3_dir, monkeypatch) -> None:
    """vLLM 0.33's contract: once pause_generation(mode="keep") returns, no token reaches a consumer until resume,
    with async scheduling on (the step in flight when the pause arrives is read back and delivered before the pause
    returns). The paused tokens are not lost either: every stream ends with the tokens of an unpaused run."""
    monkeypatch.setenv("RLSERVE_ENABLE_MULTIPROCESSING", "0")  # in process: the core steps on a thread
    engine = AsyncLLM(str(qwen3_dir), num_kv_blocks=256, async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    prompts = [[5 + i, 7, 9, 11] for i in range(3)]
    paused = False
    late: list[tuple[int, str]] = []  # (repetition, request) of every output received while paused
    received = 0
    runs: dict[str, list[int]] = {}
    done = asyncio.Event()
    repetition = 0

    async def consume(i: int) -> None:
        nonlocal received
        run = 0
        while not done.is_set():
            request_id = f"s{i}-{run}"
            tokens = runs[request_id] = []
            async for out in engine.generate({"prompt_token_ids": prompts[i]}, params, request_id=request_id):
                if paused:
                    late.append((repetition, request_id))
                tokens += out.outputs[0].token_ids
                received += 1
            run += 1

    async def control() -> None:
        nonlocal paused, repetition
        for repetition in range(PAUSE_REPETITIONS):
            target, deadline = received + 2, time.monotonic() + TOKEN_WAIT_S
            while received < target:
                assert time.monotonic() < deadline, "the streams stopped moving"
                await asyncio.sleep(0.001)
            await engine.pause_generation(mode="keep", clear_cache=repetition % 2 == 1)
            paused = True
            await asyncio.sleep(0.01)  # time for a step in flight to land, had it not been read back
            paused = False
            await engine.resume_generation()
        done.set()

    async def go() -> dict[str, list[int]]:
        consumers = [asyncio.create_task(consume(i)) for i in range(len(prompts))]
        await control()
        await asyncio.wait_for(asyncio.gather(*consumers), TOKEN_WAIT_S)
        expected = {}
        for i, prompt in enumerate(prompts):
            async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=f"unpaused-{i}"):
                expected.setdefault(i, []).extend(out.outputs[0].token_ids)
        return expected

    try:
        expected = asyncio.run(go())
    finally:
        engine.shutdown()
    assert late == [], f"{len(late)} outputs arrived between a keep-pause's return and the resume: {late[:5]}"
    assert len(runs) > len(prompts)  # the streams ran to their end and started again
    for request_id, tokens in runs.items():
        assert tokens == expected[int(request_id[1])], f"{request_id}: tokens lost, duplicated or changed"


def test_abort_and_wait_pauses_refuse_new_requests_retryably(qwen3_dir, monkeypatch) -> None:
    """vLLM 0.33: from the start of a pause in mode abort or wait until resume, new requests end at once with
    RetryableRequestError rather than queue; a keep-pause queues them, to run after resume."""
    monkeypatch.setenv("RLSERVE_ENABLE_MULTIPROCESSING", "0")
    engine = AsyncLLM(str(qwen3_dir), num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def run(request_id: str) -> list[int]:
        async for out in engine.generate({"prompt_token_ids": [3, 4, 5]}, params, request_id=request_id):
            final = out
        return final.outputs[0].token_ids

    async def go() -> None:
        expected = await run("before")
        # A stream that the abort-pause ends keeps every token the core sampled for it (the step in flight included).
        generated = (await engine.stats())["num_generated_tokens"]
        long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        outputs = []

        async def consume() -> None:
            async for out in engine.generate({"prompt_token_ids": [6, 7, 8]}, long, request_id="aborted"):
                outputs.append(out)

        consumer = asyncio.create_task(consume())
        while len(outputs) < 3:
            await asyncio.sleep(0.001)
        for mode in ("abort", "wait"):
            await engine.pause_generation(mode=mode)
            if mode == "abort":
                assert consumer.done()  # the abort-pause's streams end before it returns
                last = outputs[-1]
                assert last.finished and last.outputs[0].finish_reason == "abort"
                sampled = (await engine.stats())["num_generated_tokens"] - generated
                assert len(last.outputs[0].token_ids) == sampled < long.max_tokens
            assert engine.rejecting_new_requests
            with pytest.raises(RetryableRequestError, match="paused.*retry"):
                await run(f"refused-{mode}")
            await engine.resume_generation()
            assert not engine.rejecting_new_requests
            assert await run(f"after-{mode}") == expected
        await engine.pause_generation(mode="keep")
        assert not engine.rejecting_new_requests
        queued = asyncio.create_task(run("queued"))
        await asyncio.sleep(0.2)
        assert not queued.done()
        await engine.resume_generation()
        assert await asyncio.wait_for(queued, TOKEN_WAIT_S) == expected

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
