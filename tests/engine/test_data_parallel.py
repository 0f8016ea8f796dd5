"""Data parallel offline: `LLM(data_parallel_size=2)` is two engine-core processes behind one front end.

Outputs equal one core's; requests spread over the ranks while the n samples of a prompt, a GRPO group sent as
separate requests and requests with one cache salt stay on one rank (seen in each rank's routed and prefix-hit
counts); control calls reach every rank and their results are combined; shutdown stops every core. One DP engine
serves the whole module (each costs two core processes).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from process_tree import engine_core_pids, survivors

from rlserve import LLM, SamplingParams
from rlserve.config import EngineConfig
from rlserve.engine.frontend.core_client import EngineDeadError
from rlserve.engine.frontend.dp_client import DPRouter, combined
from rlserve.engine.wire.messages import AddRequest, EngineCoreOutput, UtilityResult

EXTENSION = "worker_extension:CheckpointLoader"  # tests/worker_extension.py
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16  # the engine's block size: a prompt of 3 blocks leaves 2 full blocks to hit in the prefix cache


@pytest.fixture(scope="module")
def dp_llm(qwen3_dir, make_llm) -> Iterator[LLM]:
    llm = make_llm(qwen3_dir, data_parallel_size=2, worker_extension_cls=EXTENSION)
    yield llm
    llm.shutdown()


def per_rank(llm: LLM, name: str) -> list[Any]:
    return [rank[name] for rank in llm.stats()["data_parallel"]]


def grown(before: list[int], after: list[int]) -> list[int]:
    return [b - a for a, b in zip(before, after, strict=True)]


def test_greedy_outputs_equal_one_cores_and_both_ranks_serve(dp_llm, qwen3_dir, make_llm) -> None:
    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + 5 + 7 * i))} for i in range(8)]
    single = make_llm(qwen3_dir)
    try:
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        single.shutdown()
    routed = per_rank(dp_llm, "num_requests_routed")
    outputs = dp_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # Least-loaded: a batch of 8 distinct prompts is split evenly.
    assert grown(routed, per_rank(dp_llm, "num_requests_routed")) == [4, 4]
    stats = dp_llm.stats()
    assert stats["num_generated_tokens"] == sum(per_rank(dp_llm, "num_generated_tokens"))
    assert per_rank(dp_llm, "num_requests_in_flight") == [0, 0]


def test_samples_grpo_groups_and_cache_salts_stay_on_one_rank(dp_llm) -> None:
    prompt = {"prompt_token_ids": list(range(100, 100 + 3 * BLOCK))}
    routed, hits = per_rank(dp_llm, "num_requests_routed"), per_rank(dp_llm, "prefix_cache_hits")
    dp_llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=4), use_tqdm=False)
    (rank,) = [r for r, n in enumerate(grown(routed, per_rank(dp_llm, "num_requests_routed"))) if n]
    # A GRPO group sent as separate requests (one of them with other params) follows its prompt to that rank, and
    # finds its KV there.
    group = [prompt] * 3
    dp_llm.generate(group, [GREEDY, GREEDY, SamplingParams(temperature=1.0, seed=2, max_tokens=4)], use_tqdm=False)
    routed_now = grown(routed, per_rank(dp_llm, "num_requests_routed"))
    assert routed_now[rank] == 4 + 3 and routed_now[1 - rank] == 0
    hits_now = grown(hits, per_rank(dp_llm, "prefix_cache_hits"))
    assert hits_now[rank] >= 3 * 2 * BLOCK and hits_now[1 - rank] == 0
    # Different prompts under one cache salt (a session's namespace) share a rank too.
    before = per_rank(dp_llm, "num_requests_routed")
    salted = [{"prompt_token_ids": [7, 8, 9 + i], "cache_salt": "tenant-a"} for i in range(4)]
    dp_llm.generate(salted, GREEDY, use_tqdm=False)
    assert sorted(grown(before, per_rank(dp_llm, "num_requests_routed"))) == [0, 4]


def test_control_calls_reach_every_rank(dp_llm) -> None:
    dp_llm.update_weight_version("v7")
    assert dp_llm.get_weight_version() == "v7"
    assert [r["weight_version"] for r in dp_llm.stats()["data_parallel"]] == ["v7", "v7"]
    # One result per worker, rank 0's first: each core a worker of its own.
    assert dp_llm.collective_rpc("describe") == [{"rank": 0, "local_rank": 0, "device": "cpu"}] * 2
    assert dp_llm.weight_checksums()  # the ranks hold the same weights, so one map answers for both
    dp_llm.sleep(1)
    assert dp_llm.is_sleeping()
    dp_llm.wake_up()
    assert not dp_llm.is_sleeping()
    dp_llm.reset_prefix_cache()
    prompt = {"prompt_token_ids": list(range(40, 40 + 2 * BLOCK))}
    assert dp_llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_results_that_disagree_across_ranks_are_an_error() -> None:
    router = DPRouter(2)
    with pytest.raises(RuntimeError, match="get_weight_version: the data-parallel ranks disagree"):
        combined("get_weight_version", [UtilityResult(1, "v1"), UtilityResult(1, "v2")], router)
    with pytest.raises(RuntimeError, match="rank 1 holds other weights than rank 0"):
        combined("checksums", [UtilityResult(1, {"w": "a"}), UtilityResult(1, {"w": "b"})], router)
    # A rank's error is raised as the single-core client raises it (the server maps "field: ..." to the field).
    with pytest.raises(ValueError, match="^value: refused$"):
        combined("pause", [UtilityResult(1, None), UtilityResult(1, None, "ValueError", "value: refused")], router)
    assert combined("is_paused", [UtilityResult(1, True), UtilityResult(1, False)], router) is False
    # An abandoned update leaves the engine as its worst rank: one rank had written tensors, the other none.
    outcomes = [UtilityResult(1, "unchanged"), UtilityResult(1, "incomplete")]
    assert combined("abandon_weight_update", outcomes, router) == "incomplete"


def test_router_least_loaded_with_affinity() -> None:
    router = DPRouter(2)
    add = _adder(router)
    assert [add("a", [1]), add("b", [2]), add("c", [3])] == [0, 1, 0]
    assert add("d", [9], session="s") == 1  # least loaded
    assert add("e", [10], session="s") == 1  # the session's rank, although rank 1 is now the busier
    router.finished([_finished("a"), _finished("c")])
    assert router.in_flight == [0, 3]
    assert add("f", [2]) == 1  # prompt [2] went to rank 1
    assert router.by_rank(["a", "f", "d", "unknown"]) == {1: ["f", "d"]}  # finished and unknown ids go nowhere


def test_router_forgets_the_oldest_keys() -> None:
    router = DPRouter(2, max_affinity_keys=1)
    add = _adder(router)
    assert [add("a", [1]), add("b", [2])] == [0, 1]
    router.finished([_finished("b")])
    assert add("c", [1]) == 1  # [1] (rank 0) was forgotten when [2] came: the least-loaded rank takes it


def _adder(router: DPRouter) -> Callable[..., int]:
    def add(request_id: str, tokens: list[int], session: str | None = None) -> int:
        return router.route(AddRequest.of([request_id], tokens, [GREEDY]), session)

    return add


def _finished(request_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [1], [None], None, "v", "length")


def test_config_gives_each_rank_its_gpu() -> None:
    config = EngineConfig(model="m", device="cuda", data_parallel_size=2)
    assert [config.for_data_parallel_rank(r).device for r in (0, 1)] == ["cuda:0", "cuda:1"]
    assert config.for_data_parallel_rank(1).data_parallel_rank == 1
    with pytest.raises(ValueError, match="^device: data-parallel core 0 runs on cuda:0, not cuda:1"):
        EngineConfig(model="m", device="cuda:1", data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_rank must be in 0..1"):
        EngineConfig(model="m", device="cpu", data_parallel_size=2, data_parallel_rank=2)


def test_in_process_mode_refuses_several_cores(qwen3_dir, make_llm) -> None:
    with pytest.raises(ValueError, match="^data_parallel_size: 2 engine cores run in processes of their own"):
        make_llm(qwen3_dir, in_process=True, data_parallel_size=2)


def test_shutdown_stops_every_core(qwen3_dir, make_llm) -> None:
    before = set(engine_core_pids(os.getpid()))
    llm = make_llm(qwen3_dir, data_parallel_size=2)
    cores = [rank.process.pid for rank in llm.client.ranks]
    assert len(set(cores)) == 2 and set(cores) <= set(engine_core_pids(os.getpid())) - before
    llm.shutdown()
    assert not survivors(cores)


def test_a_dead_rank_fails_the_engine(qwen3_dir, make_llm) -> None:
    llm = make_llm(qwen3_dir, data_parallel_size=2)
    cores = [rank.process.pid for rank in llm.client.ranks]
    try:
        os.kill(cores[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"died \(killed by SIGKILL\)"):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not survivors(cores)
