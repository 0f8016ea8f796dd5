"""verl 0.9.1's weight sync into rlserve, with verl's own code on both ends, as verl runs them (needs CUDA and verl,
see requirements-frameworks.txt; the CPU half is tests/server/test_verl_rollout.py): the server is verl's
`vLLMHttpServer` as a named Ray actor without GPU resources (what `vLLMReplica.launch_servers` starts; verl then
pins its GPU with CUDA_VISIBLE_DEVICES), under rlserve's vllm surface through the actor's environment; the trainer side
is verl's `ServerAdapter.update_weights` in this process, which starts the extension's `update_weights_from_ipc`
through `collective_rpc` and sends the tensors with `BucketedWeightSender` (ZMQ and CUDA IPC). The engine starts on
dummy weights (verl's default `load_format`); after the sync it must sample greedily what rlserve's own engine samples
from the trainer's checkpoint."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rlserve import LLM, SamplingParams, vllm_surface
from rlserve.toy import make_model_dir

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
MAX_TOKENS = 16


def _verl_modules() -> dict[str, Any]:
    pytest.importorskip("verl", reason="pip install --no-deps -r requirements-frameworks.txt")
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    return {
        "HFModelConfig": HFModelConfig,
        "RolloutConfig": RolloutConfig,
        "RolloutMode": RolloutMode,
        "vLLMHttpServer": vLLMHttpServer,
        "ServerAdapter": ServerAdapter,
    }


@pytest.fixture
def under_surface(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """verl's modules imported here with the surface installed, and the variables verl's trainer worker has (its
    rank, and the ranks on its node)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "1")
    vllm_surface.install()
    try:
        yield _verl_modules()
    finally:
        vllm_surface.uninstall()


def _rollout_config(verl: dict[str, Any]) -> Any:
    return verl["RolloutConfig"](
        name="vllm",
        tensor_model_parallel_size=1,
        dtype="bfloat16",
        max_model_len=256,
        prompt_length=64,
        response_length=MAX_TOKENS,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        gpu_memory_utilization=0.1,
        free_cache_engine=False,
    )


def _expected(model_dir: Path) -> list[int]:
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", num_kv_blocks=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_verl_syncs_its_trainers_weights_into_rlserve(under_surface: dict[str, Any], tmp_path: Path) -> None:
    verl = under_surface
    model_dir = make_model_dir(tmp_path / "served", "Qwen3ForCausalLM", seed=0)
    trained_dir = make_model_dir(tmp_path / "trained", "Qwen3ForCausalLM", seed=1, initializer_range=0.2)
    expected = _expected(trained_dir)
    rollout, model_config = _rollout_config(verl), verl["HFModelConfig"](path=str(model_dir))
    surface_env = vllm_surface.surface_environment(os.environ)
    actor_env = {name: surface_env[name] for name in (vllm_surface.ENV_VAR, "PYTHONPATH")}
    actor_env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"  # verl's server actors see every GPU, pin one
    ray.init(address="local", num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        server = (
            ray.remote(verl["vLLMHttpServer"])
            .options(name="vllm_server_0_0", runtime_env={"env_vars": actor_env})
            .remote(
                config=rollout,
                model_config=model_config,
                rollout_mode=verl["RolloutMode"].STANDALONE,
                workers=[],
                replica_rank=0,
                node_rank=0,
                gpus_per_node=1,
                nnodes=1,
                cuda_visible_devices="0",
            )
        )
        ray.get(server.launch_server.remote())
        adapter = verl["ServerAdapter"](rollout, model_config, device_mesh=None, replica_rank=0)
        weights = {name: tensor.cuda() for name, tensor in load_file(trained_dir / "model.safetensors").items()}
        asyncio.run(adapter.update_weights(iter(weights.items()), global_steps=1))
        params = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        out = ray.get(server.generate.remote(PROMPT, params, "after-sync"))
        assert out.extra_fields["global_steps"] == 1
        assert out.token_ids == expected
    finally:
        ray.shutdown()
