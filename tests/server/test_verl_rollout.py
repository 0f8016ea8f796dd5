"""verl 0.9.1's vLLM rollout on rlserve, on the CPU, with verl's own code: its `vLLMHttpServer`
(verl/workers/rollout/vllm_rollout/vllm_async_server.py, the class verl's `vLLMReplica` runs as a Ray actor per node),
built here in this process from verl's own `RolloutConfig` and `HFModelConfig`, with rlserve's vllm surface installed
(`import vllm` resolves to rlserve). Unchanged verl code launches the engine (`launch_server`: its vLLM command line,
parsed by `vllm.entrypoints.cli.serve`'s subcommand, `AsyncEngineArgs.from_cli_args`, `AsyncLLM.from_vllm_config`,
its worker extension `vLLMColocateWorkerExtension` loaded in rlserve's engine core and called there through
`collective_rpc("monkey_patch_model")`, `build_app` / `init_app_state` served by verl's uvicorn helper), generates
(`generate`: `TokensPrompt`, `SamplingParams`, `priority=0`), aborts and resumes (`abort_all_requests`, reading the
output processor's request states, then `resume_generation`; `abort_request` of one request is refused by name),
sleeps and wakes (`sleep`, `wake_up`, `clear_kv_cache`).

Ray runs locally only because verl's server reads its job id. verl's weight sync (`ServerAdapter.update_weights` into
the extension's `update_weights_from_ipc`) needs CUDA on both ends (verl has no CPU platform: its device module is
torch.cuda), so it is tests/gpu/test_verl_rollout_gpu.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from rlserve import vllm_surface
from rlserve.server.vllm_entrypoints import build_app, run_headless
from rlserve.toy import make_model_dir

pytestmark = pytest.mark.slow

VERL_MISSING = "verl is not installed: pip install --no-deps -r requirements-frameworks.txt"
# Beyond the toy tokenizer's ~260 tokens, as a padded vocabulary is (Qwen's): verl's worker extension masks the rest.
PADDED_VOCAB = 512
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
T = TypeVar("T")


@dataclass
class VerlServer:
    """verl's server and the event loop its engine and HTTP server live on."""

    server: Any  # verl's vLLMHttpServer
    runner: asyncio.Runner
    tokenizer_len: int

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coroutine)

    def generate(self, request_id: str, **params: Any) -> Any:
        """verl's `generate`: token ids in, its TokenOutput (token ids, logprobs, stop reason) out."""
        return self.run(self.server.generate(PROMPT, params, request_id))


def _rollout_config(rollout_config_cls: type) -> Any:
    """verl's rollout config for a small CPU engine: float32, the checkpoint's weights (verl's default `dummy` would
    leave them to a weight sync)."""
    return rollout_config_cls(
        name="vllm",
        tensor_model_parallel_size=1,
        dtype="float32",
        load_format="auto",
        max_model_len=128,
        prompt_length=16,
        response_length=16,
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.fixture(scope="module")
def verl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VerlServer]:
    ray = pytest.importorskip("ray")
    environ = dict(os.environ)  # verl's server sets CUDA_VISIBLE_DEVICES and VERL_* variables in its process
    os.environ.pop("RLSERVE_API_KEY", None)
    vllm_surface.install()
    runner = asyncio.Runner()
    server = None
    try:
        async_server = pytest.importorskip("verl.workers.rollout.vllm_rollout.vllm_async_server", reason=VERL_MISSING)
        from verl.workers.config import HFModelConfig, RolloutConfig
        from verl.workers.rollout.replica import RolloutMode

        model_dir = make_model_dir(tmp_path_factory.mktemp("verl") / "model", vocab_size=PADDED_VOCAB)
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
        server = async_server.vLLMHttpServer(
            _rollout_config(RolloutConfig),
            HFModelConfig(path=str(model_dir)),
            RolloutMode.COLOCATED,  # sleep and wake_up act (level 1); the standalone mode skips them
            workers=[],
            replica_rank=0,
            node_rank=0,
            gpus_per_node=1,
            nnodes=1,
            cuda_visible_devices="",
        )
        runner.run(server.launch_server())
        yield VerlServer(server, runner, len(server.model_config.tokenizer))
    finally:
        if server is not None and getattr(server, "engine", None) is not None:
            runner.run(_stop(server._server_task))
            server.engine.shutdown()
        runner.close()
        ray.shutdown()
        vllm_surface.uninstall()
        os.environ.clear()
        os.environ.update(environ)


def test_verl_generates_through_its_server_and_its_http_app(verl: VerlServer) -> None:
    params = {"temperature": 1.0, "seed": 3, "max_tokens": 12, "ignore_eos": True}
    out = verl.generate("verl-0", logprobs=True, **params)
    assert out.stop_reason == "completed" and len(out.token_ids) == len(out.log_probs) == 12
    assert all(logprob <= 0 for logprob in out.log_probs)
    # verl's monkey_patch_model ran in rlserve's core at launch: the padded vocabulary beyond the tokenizer is masked
    # (a random model samples half of its tokens there otherwise).
    assert max(out.token_ids) < verl.tokenizer_len < PADDED_VOCAB

    async def over_http() -> dict[str, Any]:
        host, port = verl.server.get_server_address()
        body = {"model": verl.server.model_config.local_path, "prompt": PROMPT, "logprobs": 0, **params}
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=60) as client:
            response = await client.post("/v1/completions", json={**body, "return_token_ids": True})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    choice = verl.run(over_http())
    assert choice["token_ids"] == out.token_ids
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(out.log_probs, abs=1e-5)


def test_verl_aborts_what_runs_and_resumes(verl: VerlServer) -> None:
    server = verl.server

    async def scenario() -> tuple[dict[str, Any], Any, Any]:
        running = asyncio.create_task(server.generate(PROMPT, {"max_tokens": 100, "ignore_eos": True}, "verl-long"))
        while "verl-long" not in server.engine.output_processor.request_states:
            await asyncio.sleep(0.01)
        # verl's abort of one request builds vLLM's output-processor objects: refused by name, reported by verl.
        one = await server.abort_request("verl-long")
        assert one["aborted"] is False and one["error"].startswith("vllm.v1.engine.FinishReason: rlserve does not")
        aborted = await server.abort_all_requests()
        ended = await running
        parked = asyncio.create_task(server.generate(PROMPT, {"max_tokens": 4}, "verl-parked"))
        await asyncio.sleep(0.2)
        assert not parked.done(), "verl's gate holds new requests until resume_generation"
        await server.resume_generation()
        return aborted, ended, await parked

    aborted, ended, after = verl.run(scenario())
    assert aborted["aborted_count"] == 1 and aborted["request_ids"] == ["verl-long"]
    assert ended.stop_reason == "aborted" and len(ended.token_ids) < 100
    assert after.stop_reason == "completed" and len(after.token_ids) == 4


def test_verl_sleeps_and_wakes_with_its_weights(verl: VerlServer) -> None:
    params = {"temperature": 1.0, "seed": 5, "max_tokens": 6, "ignore_eos": True, "logprobs": True}
    before = verl.generate("verl-before", **params)
    verl.run(verl.server.sleep())
    assert verl.run(verl.server.engine.is_sleeping())
    verl.run(verl.server.wake_up())
    assert not verl.run(verl.server.engine.is_sleeping())
    verl.run(verl.server.clear_kv_cache())
    verl.run(verl.server.wait_for_requests_to_drain())
    verl.run(verl.server.set_global_steps(7))
    after = verl.generate("verl-after", **params)
    assert after.token_ids == before.token_ids and after.log_probs == pytest.approx(before.log_probs, abs=1e-5)
    assert after.extra_fields["global_steps"] == 7


def test_what_verl_could_ask_and_rlserve_lacks_is_refused_by_name(verl: VerlServer, tmp_path: Path) -> None:
    engine = verl.server.engine

    async def refusals() -> list[str]:
        messages = []
        for prompt, kwargs in [
            ({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": [b"..."]}}, {}),
            ({"prompt_token_ids": PROMPT, "prompt_embeds": [0.0]}, {}),
            ({"prompt_token_ids": PROMPT}, {"priority": 1}),
        ]:
            with pytest.raises(ValueError) as refused:
                async for _ in engine.generate(prompt, request_id="refused", **kwargs):
                    pass
            messages.append(str(refused.value))
        return messages

    multimodal, unknown_key, priority = verl.run(refusals())
    assert multimodal.startswith("multi_modal_data: not supported (rlserve's models are text-only)")
    assert unknown_key.startswith("prompt: unknown key(s) ['prompt_embeds']")
    assert priority.startswith("priority: not supported")
    with pytest.raises(NotImplementedError, match="run_headless: engine ranks without an API server"):
        run_headless(None)
    with pytest.raises(ValueError, match=r"supported_tasks: rlserve serves \('generate',\), got \('embed',\)"):
        build_app(None, ("embed",))
