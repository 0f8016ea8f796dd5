"""Dummy start (vLLM's load_format="dummy"): an engine starts with random weights of the right shapes and reads no
checkpoint, so that a trainer can start it at once and push the real weights first; vLLM's
skip_loading_weights_in_engine_init flow (update_config to "auto", then reload_weights) reads the checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rlserve import SamplingParams
from rlserve.model.loader import DUMMY_WEIGHTS_RANGE, iterate_checkpoint

PROMPTS = [{"prompt_token_ids": [5, 17, 200, 33]}, {"prompt_token_ids": list(range(40, 60))}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
TO_AUTO = ({"load_config": {"load_format": "auto"}},)


def tokens_and_logprobs(outputs) -> tuple[list, list]:
    samples = [o.outputs[0] for o in outputs]
    values = [lp[t].logprob for s in samples for lp, t in zip(s.logprobs, s.token_ids, strict=True)]
    return [s.token_ids for s in samples], values


@pytest.fixture(scope="module")
def expected(qwen3_dir, make_llm, generate) -> tuple[list, list]:
    llm = make_llm(qwen3_dir)
    try:
        return tokens_and_logprobs(generate(llm, PROMPTS, GREEDY))
    finally:
        llm.shutdown()


def test_dummy_start_reads_no_checkpoint_and_one_full_update_equals_it(
    qwen3_dir, tmp_path: Path, make_llm, generate, expected
) -> None:
    """The model directory has no weights at all (config and tokenizer only): the dummy engine starts, its weights
    are small uniform values, and after one update of every tensor it answers as the checkpoint's engine does."""
    config_only = tmp_path / "config-only"
    shutil.copytree(qwen3_dir, config_only, ignore=shutil.ignore_patterns("*.safetensors*"))
    with pytest.raises(ValueError, match="holds no .safetensors weights"):
        make_llm(config_only, in_process=True)
    llm = make_llm(config_only, in_process=True, load_format="dummy")  # in process: its weights are read below
    weights = list(llm.engine_core.runner.model.parameters())
    assert all(0 < w.abs().max() <= DUMMY_WEIGHTS_RANGE for w in weights)
    assert tokens_and_logprobs(generate(llm, PROMPTS, GREEDY))[0] != expected[0]

    llm.load_weights(iterate_checkpoint(str(qwen3_dir)))
    tokens, logprobs = tokens_and_logprobs(generate(llm, PROMPTS, GREEDY))
    assert tokens == expected[0]
    assert logprobs == pytest.approx(expected[1], abs=1e-5)


def test_update_config_then_reload_weights_reads_the_checkpoint(qwen3_dir, make_llm, generate, expected) -> None:
    """vLLM's example, with the core in its own process (the calls travel by name, their arguments as data)."""
    llm = make_llm(qwen3_dir, load_format="dummy")
    assert tokens_and_logprobs(generate(llm, PROMPTS, GREEDY))[0] != expected[0]
    with pytest.raises(ValueError, match=r"load_format: the engine's load format is 'dummy'.*update_config"):
        llm.collective_rpc("reload_weights")
    for bad, field in (
        ({"model_config": {"model": "elsewhere"}}, r"model_config\.model cannot be updated"),
        ({"load_config": {"load_format": "pt"}}, r"load_format must be one of \['auto', 'safetensors', 'dummy'\]"),
        ({"load_config": "auto"}, "expected"),
    ):
        with pytest.raises(ValueError, match=rf"^overrides: .*{field}"):
            llm.collective_rpc("update_config", args=(bad,))
    assert llm.collective_rpc("update_config", args=TO_AUTO) == [None]
    assert llm.collective_rpc("reload_weights") == [None]
    tokens, logprobs = tokens_and_logprobs(generate(llm, PROMPTS, GREEDY))
    assert tokens == expected[0]
    assert logprobs == pytest.approx(expected[1], abs=1e-5)
    with pytest.raises(ValueError, match="weights_path: cannot read safetensors weights"):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(qwen3_dir / "nowhere")})
