"""Data-parallel lockstep with real engine-core processes (two ranks on the CPU, gloo between them).

Greedy outputs equal one core's while the idle rank runs dummy steps; under AsyncLLM, a trainer's flow with the calls
racing each other: pauses of every mode (duplicates too) while both ranks stream, a weight update sent while its
pause is still being agreed (queued behind it), one broadcast to both ranks, a request arriving mid-pause, duplicate
resumes. Nothing hangs, no stream loses or repeats a token, and the new weights generate what transformers does.
The protocol itself, with every interleaving, is tests/engine/test_dp_wave.py's.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed
import zmq
from safetensors.torch import load_file

from rlserve import SamplingParams, WeightTransferConfig
from rlserve.config import EngineConfig
from rlserve.dtypes import dtype_name
from rlserve.engine.frontend.async_llm import AsyncLLM, start_shared_cores
from rlserve.engine.wire.process import free_port
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LOCKSTEP = dict(data_parallel_size=2, data_parallel_lockstep=True, data_parallel_sync_interval=4)
CALL_TIMEOUT_S = 60.0  # every call below returns in well under a second on an idle machine; a deadlock never does


def test_lockstep_greedy_outputs_equal_one_cores_and_idle_ranks_step(qwen3_dir, make_llm) -> None:
    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + 5 + 7 * i))} for i in range(6)]
    single = make_llm(qwen3_dir)
    try:
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        single.shutdown()
    llm = make_llm(qwen3_dir, **LOCKSTEP)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        # One request: its rank steps it, the other runs dummy steps for as long as the wave lasts.
        # Counts read once the ranks stop stepping: between two syncs each rank steps on its own, so when the busy
        # rank's last output reaches the caller the idle one may still be up to sync_interval steps behind (CI read
        # 38 of 40), and the first batch's wave may still be stepping out when the next request arrives.
        routed_before = [r["num_requests_routed"] for r in llm.stats()["data_parallel"]]
        before = _settled_dummy_steps(llm)
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [9, 8, 7]}], long, use_tqdm=False)
        after = _settled_dummy_steps(llm)
        routed_after = [r["num_requests_routed"] for r in llm.stats()["data_parallel"]]
        (busy,) = [r for r in range(2) if routed_after[r] > routed_before[r]]
        idle_steps = after[1 - busy] - before[1 - busy]
        busy_steps = after[busy] - before[busy]
        # The idle rank stepped along with the busy one's 40 steps (the first may run before it joins the wave).
        assert idle_steps >= 39 and busy_steps < idle_steps, (idle_steps, busy_steps)
        # One snapshot: the idle rank may still be stepping out its wave, so two calls can read different counts.
        snapshot = llm.stats()
        assert snapshot["num_dummy_steps"] == sum(r["num_dummy_steps"] for r in snapshot["data_parallel"])
    finally:
        llm.shutdown()


def _settled_dummy_steps(llm, deadline_s: float = 10.0) -> list[int]:
    """Each rank's dummy steps once they stop changing: a rank may step out a wave after the requests ended."""
    counts = None
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        latest = [rank["num_dummy_steps"] for rank in llm.stats()["data_parallel"]]
        if latest == counts:
            return latest
        counts = latest
        time.sleep(0.3)
    raise AssertionError(f"the ranks kept stepping for {deadline_s:g} s without work: {counts}")


def test_wave_notices_without_the_groups_secret_never_reach_a_rank(qwen3_dir, make_llm) -> None:
    """Each rank's wave-notice socket listens on TCP at data_parallel_master_ip: a forged notice made the ranks run
    waves of dummy steps for nobody (one told of a far-off wave alone would wait in the all-gather for its peer, for
    COLLECTIVE_TIMEOUT). A sender without the group's secret, or with a wrong one, gets no connection: no rank steps,
    and the ranks serve as before."""
    port = free_port()
    llm = make_llm(qwen3_dir, **LOCKSTEP, data_parallel_master_port=port)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(2)]
    try:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        # The notice addresses are in the ranks' store, which anyone who reaches its port may read (vLLM's too).
        store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        addresses = [store.get(f"rlserve/dp/notices/{rank}").decode() for rank in range(2)]
        dummy_steps = _settled_dummy_steps(llm)  # the generate's wave has ended on both ranks
        with zmq.Context() as context:
            for password in (None, b"not-the-secret"):
                for address in addresses:
                    with context.socket(zmq.PUSH) as intruder:
                        intruder.setsockopt(zmq.LINGER, 500)  # time for the handshake, which the rank refuses
                        if password is not None:
                            intruder.plain_username, intruder.plain_password = b"rlserve", password
                        intruder.connect(address)
                        for wave in range(32):  # the ranks' current wave among them: each would join it
                            intruder.send(wave.to_bytes(8, "little"))
        time.sleep(1.0)  # a notice that got through starts a wave within milliseconds
        assert [rank["num_dummy_steps"] for rank in llm.stats()["data_parallel"]] == dummy_steps
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    finally:
        llm.shutdown()


def test_lockstep_options_are_refused_where_they_would_do_nothing(qwen3_dir) -> None:
    with pytest.raises(ValueError, match="data_parallel_lockstep: needs data_parallel_size > 1"):
        EngineConfig(model=str(qwen3_dir), data_parallel_lockstep=True)
    with pytest.raises(ValueError, match="data_parallel_sync_interval: only used with data_parallel_lockstep"):
        EngineConfig(model=str(qwen3_dir), data_parallel_size=2, data_parallel_sync_interval=8)
    with pytest.raises(ValueError, match="data_parallel_sync_interval must be >= 1"):
        EngineConfig(model=str(qwen3_dir), **{**LOCKSTEP, "data_parallel_sync_interval": 0})
    with pytest.raises(ValueError, match="data_parallel_lockstep: needs a single front end"):
        start_shared_cores(str(qwen3_dir), data_parallel_size=2, data_parallel_lockstep=True)


async def _stream(engine: AsyncLLM, prompt: list[int], max_tokens: int, request_id: str, into: dict) -> Any:
    """Collect a stream's tokens as they come (cumulative outputs: the last one holds them all)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    into[request_id] = []
    last = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
        into[request_id] = list(out.outputs[0].token_ids)
        last = out
    return last


async def _started(progress: dict, ids: list[str], tokens: int = 2) -> None:
    while any(len(progress.get(i, [])) < tokens for i in ids):
        await asyncio.sleep(0.01)


def test_trainer_flow_races_pauses_updates_and_requests(qwen3_dir, hf, tmp_path: Path) -> None:
    new_dir = make_model_dir(tmp_path / "new", seed=7, initializer_range=0.2)
    new_weights = load_file(new_dir / "model.safetensors")
    names = sorted(new_weights)
    engine = AsyncLLM(
        str(qwen3_dir), num_kv_blocks=256, weight_transfer_config=WeightTransferConfig(backend="nccl"), **LOCKSTEP
    )

    async def call(awaitable):
        return await asyncio.wait_for(awaitable, CALL_TIMEOUT_S)

    async def go() -> None:
        progress: dict[str, list[int]] = {}
        # abort and wait: every stream on both ranks ends as the mode says, before the pause returns.
        for mode, reason in (("abort", "abort"), ("wait", "length")):
            tasks = [
                asyncio.create_task(
                    _stream(engine, [30 + i, 5, 5], 600 if mode == "abort" else 30, f"{mode}{i}", progress)
                )
                for i in range(4)
            ]
            await call(_started(progress, [f"{mode}{i}" for i in range(4)]))
            await call(asyncio.gather(engine.pause_generation(mode=mode), engine.pause_generation(mode=mode)))
            assert await engine.is_paused()
            finals = await call(asyncio.gather(*tasks))
            assert [o.outputs[0].finish_reason for o in finals] == [reason] * 4
            await call(engine.resume_generation())
        with pytest.raises(RuntimeError, match="pause the engine first"):  # an update on an engine not paused
            await call(engine.start_weight_update())

        # keep: streams on both ranks freeze; the update is sent while the pause is still being agreed.
        world_size = 1 + engine.get_world_size(include_dp=True)  # the trainer and both ranks (vLLM's formula)
        init_info = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "rank_offset": 1,
            "world_size": world_size,
        }
        joined = asyncio.create_task(engine.init_weight_transfer_engine({"init_info": init_info}))
        group = await asyncio.to_thread(NCCLWeightTransferEngine.trainer_init, {**init_info, "timeout_s": 60})
        await call(joined)
        kept = [asyncio.create_task(_stream(engine, [60 + i, 5, 5], 40, f"keep{i}", progress)) for i in range(4)]
        await call(_started(progress, [f"keep{i}" for i in range(4)]))
        pausing = [asyncio.create_task(engine.pause_generation(mode="keep")) for _ in range(2)]
        starting = asyncio.create_task(engine.start_weight_update())  # queued behind the pauses on every rank
        await call(asyncio.gather(*pausing, starting))
        frozen = {i: list(progress[f"keep{i}"]) for i in range(4)}
        mid_pause = asyncio.create_task(_stream(engine, [99, 5, 5], 6, "mid-pause", progress))
        update_info = {
            "names": names,
            "dtype_names": [dtype_name(new_weights[n].dtype) for n in names],
            "shapes": [list(new_weights[n].shape) for n in names],
        }
        updating = asyncio.create_task(engine.update_weights({"update_info": update_info}))
        send_args = NCCLTrainerSendWeightsArgs(group=group)
        await asyncio.to_thread(
            NCCLWeightTransferEngine.trainer_send_weights, ((n, new_weights[n]) for n in names), send_args
        )
        await call(updating)
        await call(engine.finish_weight_update(weight_version="v1"))
        group.shutdown()
        await asyncio.sleep(0.2)
        assert {i: progress[f"keep{i}"] for i in range(4)} == frozen and progress["mid-pause"] == []
        await call(asyncio.gather(engine.resume_generation(), engine.resume_generation()))
        assert not await engine.is_paused()
        finals = await call(asyncio.gather(*kept, mid_pause))
        assert all(out.outputs[0].finish_reason == "length" for out in finals)
        assert [len(o.outputs[0].token_ids) for o in finals] == [40] * 4 + [6]
        assert finals[-1].outputs[0].token_ids == hf.greedy(new_dir, [99, 5, 5], 6)  # started on the new weights
        assert await engine.get_weight_version() == "v1"

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
