"""Ray (the `ray` extra) on one local CPU cluster: `data_parallel_backend="ray"` (the engine cores as Ray actors on a
placement group) and `rlserve.ray` (engines as Ray actors for a trainer script).

Both run the same flows as their mp counterparts: DP=2 on Ray answers as one mp core does; one trainer broadcast
(gloo) updates every rank or engine, which then answers as a fresh engine with the new weights does; shutdown leaves
no actor, process or placement group behind. (The folder is not named `ray`: on the tests' import path a folder of
that name would stand in for the package where it is not installed.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from process_tree import survivors
from weight_transfer.test_engine_weight_update import _checkpoint, _update_info

from rlserve import LLM, SamplingParams, WeightTransferConfig
from rlserve.engine.frontend.args import make_engine_config
from rlserve.engine.frontend.async_llm import start_shared_cores
from rlserve.engine.frontend.core_client import EngineDeadError, MPClient
from rlserve.engine.frontend.ray_launcher import RayLauncher
from rlserve.engine.wire.process import free_port
from rlserve.weight_transfer import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

ray = pytest.importorskip("ray")

TIMEOUT_S = 120.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 3 + i + 5 + 7 * i))} for i in range(6)]
NCCL = WeightTransferConfig(backend="nccl")
BUFFER_BYTES = 8192  # several packed buckets


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local cluster of this module alone (never one RAY_ADDRESS names): 4 logical CPUs, for the two core actors
    and the two engine actors."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def expected(qwen3_dir, qwen3_alt_dir, make_llm) -> dict[str, list[list[int]]]:
    """One mp core's greedy tokens, on the start weights and on the weights the trainer sends."""
    result = {}
    for name, path in (("old", qwen3_dir), ("new", qwen3_alt_dir)):
        llm = make_llm(path)
        try:
            result[name] = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        finally:
            llm.shutdown()
    assert result["old"] != result["new"]
    return result


class Trainer:
    """Rank 0 of the weight-transfer group, in this process, with the new weights."""

    def __init__(self, new_dir: Path) -> None:
        self.weights = _checkpoint(new_dir)
        self.update_info = _update_info(self.weights, packed=True, packed_buffer_size_bytes=BUFFER_BYTES)

    def join(self, world_size: int, engines_join: Callable[[dict], Any], wait: Callable[[Any], Any]) -> None:
        """Join while the engines join theirs (`engines_join(init_info)`, awaited by `wait`): each side blocks
        until the other is in."""
        init_info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1}
        pending = engines_join({**init_info, "world_size": world_size})
        self.group = NCCLWeightTransferEngine.trainer_init(
            {**init_info, "world_size": world_size, "timeout_s": TIMEOUT_S}
        )
        wait(pending)

    def send(self) -> None:
        args = NCCLTrainerSendWeightsArgs(group=self.group, packed=True, packed_buffer_size_bytes=BUFFER_BYTES)
        NCCLWeightTransferEngine.trainer_send_weights(iter(self.weights.items()), args)
        self.group.shutdown()


# ---- data_parallel_backend="ray" ----


def test_data_parallel_on_ray_answers_as_one_core_and_one_broadcast_updates_both_ranks(
    ray_cluster, qwen3_dir, qwen3_alt_dir, make_llm, expected
) -> None:
    llm = make_llm(qwen3_dir, data_parallel_size=2, data_parallel_backend="ray", weight_transfer_config=NCCL)
    cores = [rank.process for rank in llm.client.ranks]
    placement_group = llm.client.launcher.placement_group
    try:
        assert len({core.pid for core in cores}) == 2 and os.getpid() not in {core.pid for core in cores}
        bundles = ray.util.placement_group_table(placement_group)["bundles"]
        assert [bundles[i] for i in range(2)] == [{"CPU": 1.0}, {"CPU": 1.0}]
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected["old"]
        assert [r["num_requests_routed"] for r in llm.stats()["data_parallel"]] == [3, 3]  # both ranks served
        assert llm.get_world_size() == 2

        trainer = Trainer(qwen3_alt_dir)
        with ThreadPoolExecutor(1) as pool:  # the engine's calls block until the trainer has done its part
            trainer.join(
                1 + llm.get_world_size(),
                lambda info: pool.submit(llm.init_weight_transfer_engine, {"init_info": info}),
                lambda joined: joined.result(TIMEOUT_S),
            )
            llm.start_weight_update()
            update = pool.submit(llm.update_weights, {"update_info": trainer.update_info})
            trainer.send()
            update.result(TIMEOUT_S)
        llm.finish_weight_update(weight_version="step-1")
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected["new"]
        assert [r["weight_version"] for r in llm.stats()["data_parallel"]] == ["step-1", "step-1"]

        ray.kill(cores[1].actor)  # a rank's actor lost (its node gone): the engine fails, saying which
        with pytest.raises(EngineDeadError, match="the engine-core actor of data-parallel rank 1, pid .* died"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not survivors([core.pid for core in cores])
    assert ray.util.placement_group_table(placement_group)["state"] == "REMOVED"


def test_a_core_on_another_node_is_reached_over_tcp_and_start_errors_come_back(ray_cluster, qwen3_dir) -> None:
    config = make_engine_config(str(qwen3_dir), data_parallel_backend="ray", num_kv_blocks=64)
    launcher = RayLauncher(config)
    launcher.node_id = "a node of its own"  # the front end as seen from elsewhere in the cluster
    try:
        # The rank's one bundle, taken in turn: a core that cannot start, then one that does.
        too_small = MPClient(replace(config, num_kv_blocks=16), launcher.launch)
        try:
            with pytest.raises(ValueError, match=r"^the KV cache \(16 blocks of 16 tokens\) cannot hold one sequence"):
                too_small.connect()  # the core's own error, raised here as a core process's is
        finally:
            too_small.shutdown()
        client = MPClient(config, launcher.launch)
        try:
            assert client.connect()["max_model_len"] > 0
            (node,) = ray.nodes()  # this machine, under the address Ray knows it by
            assert client.process.address.startswith(f"tcp://{node['NodeManagerAddress']}:")
            assert client.call("get_weight_version") == "default"
        finally:
            client.shutdown()
    finally:
        launcher.shutdown()
    assert not survivors([too_small.process.pid, client.process.pid])


# ---- rlserve.ray: engines as actors for a trainer ----


def test_two_engine_actors_take_one_broadcast_and_answer_as_a_fresh_engine(
    ray_cluster, qwen3_dir, qwen3_alt_dir, expected
):
    from rlserve.ray import RayVLLMWeightSyncClient, create_engines

    engines = create_engines(str(qwen3_dir), 2, weight_transfer_config=NCCL, num_kv_blocks=64)
    # Each engine actor's process and its core's.
    pids = [
        pid
        for pair in engines.call("__ray_call__", lambda actor: (os.getpid(), actor.client.process.pid))
        for pid in pair
    ]
    try:
        assert token_ids(engines.generate(PROMPTS, GREEDY)) == expected["old"]
        assert engines.get_world_size() == 2
        engines.pause_generation(mode="keep")
        # Requests sent while paused wait in each engine; the actors (async) answer the calls that follow meanwhile.
        waiting = engines.submit("generate_batch", PROMPTS[:2], GREEDY)
        assert engines.is_paused()
        assert ray.wait(waiting, timeout=1.0)[0] == []

        trainer = Trainer(qwen3_alt_dir)
        trainer.join(
            1 + engines.get_world_size(),
            lambda info: engines.submit("init_weight_transfer_engine", {"init_info": info}),
            lambda refs: engines.get(refs, timeout=TIMEOUT_S),
        )
        engines.start_weight_update()
        update = engines.submit("update_weights", {"update_info": trainer.update_info})
        trainer.send()
        engines.get(update, timeout=TIMEOUT_S)
        # vLLM 0.33's client on the same actors: what a 0.33 trainer engine drives.
        RayVLLMWeightSyncClient(engines.handles).finish_weight_update(weight_version="step-1")
        engines.resume_generation()

        assert not engines.is_paused()
        assert engines.get_weight_version() == ["step-1", "step-1"]
        for outputs in engines.get(waiting, timeout=TIMEOUT_S):  # they ran after the update, on its weights
            assert token_ids(outputs) == expected["new"][:2]
            assert {v for o in outputs for v in o.outputs[0].weight_versions} == {"step-1"}
        assert token_ids(engines.generate(PROMPTS, GREEDY)) == expected["new"]
    finally:
        engines.shutdown()
    assert len(set(pids)) == 4 and not survivors(pids)


def test_without_ray_the_errors_name_the_extra(qwen3_dir, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as where it is not installed
    monkeypatch.delitem(sys.modules, "rlserve.ray", raising=False)
    with pytest.raises(
        ImportError, match=r"^rlserve.ray needs Ray, an optional extra of rlserve: pip install 'rlserve\[ray\]'"
    ):
        import rlserve.ray  # noqa: F401
    with pytest.raises(ImportError, match=r"^data_parallel_backend: ray needs Ray.*rlserve\[ray\]"):
        LLM(str(qwen3_dir), data_parallel_backend="ray", num_kv_blocks=16)


def test_the_ray_backend_refuses_the_in_process_mode(qwen3_dir, monkeypatch) -> None:
    monkeypatch.setenv("RLSERVE_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="^data_parallel_backend: ray runs the engine cores as Ray actors"):
        LLM(str(qwen3_dir), data_parallel_backend="ray", num_kv_blocks=16)


def test_several_api_servers_on_ray_are_refused(qwen3_dir) -> None:
    """`rlserve serve --api-server-count N` shares its cores between processes, which Ray actors owned by one front
    end cannot be: refused by name, before anything starts."""
    with pytest.raises(ValueError, match="^data_parallel_backend: ray is offered with one API server"):
        start_shared_cores(str(qwen3_dir), data_parallel_size=2, data_parallel_backend="ray")
