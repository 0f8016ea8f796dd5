"""The RL frameworks' released clients drive a real `rlserve serve`: skyrl 0.3.0's `RemoteInferenceClient` and trl
1.16.0's async GRPO `VLLMClient` (requirements-frameworks.txt), their own classes making their own calls and parsing
the answers their own way. The server (conftest's `dev_server`, which test_framework_skyrl.py shares) runs as both start
vLLM for these clients: dev mode (VLLM_SERVER_DEV_MODE=1), no API key (neither client sends one),
`--weight-transfer-config '{"backend": "nccl"}'` (gloo on the CPU).

What of those releases does not run here, and why:
- SkyRL's chunked weight push (`start_weight_update`, `update_weights_nccl`, `finish_weight_update` of the client)
  goes through /collective_rpc to its `NewInferenceWorkerWrap` worker extension: test_skyrl_worker_extension.py runs
  it on a server of its own that loads the extension. Here its native calls run: `init_weight_update_communicator`
  (with its `BroadcastInitInfo`) and `update_named_weights` (/update_weights), between vLLM's /start_weight_update and
  /finish_weight_update sent by the test (vLLM 0.23, SkyRL's pin, requires them around an update too). The trainer's
  end of the group is rlserve's `NCCLWeightTransferEngine`.
- TRL's `WeightTransferClient` refuses to construct without vLLM installed (`is_vllm_available`), and its trainer
  side is vLLM's NCCL helpers: the HTTP half it drives, `VLLMClient`'s init / start / update / finish, runs here in
  `send_weights`' order with rlserve's trainer side in place of vLLM's.
- TRL's `AsyncRolloutWorker` (its /v1/completions calls) imports `datasets` and the trainer's stack (not light):
  its request and what it reads are replayed in test_server_openai.py's completions tests, not run from its class.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from released_frameworks import client_module
from safetensors.torch import load_file
from server_helpers import MODEL_NAME, Server, free_port

from rlserve.dtypes import dtype_name
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

TIMEOUT_S = 60.0
MAX_TOKENS = 8
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}


def _checkpoint(tmp_path: Path, seed: int) -> dict[str, torch.Tensor]:
    """Another random checkpoint of the same shapes (one seed per test: each pushes weights the server has not had);
    greedy samples tell whether it is served."""
    return load_file(make_model_dir(tmp_path / "toy", seed=seed, initializer_range=0.2) / "model.safetensors")


def _update_info(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    names = sorted(weights)
    return {
        "names": names,
        "dtype_names": [dtype_name(weights[n].dtype) for n in names],
        "shapes": [list(weights[n].shape) for n in names],
    }


def _beside(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """`work` on a thread (the trainer's end of a rendezvous or broadcast, which blocks until the engine's end runs)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    thread.start()
    return thread, result


def _trainer_join(port: int) -> tuple[threading.Thread, list[Any]]:
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 0, "world_size": 2}
    return _beside(lambda: NCCLWeightTransferEngine.trainer_init({**info, "timeout_s": TIMEOUT_S}))


def _trainer_send(group: Any, weights: dict[str, torch.Tensor], packed: bool) -> tuple[threading.Thread, list[Any]]:
    names = sorted(weights)
    args = NCCLTrainerSendWeightsArgs(group=group, packed=packed)
    return _beside(lambda: NCCLWeightTransferEngine.trainer_send_weights(((n, weights[n]) for n in names), args))


def test_skyrl_remote_inference_client(dev_server: Server, tmp_path: Path) -> None:
    """skyrl 0.3.0's client: tokenize, generate (its parse of /inference/v1/generate), Tinker's `sample()` (with its
    `output_kind`), keep-mode pause with a generation waiting, sleep and wake, the prefix-cache reset, the world
    size, and a weight sync through its native calls."""
    new_weights = _checkpoint(tmp_path, seed=11)
    client_mod = client_module("skyrl.backends.skyrl_train.inference_servers", "remote_inference_client")
    broadcast = client_module("skyrl.backends.skyrl_train.weight_sync", "broadcast_strategy")
    url = dev_server.url

    async def go() -> dict[str, Any]:
        async with client_mod.RemoteInferenceClient(
            proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=MODEL_NAME
        ) as client:

            async def generate(prompt: list[int]) -> dict[str, Any]:
                batch = {"prompt_token_ids": [prompt], "sampling_params": GREEDY, "session_ids": ["episode-1"]}
                return await asyncio.wait_for(client.generate(batch), TIMEOUT_S)

            (prompt,) = await client.tokenize(["weights"])
            before = await generate(prompt)
            tinker = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]}, "num_samples": 2}
            tinker |= {"sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": 3}}
            sampled = await asyncio.wait_for(client.sample({"json": tinker}), TIMEOUT_S)

            # A generation sent during a keep-mode pause waits in the engine's queue; it runs after the resume.
            await client.pause(mode="keep")
            in_flight = asyncio.ensure_future(generate(prompt))
            await asyncio.sleep(0.5)
            frozen = not in_flight.done()
            await client.resume()
            after_pause = await in_flight

            await client.sleep(level=1)
            await client.wake_up()
            await client.reset_prefix_cache()
            world_size = await client.get_world_size()

            port = free_port()
            init = broadcast.BroadcastInitInfo(
                override_existing_receiver=True, master_addr="127.0.0.1", master_port=port, rank_offset=1, world_size=2
            )
            thread, group = _trainer_join(port)
            await asyncio.wait_for(client.init_weight_update_communicator(init), TIMEOUT_S)
            await asyncio.to_thread(thread.join, TIMEOUT_S)
            try:
                await client.pause(mode="keep")
                # vLLM's start and finish around SkyRL's update: its client sends them through /collective_rpc to
                # its worker extension (see the module's docstring), so they are sent here as vLLM's routes.
                async with dev_server.async_client() as http:
                    assert (await http.post("/start_weight_update")).status_code == 200
                    thread, _ = _trainer_send(group[0], new_weights, packed=False)
                    await asyncio.wait_for(client.update_named_weights(_update_info(new_weights)), TIMEOUT_S)
                    await asyncio.to_thread(thread.join, TIMEOUT_S)
                    assert (await http.post("/finish_weight_update")).status_code == 200
                await client.resume()
            finally:
                group[0].shutdown()
            updated = await generate(prompt)
        return dict(before=before, sampled=sampled, frozen=frozen, after_pause=after_pause, world_size=world_size,
                    updated=updated)  # fmt: skip

    out = asyncio.run(go())
    before = out["before"]
    assert len(before["response_ids"][0]) == MAX_TOKENS and before["stop_reasons"] == ["length"]
    assert len(before["response_logprobs"][0]) == MAX_TOKENS and before["responses"][0]  # detokenized by /detokenize
    sequences = out["sampled"]["sequences"]
    assert len(sequences) == 2 and all(len(s["tokens"]) == 4 == len(s["logprobs"]) for s in sequences)
    assert out["frozen"] and out["after_pause"]["response_ids"] == before["response_ids"]
    assert out["world_size"] == (1, 1)
    assert out["updated"]["response_ids"] != before["response_ids"]  # the new random checkpoint answers differently


def test_trl_async_grpo_vllm_client(dev_server: Server, tmp_path: Path) -> None:
    """trl 1.16.0's async GRPO `VLLMClient`: readiness, the facts it reads (max_model_len, the served dtype from
    /server_info's vLLM nesting, the world size), pause / resume, and a weight push in `WeightTransferClient`'s order
    (init, then start / update / finish), each call answered 200 and the new weights served."""
    new_weights = _checkpoint(tmp_path, seed=12)
    vllm_client = client_module("trl.experimental.async_grpo", "vllm_client")
    accelerate = pytest.importorskip("accelerate")
    accelerate.PartialState()  # its logger needs accelerate's state, as the trainer's process has it (one CPU process)
    client = vllm_client.VLLMClient(dev_server.url, server_timeout=TIMEOUT_S)
    client.wait_for_server_ready(poll_interval_s=0.2)
    assert client.get_max_model_len() > 0
    assert client.get_dtype() == "torch.float32"
    assert client.get_world_size() == 1

    def greedy() -> list[int]:
        with dev_server.client() as http:
            body = {"model": MODEL_NAME, "prompt": "weights", "return_token_ids": True, **GREEDY}
            return http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]

    before = greedy()
    port = free_port()
    thread, group = _trainer_join(port)
    client.init_weight_transfer_engine(
        {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "packed": True},
        timeout=int(TIMEOUT_S),
    )
    thread.join(TIMEOUT_S)
    try:
        client.pause(timeout=int(TIMEOUT_S))
        client.start_weight_update(timeout=int(TIMEOUT_S))
        thread, _ = _trainer_send(group[0], new_weights, packed=True)  # TRL's init_info says packed
        client.update_weights(_update_info(new_weights), timeout=int(TIMEOUT_S))
        thread.join(TIMEOUT_S)
        client.finish_weight_update(timeout=int(TIMEOUT_S))
        client.resume(timeout=int(TIMEOUT_S))
    finally:
        group[0].shutdown()
    assert greedy() != before
