"""vLLM's worker_extension_cls and collective_rpc: extension methods see the engine's worker as vLLM code expects."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from rlserve import LLM, SamplingParams
from rlserve.engine.frontend.async_llm import AsyncLLM

EXTENSION = "worker_extension:CheckpointLoader"  # tests/worker_extension.py
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (4, 21)]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_an_extension_method_loads_weights_like_vllm_code(qwen3_dir, qwen3_alt_dir, make_llm) -> None:
    llm = make_llm(qwen3_dir, worker_extension_cls=EXTENSION)
    expected = tokens(make_llm(qwen3_alt_dir))
    assert tokens(llm) != expected
    (count,) = llm.collective_rpc("load_checkpoint", args=(str(qwen3_alt_dir / "model.safetensors"),))
    assert count > 0
    llm.reset_prefix_cache()  # the extension wrote weights behind the engine's back, as in vLLM
    assert tokens(llm) == expected
    assert llm.collective_rpc("describe") == [{"rank": 0, "local_rank": 0, "device": "cpu"}]
    # The core runs in its own process: a function is refused (nothing is pickled), naming the field.
    with pytest.raises(ValueError, match="^method: .*takes no functions"):
        llm.collective_rpc(lambda worker: worker.rank)


def test_a_function_runs_with_the_worker_first_in_process(qwen3_dir, make_llm) -> None:
    """With the core in this process a function runs with the worker as its first argument."""
    llm = make_llm(qwen3_dir, in_process=True, worker_extension_cls=EXTENSION)
    assert llm.collective_rpc(lambda worker, k: worker.model_runner.model.spec.num_layers * k, args=(2,)) == [
        2 * llm.engine_core.runner.spec.num_layers
    ]
    assert llm.collective_rpc("describe") == [{"rank": 0, "local_rank": 0, "device": "cpu"}]
    # vLLM's worker attributes that extensions hand back to vLLM functions (SkyRL's): the engine's config, and the
    # weight-transfer backend, none before a trainer's init_weight_transfer_engine.
    config = llm.engine_core.runner.config
    assert llm.collective_rpc(lambda w: (w.vllm_config, w.model_config, w.weight_transfer_engine)) == [
        (config, config, None)
    ]
    # Without an extension the worker is still there for functions.
    assert make_llm(qwen3_dir, in_process=True).collective_rpc(lambda w: w.rank) == [0]


def test_collective_rpc_errors(qwen3_dir, make_llm) -> None:
    llm = make_llm(qwen3_dir, worker_extension_cls=EXTENSION)
    with pytest.raises(ValueError, match="^method: 'nope' is not a method of the worker extension"):
        llm.collective_rpc("nope")
    with pytest.raises(ValueError, match="the extension refused"):
        llm.collective_rpc("fail")
    with pytest.raises(ValueError, match="redefines worker attributes \\['device'\\]"):
        make_llm(qwen3_dir, worker_extension_cls="worker_extension:ClashingExtension")
    with pytest.raises(ValueError, match="cannot import"):
        make_llm(qwen3_dir, worker_extension_cls="worker_extension:Missing")


def test_the_core_refuses_what_the_server_refuses(qwen3_dir, qwen3_alt_dir, make_llm, tmp_path) -> None:
    """Issue 28 row 2, defence in depth: whoever reaches the core's socket (with its secret: this LLM), the core
    itself refuses the worker's own attributes by name (HTTP's 400) and, with allowed_weight_dirs, a checkpoint
    directory outside them (HTTP's 403); inside them it loads."""
    allowed = tmp_path / "allowed"
    shutil.copytree(qwen3_alt_dir, allowed / "alt")
    llm = make_llm(qwen3_dir, worker_extension_cls=EXTENSION, allowed_weight_dirs=(str(allowed),))
    for method in ("__init__", "_private", "model_runner"):
        with pytest.raises(ValueError, match=f"^method: '{method}' is not a method of the worker extension"):
            llm.collective_rpc(method)
    with pytest.raises(PermissionError, match="^weights_path: .* is not a directory under an allowed one"):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(qwen3_alt_dir)})
    with pytest.raises(PermissionError, match="^weight_dir: .* is not a directory under an allowed one"):
        llm.client.call("load_weights_from_dir", str(qwen3_alt_dir))
    before = tokens(llm)
    assert llm.client.call("load_weights_from_dir", str(allowed / "alt")) > 0
    assert tokens(llm) != before
    llm.collective_rpc("reload_weights")  # the served model's own directory, whatever the allowed ones
    assert tokens(llm) == before


def test_async_collective_rpc_runs_between_steps(qwen3_dir) -> None:
    engine = AsyncLLM(str(qwen3_dir), num_kv_blocks=256, worker_extension_cls=EXTENSION)

    async def go():
        async def consume():
            async for out in engine.generate(PROMPTS[1], GREEDY):
                last = out
            return last

        running = asyncio.create_task(consume())
        described = await engine.collective_rpc("describe", timeout=30)
        return described, await running

    try:
        described, out = asyncio.run(go())
    finally:
        engine.shutdown()
    assert described == [{"rank": 0, "local_rank": 0, "device": "cpu"}]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
