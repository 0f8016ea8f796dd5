"""Expert parallel on CPU: two data-parallel engine-core processes in lockstep, each holding half of a tiny
Qwen3-MoE's experts, exchanging tokens over gloo in every sparse layer.

Greedy tokens equal one engine's with every expert (EP off) and fp32 logprobs are within 1e-5; a request on one rank
completes while the other runs dummy steps (which take part in the exchanges); an in-place update writes each rank's
experts and equals a fresh engine, a refused one changes nothing; checksums put the ranks' experts together into the
checkpoint's; the flag is refused by name where it cannot work.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_moe import MAX_TOKENS, PROMPTS, greedy, make_moe_dir, run, sampled_logprobs

from rlserve.cli import build_parser
from rlserve.config import EngineConfig
from rlserve.engine.frontend.args import engine_kwargs
from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.model.loader import iterate_checkpoint
from rlserve.weight_transfer import weight_checksums

CALL_TIMEOUT_S = 60.0  # each call returns in well under a second on an idle machine; a deadlock never does
EP = dict(data_parallel_size=2, enable_expert_parallel=True, data_parallel_sync_interval=4, num_kv_blocks=64)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The served model and the one an update writes (test_moe.py's two seeds)."""
    root = tmp_path_factory.mktemp("ep")
    return make_moe_dir(root / "served", seed=3), make_moe_dir(root / "update", seed=4)


@pytest.fixture(scope="module")
def moe_dir(moe_dirs: tuple[Path, Path]) -> Path:
    return moe_dirs[0]


@pytest.fixture(scope="module")
def ep_llm(moe_dir: Path, make_llm):
    llm = make_llm(moe_dir, **EP)
    yield llm
    llm.shutdown()


def one_rank(make_llm, model_dir: Path, generate, prompts=PROMPTS, max_tokens: int = MAX_TOKENS):
    llm = make_llm(model_dir, in_process=True, num_kv_blocks=64)
    try:
        return run(llm, prompts, greedy(max_tokens), generate)
    finally:
        llm.shutdown()


def test_ep_equals_one_rank_with_every_expert(ep_llm, moe_dir, make_llm, generate) -> None:
    prompts = PROMPTS * 2  # both ranks get requests
    expected = one_rank(make_llm, moe_dir, generate, prompts)
    outputs = run(ep_llm, prompts, greedy(), generate)
    assert [list(o.token_ids) for o in outputs] == [list(o.token_ids) for o in expected]
    for out, ref in zip(outputs, expected, strict=True):
        for a, b in zip(sampled_logprobs(out), sampled_logprobs(ref), strict=True):
            assert abs(a - b) < 1e-5
    assert all(r["num_requests_routed"] > 0 for r in ep_llm.stats()["data_parallel"])


def test_a_request_on_one_rank_completes_while_the_other_runs_dummy_steps(ep_llm, moe_dir, make_llm, generate):
    before = ep_llm.stats()["data_parallel"]
    (out,) = run(ep_llm, [PROMPTS[0]], greedy(20), generate)
    after = ep_llm.stats()["data_parallel"]
    (busy,) = [r for r in range(2) if after[r]["num_requests_routed"] > before[r]["num_requests_routed"]]
    idle_steps = after[1 - busy]["num_dummy_steps"] - before[1 - busy]["num_dummy_steps"]
    assert idle_steps >= 19  # each of them joined the busy rank's exchanges in both sparse layers
    llm = make_llm(moe_dir, in_process=True, num_kv_blocks=64)
    try:
        (expected,) = run(llm, [PROMPTS[0]], greedy(20), generate)
    finally:
        llm.shutdown()
    assert list(out.token_ids) == list(expected.token_ids)


def test_checksums_are_the_checkpoints(ep_llm, moe_dir) -> None:
    assert ep_llm.weight_checksums() == weight_checksums(iterate_checkpoint(str(moe_dir)))
    with pytest.raises(RuntimeError, match="sleep: expert parallel: pause the engine first"):
        ep_llm.sleep(level=1)  # LLM has no pause: an idle rank's dummy forwards would wait on a sleeping peer
    assert not ep_llm.is_sleeping()


def test_in_place_update_equals_a_fresh_engine(ep_llm, moe_dirs, make_llm, generate) -> None:
    moe_dir, moe_alt_dir = moe_dirs
    ep_llm.reset_prefix_cache()
    before = run(ep_llm, PROMPTS, greedy(), generate)
    alt = list(iterate_checkpoint(str(moe_alt_dir)))
    # A wrong shape on an expert of rank 1 (experts 4..7) is refused on rank 0 too: no rank writes anything.
    bad = [(n, t[:, :-1] if n.endswith("layers.0.mlp.experts.6.up_proj.weight") else t) for n, t in alt]
    with pytest.raises(ValueError, match="experts.6.up_proj.weight"):
        ep_llm.load_weights(bad)
    assert ep_llm.weight_checksums() == weight_checksums(iterate_checkpoint(str(moe_dir)))
    ep_llm.load_weights(alt)  # every rank gets every tensor and keeps its experts
    assert ep_llm.weight_checksums() == weight_checksums(alt)
    updated = run(ep_llm, PROMPTS, greedy(), generate)
    fresh = one_rank(make_llm, moe_alt_dir, generate)
    assert [o.token_ids for o in updated] == [o.token_ids for o in fresh] != [o.token_ids for o in before]
    for u, f in zip(updated, fresh, strict=True):
        for a, b in zip(sampled_logprobs(u), sampled_logprobs(f), strict=True):
            assert abs(a - b) < 1e-5


def test_batch_invariant_ep_does_not_depend_on_the_batch(moe_dir, make_llm, generate) -> None:
    """The exchange pads and sums in a fixed order: a request's logprobs are the same bits alone (the other rank
    idle) as among others on both ranks."""
    llm = make_llm(moe_dir, **EP, batch_invariant=True)
    try:
        (alone,) = run(llm, PROMPTS[:1], greedy(), generate)
        together = run(llm, PROMPTS * 2, greedy(), generate)
    finally:
        llm.shutdown()
    assert all(sampled_logprobs(o) == sampled_logprobs(alone) for o in together[:: len(PROMPTS)])


def test_expert_parallel_is_refused_where_it_cannot_work(moe_dir, qwen3_dir, make_llm) -> None:
    with pytest.raises(ValueError, match="enable_expert_parallel: needs data_parallel_size > 1"):
        EngineConfig(model=str(moe_dir), enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel: not with tensor_parallel_size > 1"):
        EngineConfig(model=str(moe_dir), enable_expert_parallel=True, data_parallel_size=2, tensor_parallel_size=2)
    config = EngineConfig(model=str(moe_dir), enable_expert_parallel=True, data_parallel_size=2)
    assert config.data_parallel_lockstep  # turned on by the flag
    with pytest.raises(ValueError, match="enable_expert_parallel: the model's 8 experts do not divide"):
        make_llm(moe_dir, **(EP | {"data_parallel_size": 3}))
    with pytest.raises(ValueError, match="enable_expert_parallel: Qwen3ForCausalLM has no experts"):
        make_llm(qwen3_dir, **EP)
    args = build_parser().parse_args(["serve", str(moe_dir), "-dp", "2", "-ep"])  # vLLM's spelling, accepted
    assert engine_kwargs(args) == {"data_parallel_size": 2, "enable_expert_parallel": True}


def test_streams_survive_a_keep_pause_with_sleep(moe_dir, make_llm, generate) -> None:
    """A trainer's flow: pause(keep) while both ranks stream, sleep and wake (allowed once paused), resume; every
    stream then ends with the tokens of an uninterrupted run."""
    prompts = [[30 + i, 5, 5] for i in range(4)]
    expected = [list(o.token_ids) for o in one_rank(make_llm, moe_dir, generate, prompts, max_tokens=64)]
    engine = AsyncLLM(str(moe_dir), **EP)

    async def stream(prompt: list[int], request_id: str, progress: dict) -> list[int]:
        async for out in engine.generate({"prompt_token_ids": prompt}, greedy(64), request_id=request_id):
            progress[request_id] = list(out.outputs[0].token_ids)
        return progress[request_id]

    async def go() -> list[list[int]]:
        progress: dict[str, list[int]] = {}
        tasks = [asyncio.create_task(stream(p, f"r{i}", progress)) for i, p in enumerate(prompts)]
        while len(progress) < len(prompts):
            await asyncio.sleep(0.01)
        await asyncio.wait_for(engine.pause_generation(mode="keep"), CALL_TIMEOUT_S)
        await asyncio.wait_for(engine.sleep(level=1, mode="keep"), CALL_TIMEOUT_S)
        assert await asyncio.wait_for(engine.wake_up(), CALL_TIMEOUT_S)
        await asyncio.wait_for(engine.resume_generation(), CALL_TIMEOUT_S)
        return await asyncio.wait_for(asyncio.gather(*tasks), CALL_TIMEOUT_S)

    try:
        assert asyncio.run(go()) == expected
    finally:
        engine.shutdown()
