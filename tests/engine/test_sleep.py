"""Sleep and wake (vLLM's names): the engine gives its memory back between rollouts and takes it again."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlserve import SamplingParams
from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.toy import make_model_dir

PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 33, 20)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _device_bytes(llm) -> int:
    runner = llm.engine_core.runner
    weights = sum(p.data.nbytes for p in runner.model.parameters())
    return weights + sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)


@pytest.mark.parametrize("level", [0, 1])
def test_sleep_and_wake_keep_the_outputs(qwen3_dir, make_llm, generate, level) -> None:
    llm = make_llm(qwen3_dir, in_process=True)  # in process: the device bytes are read off the runner
    before = _tokens(generate(llm, PROMPTS, GREEDY))
    checksums = llm.weight_checksums()
    held = _device_bytes(llm)

    llm.sleep(level=level)
    assert llm.is_sleeping()
    assert _device_bytes(llm) == (held if level == 0 else 0)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()

    assert not llm.is_sleeping() and _device_bytes(llm) == held
    assert llm.weight_checksums() == checksums
    assert _tokens(generate(llm, PROMPTS, GREEDY)) == before


def test_level_2_needs_new_weights_and_then_equals_a_fresh_engine(qwen3_dir, qwen3_alt_dir, make_llm, generate) -> None:
    """vLLM's colocated flow: sleep(2) -> wake_up(weights) -> update -> wake_up(kv_cache); awake (vLLM 0.33) once
    weights and KV cache are both back."""
    from safetensors.torch import load_file

    llm = make_llm(qwen3_dir)
    generate(llm, PROMPTS, GREEDY)
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.load_weights(load_file(str(qwen3_alt_dir / "model.safetensors")).items())
    assert llm.wake_up(tags=["weights"]) is False
    assert llm.is_sleeping()  # the KV cache is still released
    llm.load_weights(load_file(str(qwen3_alt_dir / "model.safetensors")).items())
    assert llm.wake_up(tags=["kv_cache"]) is True
    assert not llm.is_sleeping()
    assert _tokens(generate(llm, PROMPTS, GREEDY)) == _tokens(generate(make_llm(qwen3_alt_dir), PROMPTS, GREEDY))


def test_bad_sleep_arguments_are_refused(qwen3_dir, make_llm) -> None:
    llm = make_llm(qwen3_dir)
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="mode"):
        llm.sleep(level=1, mode="nap")
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["weights", "everything"])
    assert not llm.is_sleeping()


async def _final_token_ids(engine: AsyncLLM, prompt: str, params: SamplingParams) -> list[int]:
    final = None
    async for out in engine.generate(prompt, params):
        final = out
    return final.outputs[0].token_ids


async def _until_generated(engine: AsyncLLM, num_tokens: int) -> None:
    """Until the engine has generated `num_tokens` in all (the requests are mid-way)."""
    while (await engine.stats())["num_generated_tokens"] < num_tokens:
        await asyncio.sleep(0.001)


def test_requests_in_flight_sleep_and_finish_after_wake_up(tmp_path) -> None:
    """AsyncLLM: requests caught by sleep(1) wait (their KV is dropped) and finish after wake_up with the tokens an
    uninterrupted run gives; a pause/resume while asleep takes effect only at wake_up."""
    torch.set_num_threads(1)
    model_dir = make_model_dir(tmp_path / "m", "Qwen3ForCausalLM", seed=1, initializer_range=0.2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def run(sleep_midway: bool) -> list[list[int]]:
        engine = AsyncLLM(str(model_dir), num_kv_blocks=256)
        try:
            tasks = [asyncio.create_task(_final_token_ids(engine, prompt, params)) for prompt in PROMPTS]
            if sleep_midway:
                await _until_generated(engine, 20)
                await engine.sleep(level=1, mode="keep")
                produced = (await engine.stats())["num_generated_tokens"]
                await engine.resume_generation()  # asleep: recorded, not applied
                await asyncio.sleep(0.05)
                assert await engine.is_sleeping() and (await engine.stats())["num_generated_tokens"] == produced
                assert not any(t.done() for t in tasks)
                await engine.wake_up()
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        finally:
            engine.shutdown()

    assert asyncio.run(run(True)) == asyncio.run(run(False))


def test_level_2_then_wake_up_refuses_generation_until_every_weight_is_written(qwen3_dir, make_llm, generate) -> None:
    """Woken without new weights, the engine holds uninitialised memory: it refuses to generate (issue 17.3/20.7)."""
    from safetensors.torch import load_file

    from rlserve.engine.frontend.core_client import RequestRefusedError

    llm = make_llm(qwen3_dir)
    before = _tokens(generate(llm, PROMPTS, GREEDY))
    llm.sleep(level=2)
    llm.wake_up()
    assert not llm.is_sleeping()
    with pytest.raises(RequestRefusedError, match=r"sleep\(level=2\) released them.*weight update .*or a reload"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert "sleep(level=2)" in llm.not_serving and llm.stats()["num_running"] == 0
    weights = sorted(load_file(str(qwen3_dir / "model.safetensors")).items())
    llm.load_weights(weights[:-1])  # all but one: still refused
    with pytest.raises(RequestRefusedError, match="1 of "):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.load_weights(weights[-1:])
    assert llm.not_serving is None
    assert _tokens(generate(llm, PROMPTS, GREEDY)) == before


def test_requests_kept_across_level_2_wait_for_the_weights(qwen3_dir) -> None:
    """AsyncLLM: requests frozen by sleep(level=2, mode="keep") do not run on the garbage wake_up brings back; a new
    request is refused with the reason; once the weights are loaded the kept ones finish as an uninterrupted run."""
    from safetensors.torch import load_file

    from rlserve.engine.frontend.core_client import RequestRefusedError

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    weights = list(load_file(str(qwen3_dir / "model.safetensors")).items())

    async def run(sleep_midway: bool) -> list[list[int]]:
        engine = AsyncLLM(str(qwen3_dir), num_kv_blocks=256)
        try:
            tasks = [asyncio.create_task(_final_token_ids(engine, prompt, params)) for prompt in PROMPTS]
            if sleep_midway:
                await _until_generated(engine, 20)
                await engine.sleep(level=2, mode="keep")
                await engine.wake_up()
                produced = (await engine.stats())["num_generated_tokens"]
                with pytest.raises(RequestRefusedError, match=r"sleep\(level=2\)"):
                    await _final_token_ids(engine, PROMPTS[0], params)
                await asyncio.sleep(0.05)
                assert (await engine.stats())["num_generated_tokens"] == produced and engine.not_serving
                assert not any(t.done() for t in tasks)
                await engine.load_weights(weights)
                assert engine.not_serving is None
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        finally:
            engine.shutdown()

    assert asyncio.run(run(True)) == asyncio.run(run(False))
