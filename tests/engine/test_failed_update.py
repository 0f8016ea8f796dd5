"""A weight update that fails during its transfer (after validation, with some tensors written). A trainer that is still
there (any error but TRAINER_LOST) keeps the update open and must send those tensors again; a lost trainer's update is
abandoned, and the previous weights come back from a snapshot (weight_update_snapshot) or generation is refused until
a full update. Never does the engine generate from weights that are neither old nor new."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from safetensors.torch import load_file

from rlserve import SamplingParams, WeightTransferConfig
from rlserve.engine.frontend.core_client import RequestRefusedError
from rlserve.weight_transfer import (
    LoadWeightsFn,
    WeightTransferEngine,
    WeightTransferEngineFactory,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

# The trainer's tensors, by update id: this in-process backend hands them over by reference.
OUTBOX: dict[str, list] = {}
BACKEND = "test-breaks-mid-transfer"


@dataclass
class DirectUpdateInfo(WeightTransferUpdateInfo):
    update_id: str = ""
    fail_after: int = -1  # write this many tensors, then fail; -1: never
    lost: bool = True  # fail as a dropped connection (the trainer is gone), else as a failed copy


class BreakingEngine(WeightTransferEngine[WeightTransferInitInfo, DirectUpdateInfo]):
    init_info_cls = WeightTransferInitInfo
    update_info_cls = DirectUpdateInfo

    def init_transfer_engine(self, init_info: WeightTransferInitInfo) -> None:
        pass

    def receive_weights(self, update_info: DirectUpdateInfo, load_weights: LoadWeightsFn) -> None:
        tensors = OUTBOX.pop(update_info.update_id)
        if update_info.fail_after >= 0:
            if update_info.fail_after:
                load_weights(tensors[: update_info.fail_after])
            if update_info.lost:
                raise ConnectionError("the trainer went away mid-transfer")
            raise RuntimeError("a copy failed")
        load_weights(tensors)

    def discard_weights(self, update_info: DirectUpdateInfo) -> None:
        OUTBOX.pop(update_info.update_id, None)

    def shutdown(self) -> None:
        pass


if BACKEND not in WeightTransferEngineFactory.available_engines():
    WeightTransferEngineFactory.register_engine(BACKEND, BreakingEngine)


def send(llm, weights: dict, update_id: str, fail_after: int = -1, lost: bool = True) -> None:
    names = sorted(weights)
    OUTBOX[update_id] = [(n, weights[n]) for n in names]
    info = {
        "names": names,
        "dtype_names": [str(weights[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(weights[n].shape) for n in names],
        "update_id": update_id,
        "fail_after": fail_after,
        "lost": lost,
    }
    llm.update_weights({"update_info": info})


PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [{"prompt_token_ids": list(range(5, 25))}]


def _tokens(llm) -> list[int]:
    return llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def _engine(make_llm, model_dir, **kwargs):
    # In process: this test's backend is registered, and hands tensors over by reference, in this process only.
    llm = make_llm(model_dir, in_process=True, weight_transfer_config=WeightTransferConfig(backend=BACKEND), **kwargs)
    llm.init_weight_transfer_engine({"init_info": {}})
    return llm


@pytest.fixture(scope="module")
def expected_new(qwen3_alt_dir, make_llm) -> list[int]:
    fresh = make_llm(qwen3_alt_dir)
    try:
        return _tokens(fresh)
    finally:
        fresh.shutdown()


def test_a_failed_copy_keeps_the_update_open_until_resent(qwen3_dir, qwen3_alt_dir, make_llm, expected_new) -> None:
    new = load_file(str(qwen3_alt_dir / "model.safetensors"))
    llm = _engine(make_llm, qwen3_dir)
    core = llm.engine_core
    core.pause("keep", clear_cache=True)
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="a copy failed"):
        send(llm, new, "broken", fail_after=3, lost=False)
    with pytest.raises(RuntimeError, match="3 of .* tensors .* hold no valid weights; .*send them"):
        llm.finish_weight_update("v1")
    core.resume()  # lifted, yet nothing runs on the half-written weights: requests are refused with the reason
    with pytest.raises(RequestRefusedError, match="update_weights call failed part-way"):
        _tokens(llm)
    assert llm.get_weight_version() == "default" and llm.stats()["num_unwritten_weights"] == 3

    # Resending only some of the tensors is not enough; all of them is.
    send(llm, dict(sorted(new.items())[3:5]), "some")
    with pytest.raises(RuntimeError, match="hold no valid weights"):
        llm.finish_weight_update("v1")
    send(llm, new, "all")
    llm.finish_weight_update("v1")
    assert llm.not_serving is None and _tokens(llm) == expected_new


def test_a_receive_that_writes_nothing_changes_nothing(qwen3_dir, qwen3_alt_dir, make_llm) -> None:
    """As an ipc handle sent to a CPU engine: refused before any byte is written, the update goes on."""
    new = load_file(str(qwen3_alt_dir / "model.safetensors"))
    llm = _engine(make_llm, qwen3_dir)
    before, checksums = _tokens(llm), llm.weight_checksums()
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="a copy failed"):
        send(llm, new, "refused", fail_after=0, lost=False)
    assert llm.not_serving is None and llm.stats()["num_unwritten_weights"] == 0
    llm.finish_weight_update("v0")
    assert llm.weight_checksums() == checksums and _tokens(llm) == before


def test_a_lost_trainer_abandons_the_update_and_generation_waits_for_a_full_one(
    qwen3_dir, qwen3_alt_dir, make_llm, expected_new
) -> None:
    new = load_file(str(qwen3_alt_dir / "model.safetensors"))
    llm = _engine(make_llm, qwen3_dir)
    core = llm.engine_core
    core.pause("keep", clear_cache=True)
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="trainer was lost .* abandoned \\(incomplete\\)"):
        send(llm, new, "lost", fail_after=3)
    assert not core.is_paused()  # the dead trainer's pause is lifted; the missing weights hold generation
    with pytest.raises(RequestRefusedError, match="weight update was abandoned.*weight update .*or a reload"):
        _tokens(llm)
    with pytest.raises(RuntimeError, match="without a matching start"):
        llm.finish_weight_update("v1")
    with pytest.raises(RuntimeError, match="not initialized"):  # the broken transport was closed
        llm.start_weight_update()

    # A new trainer: init, start, a full update, finish.
    llm.init_weight_transfer_engine({"init_info": {}})
    llm.start_weight_update()
    send(llm, new, "all")
    llm.finish_weight_update("v1")
    assert llm.not_serving is None and _tokens(llm) == expected_new


def test_a_lost_trainer_with_a_snapshot_restores_the_previous_weights(qwen3_dir, qwen3_alt_dir, make_llm) -> None:
    new = load_file(str(qwen3_alt_dir / "model.safetensors"))
    llm = _engine(make_llm, qwen3_dir, weight_update_snapshot=True)
    before, checksums = _tokens(llm), llm.weight_checksums()
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="abandoned \\(restored\\)"):
        send(llm, new, "lost", fail_after=3)
    assert llm.weight_checksums() == checksums and llm.not_serving is None
    assert _tokens(llm) == before and llm.get_weight_version() == "default"


def test_abandon_by_hand(qwen3_dir, qwen3_alt_dir, make_llm) -> None:
    new = load_file(str(qwen3_alt_dir / "model.safetensors"))
    llm = _engine(make_llm, qwen3_dir)
    before, checksums = _tokens(llm), llm.weight_checksums()
    with pytest.raises(RuntimeError, match="no weight update in progress"):
        llm.abandon_weight_update()
    llm.start_weight_update()
    assert llm.abandon_weight_update() == "unchanged"
    llm.start_weight_update()
    send(llm, dict(sorted(new.items())[:2]), "part")
    with pytest.raises(RuntimeError, match="already in progress; .*abandon"):
        llm.start_weight_update()
    assert llm.abandon_weight_update() == "incomplete"
    with pytest.raises(RequestRefusedError, match="abandoned by hand"):
        _tokens(llm)
    llm.load_weights(load_file(str(qwen3_dir / "model.safetensors")).items())  # a reload fills them too
    assert llm.not_serving is None and llm.weight_checksums() == checksums and _tokens(llm) == before
