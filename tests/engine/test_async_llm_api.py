"""AsyncLLM's vLLM 0.33 surface besides generate: construction from (Async)EngineArgs, add_request with its output
collector, abort(request_id, internal=...), and start_profile/stop_profile refused without a profiler_config."""

from __future__ import annotations

import asyncio

import pytest

from rlserve import AsyncEngineArgs, AsyncLLM, SamplingParams

PROMPT = {"prompt_token_ids": [5, 17, 200, 33]}
SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)


async def until_finished(collector) -> list:
    outputs = []
    while not outputs or not outputs[-1].finished:
        outputs.append(await asyncio.wait_for(collector.get(), 60))
    return outputs


def test_from_engine_args_add_request_and_abort(qwen3_dir, monkeypatch) -> None:
    monkeypatch.setenv("RLSERVE_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['enable_log_requests'\]"):
        AsyncEngineArgs(model=str(qwen3_dir), enable_log_requests=True).create_engine_config()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(qwen3_dir), num_kv_blocks=64))
    assert engine.config.num_kv_blocks == 64

    async def go() -> None:
        expected = [out async for out in engine.generate(PROMPT, SHORT, request_id="reference")][-1]
        collector = await engine.add_request("a", PROMPT, SHORT)
        outputs = await until_finished(collector)
        assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
        assert collector.get_nowait() is None and "a" not in engine._streams

        for name, value in (("priority", 1), ("lora_request", object()), ("data_parallel_rank", 0)):
            with pytest.raises(ValueError, match=f"^{name}: not supported"):
                await engine.add_request("refused", PROMPT, SHORT, **{name: value})
        assert "refused" not in engine._streams

        collector = await engine.add_request("long", PROMPT, LONG)
        await asyncio.wait_for(collector.get(), 60)  # it runs
        await engine.abort("long", internal=True)
        last = (await until_finished(collector))[-1]
        assert last.outputs[0].finish_reason == "abort" and len(last.outputs[0].token_ids) < LONG.max_tokens
        assert "long" not in engine._streams and (await engine.stats())["num_running"] == 0

        # vLLM's refusal when the engine has no profiler_config, naming what to set
        for call in (engine.start_profile, engine.stop_profile):
            with pytest.raises(RuntimeError, match="^profiling is not enabled: start the engine with profiler_config"):
                await call()

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
