"""AsyncLLM's vLLM 0.33 surface besides generate: construction from (Async)EngineArgs (and the VllmConfig of their
create_engine_config), add_request with its output collector, abort(request_id, internal=...),
wait_for_requests_to_drain, and start_profile/stop_profile (a trace of each engine-core process)."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json

import pytest

from rlserve import AsyncEngineArgs, AsyncLLM, SamplingParams
from rlserve.engine.frontend.args import UsageContext
from rlserve.engine.worker.tracing import STEP_RANGE

PROMPT = {"prompt_token_ids": [5, 17, 200, 33]}
SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)


async def until_finished(collector) -> list:
    outputs = []
    while not outputs or not outputs[-1].finished:
        outputs.append(await asyncio.wait_for(collector.get(), 60))
    return outputs


def test_the_vllm_config_takes_what_callers_set_on_it_and_refuses_the_rest(qwen3_dir) -> None:
    # verl spells a False boolean whose default is True as --no-x, from the fields of vLLM's EngineArgs dataclass.
    fields = {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}
    assert fields["enable_prefix_caching"].type is bool and fields["enable_prefix_caching"].default is True
    assert AsyncEngineArgs(model=str(qwen3_dir), max_num_seqs=3).max_num_seqs == 3
    vllm_config = AsyncEngineArgs(model=str(qwen3_dir)).create_engine_config(UsageContext.OPENAI_API_SERVER)
    vllm_config.parallel_config.data_parallel_master_port = 1234  # as verl does before from_vllm_config
    assert vllm_config.engine_config().data_parallel_master_port == 0  # independent ranks: no group meets there
    lockstep = AsyncEngineArgs(model=str(qwen3_dir), data_parallel_size=2, data_parallel_lockstep=True)
    lockstep_config = lockstep.create_engine_config()
    lockstep_config.parallel_config.data_parallel_master_port = 1234
    assert lockstep_config.engine_config().data_parallel_master_port == 1234
    vllm_config.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="parallel_config: tensor_parallel_size / data_parallel_size are the engine"):
        vllm_config.engine_config()
    with pytest.raises(ValueError, match="usage_context: expected a UsageContext, got 'server'"):
        AsyncEngineArgs(model=str(qwen3_dir)).create_engine_config("server")
    with pytest.raises(ValueError, match="vllm_config: expected EngineArgs.create_engine_config"):
        AsyncLLM.from_vllm_config(vllm_config.model_config)


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


def trace_events(path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_drain_and_profile_every_data_parallel_rank(qwen3_dir, tmp_path) -> None:
    """wait_for_requests_to_drain waits for both ranks' requests and times out while one runs; one profiling session
    traces each rank's engine-core process into a file of its own."""
    traces = tmp_path / "traces"
    profiler = {"profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_with_stack": False}
    engine = AsyncLLM(str(qwen3_dir), num_kv_blocks=64, data_parallel_size=2, profiler_config=profiler)
    long_params = SamplingParams(max_tokens=engine.max_model_len - len(PROMPT), ignore_eos=True)

    async def go() -> None:
        await asyncio.wait_for(engine.wait_for_requests_to_drain(0), 30)  # idle: at once, even given no time
        await engine.start_profile("drain")
        with pytest.raises(RuntimeError, match="^A profiling session is already active"):  # vLLM's, its 409
            await engine.start_profile()

        short = await engine.add_request("short", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
        await engine.wait_for_requests_to_drain(60)
        done = short.get_nowait()  # drained: the last output is in before the call returns
        assert done.finished and len(done.outputs[0].token_ids) == 40

        # the other rank this time (the first served one already), which must be waited for too
        long = await engine.add_request("long", {"prompt_token_ids": [7, 8, 9]}, long_params)
        await asyncio.wait_for(long.get(), 60)
        with pytest.raises(TimeoutError, match=r"^Timeout reached after 0.3 seconds waiting for requests to drain\.$"):
            await engine.wait_for_requests_to_drain(0.3)
        running = long.get_nowait()
        assert running is None or not running.finished
        await engine.abort("long")
        await engine.wait_for_requests_to_drain(60)
        assert [r["num_requests_routed"] for r in (await engine.stats())["data_parallel"]] == [1, 1]

        await engine.stop_profile()
        await engine.stop_profile()  # no session: a no-op, as in vLLM

    try:
        asyncio.run(go())
        core_pids = [rank.process.pid for rank in engine.client.ranks]
    finally:
        engine.shutdown()
    files = sorted(p.name for p in traces.iterdir())
    assert [name.split(".")[0] for name in files] == [f"drain_dp{r}_pp0_tp0_dcp0_ep{r}_rank0" for r in (0, 1)]
    assert all(name.endswith(".pt.trace.json.gz") for name in files)
    for name, pid in zip(files, core_pids, strict=True):
        steps = [e for e in trace_events(traces / name) if e.get("name", "").startswith(STEP_RANGE)]
        assert steps and {e["pid"] for e in steps} == {pid}  # the rank's engine-core process stepping
