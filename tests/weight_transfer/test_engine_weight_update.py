"""Live weight updates into a real engine: a trainer process sends over gloo, the engine's outputs then equal a fresh
engine loaded from the new weights, exactly (fp32)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

# The import is the only change from vLLM's example code.
from rlserve import LLM, SamplingParams
from rlserve.config import WeightTransferConfig
from rlserve.engine.wire.process import free_port
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import (
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
    compare_checksums,
    weight_checksums,
)

TIMEOUT_S = 60.0
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]}, "hello world"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _trainer(port: int, new_dir: str, rounds: list[dict], world_size: int = 2) -> None:
    """Seed-shaped trainer code: join as rank 0, then send the new weights once per round."""
    weights = _checkpoint(Path(new_dir))
    group = NCCLWeightTransferEngine.trainer_init(
        dict(master_address="127.0.0.1", master_port=port, world_size=world_size, timeout_s=TIMEOUT_S)
    )
    for r in rounds:
        items = list(weights.items())
        if r.get("bad_shape"):
            items = [(name, t[:-1] if name.endswith("q_proj.weight") else t) for name, t in items]
        NCCLWeightTransferEngine.trainer_send_weights(
            iterator=iter(items),
            trainer_args=NCCLTrainerSendWeightsArgs(
                group=group, packed=r["packed"], packed_buffer_size_bytes=r.get("buffer", 1 << 30)
            ),
        )
    group.shutdown()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    old = make_model_dir(tmp_path_factory.mktemp("old"), "Qwen3ForCausalLM", seed=0)
    new = make_model_dir(tmp_path_factory.mktemp("new"), "Qwen3ForCausalLM", seed=0)
    gen = torch.Generator().manual_seed(1)
    changed = {name: t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in _checkpoint(new).items()}
    save_file(changed, str(new / "model.safetensors"), metadata={"format": "pt"})
    return old, new


def _outputs(llm: LLM):
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def _update_info(weights: dict[str, torch.Tensor], **extra) -> dict:
    return dict(
        names=list(weights),
        dtype_names=[str(t.dtype).removeprefix("torch.") for t in weights.values()],
        shapes=[list(t.shape) for t in weights.values()],
        **extra,
    )


def _run_with_trainer(new_dir: Path, rounds: list[dict], engine_side, world_size: int = 2) -> None:
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    trainer = ctx.Process(target=_trainer, args=(port, str(new_dir), rounds, world_size))
    trainer.start()
    try:
        engine_side(port)
        trainer.join(TIMEOUT_S)
        assert trainer.exitcode == 0
    finally:
        if trainer.is_alive():
            trainer.kill()


def test_update_equals_fresh_engine_packed_and_unpacked(model_dirs):
    old, new = model_dirs
    weights = _checkpoint(new)
    fresh = _outputs(LLM(str(new)))
    llm = LLM(str(old), weight_transfer_config=WeightTransferConfig(backend="nccl"))
    before = _outputs(llm)
    assert [o.outputs[0].token_ids for o in before] != [o.outputs[0].token_ids for o in fresh]
    rounds = [{"packed": False}, {"packed": True, "buffer": 4096}]  # 4 KiB buckets: many of them

    def engine_side(port: int) -> None:
        llm.init_weight_transfer_engine(
            WeightTransferInitRequest(
                init_info=dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2)
            )
        )
        for i, r in enumerate(rounds):
            llm.start_weight_update()
            llm.update_weights(
                WeightTransferUpdateRequest(
                    update_info=_update_info(weights, packed=r["packed"], packed_buffer_size_bytes=r.get("buffer"))
                )
            )
            llm.finish_weight_update(weight_version=f"step-{i + 1}")
            after = _outputs(llm)
            for a, f in zip(after, fresh, strict=True):
                assert a.outputs[0].token_ids == f.outputs[0].token_ids
                lp_a = [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids, strict=True)]
                lp_f = [lp[t].logprob for lp, t in zip(f.outputs[0].logprobs, f.outputs[0].token_ids, strict=True)]
                assert lp_a == lp_f  # exact: same weights, same fp32 arithmetic
                assert a.outputs[0].weight_versions == [f"step-{i + 1}"] * len(a.outputs[0].token_ids)
            assert llm.get_weight_version() == f"step-{i + 1}"
            assert compare_checksums(weight_checksums(weights.items()), llm.weight_checksums())["match"]

    _run_with_trainer(new, rounds, engine_side)


def test_one_broadcast_updates_two_engines(model_dirs):
    """Two inference engines (ranks 1 and 2: rank_offset + worker index) in one group with the trainer, as
    PipelineRL runs several servers: every packed broadcast reaches both, and both then equal a fresh engine."""
    old, new = model_dirs
    weights = _checkpoint(new)
    fresh = [o.outputs[0].token_ids for o in _outputs(LLM(str(new)))]
    engines = [LLM(str(old), weight_transfer_config=WeightTransferConfig(backend="nccl")) for _ in range(2)]
    rounds = [{"packed": True, "buffer": 8192}]

    def engine_side(port: int) -> None:
        def join_and_update(llm: LLM, rank_offset: int) -> None:
            info = dict(master_address="127.0.0.1", master_port=port, rank_offset=rank_offset, world_size=3)
            llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
            llm.start_weight_update()
            update_info = _update_info(weights, packed=True, packed_buffer_size_bytes=8192)
            llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
            llm.finish_weight_update(weight_version="step-1")

        # Every rank must join, and every broadcast needs all of them: the engines run side by side.
        with ThreadPoolExecutor(2) as pool:
            for done in [pool.submit(join_and_update, llm, 1 + i) for i, llm in enumerate(engines)]:
                done.result(timeout=TIMEOUT_S)

    _run_with_trainer(new, rounds, engine_side, world_size=3)
    for llm in engines:
        assert [o.outputs[0].token_ids for o in _outputs(llm)] == fresh
        assert compare_checksums(weight_checksums(weights.items()), llm.weight_checksums())["match"]


def test_refused_update_changes_nothing_and_trainer_finishes(model_dirs):
    old, new = model_dirs
    weights = _checkpoint(new)
    llm = LLM(str(old), weight_transfer_config=WeightTransferConfig(backend="nccl"))
    before = _outputs(llm)
    checksums = llm.weight_checksums()
    bad = {n: (t[:-1] if n.endswith("q_proj.weight") else t) for n, t in weights.items()}

    def engine_side(port: int) -> None:
        llm.init_weight_transfer_engine(
            dict(init_info=dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2))
        )
        llm.start_weight_update()
        with pytest.raises(ValueError, match="shape"):
            llm.update_weights(dict(update_info=_update_info(bad, packed=True, packed_buffer_size_bytes=4096)))
        llm.finish_weight_update()

    _run_with_trainer(new, [{"packed": True, "buffer": 4096, "bad_shape": True}], engine_side)
    assert llm.weight_checksums() == checksums
    after = _outputs(llm)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    assert llm.get_weight_version() == "default"


def test_lifecycle_misuse_is_refused_and_engine_keeps_generating(model_dirs):
    old, _ = model_dirs
    unconfigured = LLM(str(old))
    # The fix for each front end: the server's flag and the Python argument.
    with pytest.raises(RuntimeError, match=r"not configured.*--weight-transfer-config.*WeightTransferConfig\(\)"):
        unconfigured.init_weight_transfer_engine(dict(init_info={}))
    llm = LLM(str(old), weight_transfer_config=WeightTransferConfig(backend="nccl"))
    before = _outputs(llm)
    with pytest.raises(RuntimeError, match="not initialized"):
        llm.start_weight_update()
    with pytest.raises(RuntimeError, match="not initialized"):
        llm.update_weights(dict(update_info=dict(names=[], dtype_names=[], shapes=[])))
    with pytest.raises(RuntimeError, match="without a matching"):
        llm.finish_weight_update()
    with pytest.raises(ValueError, match="Invalid init_info"):
        llm.init_weight_transfer_engine(dict(init_info=dict(master_address="127.0.0.1")))
    # vLLM 0.33's model-format names are refused by name, in Python as over HTTP (never ignored).
    with pytest.raises(ValueError, match="^is_checkpoint_format: rlserve loads checkpoint-format names only"):
        llm.start_weight_update(is_checkpoint_format=False)
    assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
    llm.shutdown_weight_transfer_engine()  # nothing open: a no-op, as vLLM's
    assert [o.outputs[0].token_ids for o in _outputs(llm)] == [o.outputs[0].token_ids for o in before]


def test_start_twice_and_update_without_start_are_refused(model_dirs):
    old, new = model_dirs
    weights = _checkpoint(new)
    llm = LLM(str(old), weight_transfer_config=WeightTransferConfig(backend="nccl"))

    def engine_side(port: int) -> None:
        llm.init_weight_transfer_engine(
            dict(init_info=dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2))
        )
        with pytest.raises(RuntimeError, match="start_weight_update first"):
            llm.update_weights(dict(update_info=dict(names=[], dtype_names=[], shapes=[])))
        llm.start_weight_update()
        with pytest.raises(RuntimeError, match="already in progress"):
            llm.start_weight_update()
        llm.update_weights(dict(update_info=_update_info(weights)))
        llm.finish_weight_update("v1")

    _run_with_trainer(new, [{"packed": False}], engine_side)
    assert llm.get_weight_version() == "v1"
    assert compare_checksums(weight_checksums(weights.items()), llm.weight_checksums())["match"]
