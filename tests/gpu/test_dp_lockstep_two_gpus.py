"""Data-parallel lockstep on two GPUs (skipped without two): the idle rank's dummy forwards run on its own GPU, greedy
outputs equal one core's, and a keep-pause agreed by both ranks freezes streams on both until the resume.

The protocol and its interleavings are tests/engine/test_dp_wave.py's; the CPU flow is tests/engine/test_dp_lockstep.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.toy import make_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (one per data-parallel rank)"),
]
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 33, 90, 12)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
COMMON = dict(dtype="float32", device="cuda", num_kv_blocks=256)
LOCKSTEP = dict(data_parallel_size=2, data_parallel_lockstep=True, data_parallel_sync_interval=4)
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model_dir(tmp_path_factory.mktemp("dp-lockstep"), preset="small", seed=0))


def test_lockstep_outputs_equal_one_gpus_and_the_idle_rank_steps(model_dir) -> None:
    single = LLM(model_dir, **COMMON)
    try:
        expected = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        single.shutdown()
    llm = LLM(model_dir, **COMMON, **LOCKSTEP)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        before = llm.stats()["data_parallel"]
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        after = llm.stats()["data_parallel"]
        (busy,) = [r for r in range(2) if after[r]["num_requests_routed"] > before[r]["num_requests_routed"]]
        assert after[1 - busy]["num_dummy_steps"] - before[1 - busy]["num_dummy_steps"] >= 39
    finally:
        llm.shutdown()


def test_lockstep_keep_pause_freezes_both_gpus(model_dir) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def go() -> list[int]:
        engine = AsyncLLM(model_dir, **COMMON, **LOCKSTEP)
        progress = [0] * 4
        try:

            async def run(i: int) -> int:
                async for out in engine.generate(PROMPTS[i], params, request_id=f"r{i}"):
                    progress[i] = len(out.outputs[0].token_ids)
                return progress[i]

            tasks = [asyncio.create_task(run(i)) for i in range(4)]
            while min(progress) < 3:
                await asyncio.sleep(0.005)
            await asyncio.wait_for(engine.pause_generation(mode="keep"), TIMEOUT_S)
            frozen = list(progress)
            await asyncio.sleep(0.3)
            assert progress == frozen and await engine.is_paused()
            await asyncio.wait_for(engine.resume_generation(), TIMEOUT_S)
            return await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        finally:
            engine.shutdown()

    assert asyncio.run(go()) == [200] * 4
