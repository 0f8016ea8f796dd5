"""A weight update that fails during its transfer (after validation, with some tensors written): the engine will not
finish the update or resume generation on weights that are neither old nor new, until the tensors are sent again."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from safetensors.torch import load_file

from rlserve import SamplingParams, WeightTransferConfig
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
    fail_after: int = -1  # write this many tensors, then fail as a dropped connection would; -1: never


class BreakingEngine(WeightTransferEngine[WeightTransferInitInfo, DirectUpdateInfo]):
    init_info_cls = WeightTransferInitInfo
    update_info_cls = DirectUpdateInfo

    def init_transfer_engine(self, init_info: WeightTransferInitInfo) -> None:
        pass

    def receive_weights(self, update_info: DirectUpdateInfo, load_weights: LoadWeightsFn) -> None:
        tensors = OUTBOX.pop(update_info.update_id)
        if update_info.fail_after >= 0:
            load_weights(tensors[: update_info.fail_after])
            raise ConnectionError("the trainer went away mid-transfer")
        load_weights(tensors)

    def discard_weights(self, update_info: DirectUpdateInfo) -> None:
        OUTBOX.pop(update_info.update_id, None)

    def shutdown(self) -> None:
        pass


if BACKEND not in WeightTransferEngineFactory.available_engines():
    WeightTransferEngineFactory.register_engine(BACKEND, BreakingEngine)


def send(llm, weights: dict, update_id: str, fail_after: int = -1) -> None:
    names = sorted(weights)
    OUTBOX[update_id] = [(n, weights[n]) for n in names]
    info = {
        "names": names,
        "dtype_names": [str(weights[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(weights[n].shape) for n in names],
        "update_id": update_id,
        "fail_after": fail_after,
    }
    llm.update_weights({"update_info": info})


def test_a_transfer_that_breaks_blocks_finish_and_resume_until_resent(qwen3_dir, qwen3_alt_dir, make_llm) -> None:
    new = load_file(str(qwen3_alt_dir / "model.safetensors"))
    # In process: this test's backend is registered, and hands tensors over by reference, in this process only; and
    # the test pauses and resumes the core itself.
    llm = make_llm(qwen3_dir, in_process=True, weight_transfer_config=WeightTransferConfig(backend=BACKEND))
    llm.init_weight_transfer_engine({"init_info": {}})
    core = llm.engine_core
    core.pause("keep", clear_cache=True)
    llm.start_weight_update()
    with pytest.raises(ConnectionError):
        send(llm, new, "broken", fail_after=3)
    for operation in (lambda: llm.finish_weight_update("v1"), core.resume):
        with pytest.raises(RuntimeError, match="partly written; send them again"):
            operation()
    assert core.is_paused() and llm.get_weight_version() == "default"

    # Resending only some of the tensors is not enough; all of them is.
    some = dict(sorted(new.items())[:3])
    send(llm, some, "some")
    with pytest.raises(RuntimeError, match="partly written"):
        llm.finish_weight_update("v1")
    send(llm, new, "all")
    llm.finish_weight_update("v1")
    core.resume()
    fresh = make_llm(qwen3_alt_dir)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(5, 25))}]
    expected = fresh.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected
