"""The `nccl` backend over real NCCL: trainer on cuda:0, engine on cuda:1 (skipped without two GPUs).

NCCL refuses two ranks on one GPU, so this cannot run on one; the same flow over gloo runs everywhere in
tests/weight_transfer/test_engine_weight_update.py.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlserve import LLM, SamplingParams, WeightTransferConfig
from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.engine.wire.process import free_port
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one rank per GPU)"),
]
TIMEOUT_S = 120.0
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 33, 90)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)


def _info(weights: dict[str, torch.Tensor], packed: bool) -> dict:
    names = list(weights)
    return dict(
        names=names,
        dtype_names=[str(weights[n].dtype).removeprefix("torch.") for n in names],
        shapes=[list(weights[n].shape) for n in names],
        packed=packed,
        packed_buffer_size_bytes=1 << 20,
    )


def _trainer(port: int, new_dir: str, rounds: list[bool]) -> None:
    torch.cuda.set_device(0)
    weights = {n: t.cuda(0) for n, t in load_file(str(Path(new_dir) / "model.safetensors")).items()}
    group = NCCLWeightTransferEngine.trainer_init(
        dict(master_address="127.0.0.1", master_port=port, world_size=2, timeout_s=TIMEOUT_S)
    )
    for packed in rounds:
        NCCLWeightTransferEngine.trainer_send_weights(
            iter(weights.items()),
            NCCLTrainerSendWeightsArgs(group=group, packed=packed, packed_buffer_size_bytes=1 << 20),
        )
    group.shutdown()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    old = make_model_dir(tmp_path_factory.mktemp("old"), preset="small", seed=0)
    new = make_model_dir(tmp_path_factory.mktemp("new"), preset="small", seed=0)
    gen = torch.Generator().manual_seed(1)
    weights = {
        n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in load_file(str(new / "model.safetensors")).items()
    }
    save_file(weights, str(new / "model.safetensors"), metadata={"format": "pt"})
    return old, new


def _with_trainer(new_dir: Path, rounds: list[bool], engine_side) -> None:
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(target=_trainer, args=(port, str(new_dir), rounds))
    trainer.start()
    try:
        engine_side(port)
        trainer.join(TIMEOUT_S)
        assert trainer.exitcode == 0
    finally:
        if trainer.is_alive():
            trainer.kill()


def _init(port: int) -> dict:
    return dict(init_info=dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2))


def test_nccl_update_equals_fresh_engine(model_dirs):
    old, new = model_dirs
    weights = load_file(str(new / "model.safetensors"))
    common = dict(dtype="float32", device="cuda:1", num_kv_blocks=256)
    fresh = [o.outputs[0] for o in LLM(str(new), **common).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(str(old), weight_transfer_config=WeightTransferConfig(backend="nccl"), **common)

    def engine_side(port: int) -> None:
        llm.init_weight_transfer_engine(_init(port))
        for step, packed in enumerate([False, True]):
            llm.start_weight_update()
            llm.update_weights(dict(update_info=_info(weights, packed)))
            llm.finish_weight_update(weight_version=f"step-{step}")
            got = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            for g, f in zip(got, fresh, strict=True):
                assert g.token_ids == f.token_ids
                assert [lp[t].logprob for lp, t in zip(g.logprobs, g.token_ids, strict=True)] == [
                    lp[t].logprob for lp, t in zip(f.logprobs, f.token_ids, strict=True)
                ]

    _with_trainer(new, [False, True], engine_side)


def test_requests_paused_with_keep_finish_under_new_weights(model_dirs):
    old, new = model_dirs
    weights = load_file(str(new / "model.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def engine_side_async(port: int) -> list:
        engine = AsyncLLM(
            str(old),
            dtype="float32",
            device="cuda:1",
            num_kv_blocks=256,
            weight_transfer_config=WeightTransferConfig(backend="nccl"),
        )
        try:
            await engine.init_weight_transfer_engine(_init(port))
            finals: list = []

            async def run(i: int) -> None:
                async for out in engine.generate(PROMPTS[i], params, request_id=f"r{i}"):
                    if out.finished:
                        finals.append(out.outputs[0])

            tasks = [asyncio.create_task(run(i)) for i in range(len(PROMPTS))]
            while engine.engine_core.num_generated_tokens < 3 * len(PROMPTS):
                await asyncio.sleep(0.005)
            await engine.pause_generation(mode="keep")
            await engine.start_weight_update()
            await engine.update_weights(dict(update_info=_info(weights, True)))
            await engine.finish_weight_update(weight_version="new")
            await engine.resume_generation()
            await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
            return finals
        finally:
            engine.shutdown()

    results: list = []
    _with_trainer(new, [True], lambda port: results.extend(asyncio.run(engine_side_async(port))))
    assert len(results) == len(PROMPTS)
    for out in results:
        assert len(out.token_ids) == 200
        switch = out.weight_versions.index("new")
        assert 0 < switch and set(out.weight_versions[switch:]) == {"new"}
