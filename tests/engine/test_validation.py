"""Bad input fails fast with a ValueError naming the offending field, and leaves the engine fully usable."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from rlserve import LLM, RequestOutput, SamplingParams
from rlserve.engine.frontend.async_llm import AsyncLLM

MAX_MODEL_LEN = 64
GOOD = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


# Function scope on purpose: an engine left broken by one bad request must not fail the tests after it.
@pytest.fixture
def llm(qwen3_dir, make_llm) -> LLM:
    return make_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, max_logprobs=5)


@pytest.fixture
def good_tokens(llm, generate) -> list[int]:
    (out,) = generate(llm, "good", GOOD)
    return out.outputs[0].token_ids


def assert_nothing_in_flight(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0


def assert_still_serves(llm: LLM, generate, good_tokens: list[int]) -> None:
    (out,) = generate(llm, "good", GOOD)
    assert out.outputs[0].token_ids == good_tokens
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt,field",
    [
        ("", "prompt"),
        ({"prompt_token_ids": []}, "prompt"),
        ("x" * MAX_MODEL_LEN, "prompt"),
        ("x" * (MAX_MODEL_LEN + 40), "prompt"),
        ({"prompt_token_ids": [1, 2, 10_000]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -1, 2]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 259]}, "prompt_token_ids"),  # == vocab size: one past the last id
        ({"prompt_token_ids": "1 2 3"}, "prompt_token_ids"),
        ({"text": "no known key"}, "prompt"),
    ],
    ids=["empty", "empty-ids", "at-max-len", "over-max-len", "id-huge", "id-negative", "id-vocab", "ids-str", "dict"],
)
def test_bad_prompt(llm, generate, good_tokens, prompt: Any, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        llm.generate([prompt], GOOD, use_tqdm=False)
    assert_still_serves(llm, generate, good_tokens)


def test_bad_prompt_in_a_batch_queues_nothing(llm, generate, good_tokens) -> None:
    """Validation covers the whole batch before anything is queued: the good prompts of a failed call do not leak."""
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(["fine", "also fine", {"prompt_token_ids": [999]}], GOOD, use_tqdm=False)
    assert_nothing_in_flight(llm)
    assert_still_serves(llm, generate, good_tokens)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        # Non-finite numbers: NaN passes a plain comparison, so each range must fail for it.
        *[({name: v}, name) for name in ("temperature", "top_p", "min_p") for v in (math.nan, math.inf)],
        *[({name: v}, name) for name in ("presence_penalty", "frequency_penalty") for v in (math.nan, -math.inf)],
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"logit_bias": {1: math.inf}}, "logit_bias"),
    ],
)
def test_bad_sampling_params(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"logprobs": 6}, "logprobs"),
        ({"prompt_logprobs": 6}, "prompt_logprobs"),
        ({"stop_token_ids": [259]}, "stop_token_ids"),
    ],
)
def test_bad_params_for_this_engine(llm, generate, good_tokens, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        llm.generate("fine", SamplingParams(max_tokens=4, **kwargs), use_tqdm=False)
    assert_still_serves(llm, generate, good_tokens)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_outside_64_bits_is_named(llm, seed: int) -> None:
    with pytest.raises(ValueError, match=r"\bseed\b"):
        llm.generate("bad seed", SamplingParams(temperature=1.0, max_tokens=4, seed=seed), use_tqdm=False)


def test_seed_outside_64_bits_leaves_engine_clean(llm, generate, good_tokens) -> None:
    """A seed torch cannot take is refused when the params are made, naming the field; the engine keeps serving."""
    with pytest.raises(ValueError, match="seed"):
        llm.generate(["fine", "bad seed"], [GOOD, SamplingParams(temperature=1.0, max_tokens=4, seed=2**64)])
    assert_nothing_in_flight(llm)
    assert_still_serves(llm, generate, good_tokens)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_above_vocab_size(qwen3_dir, make_llm, generate, field: str) -> None:
    """With max_logprobs above the vocabulary, k > vocab must be refused (or clamped), never crash the step."""
    llm = make_llm(qwen3_dir, max_logprobs=1000)
    vocab = llm.limits.vocab_size
    try:
        outputs = llm.generate("hi", SamplingParams(max_tokens=2, **{field: vocab + 1}), use_tqdm=False)
    except ValueError as error:
        assert field in str(error)
    else:
        entries = outputs[0].outputs[0].logprobs if field == "logprobs" else outputs[0].prompt_logprobs[1:]
        assert all(len(entry) <= vocab for entry in entries)
    assert_nothing_in_flight(llm)
    (out,) = generate(llm, "hi", SamplingParams(temperature=0.0, max_tokens=2, **{field: vocab}))
    entries = out.outputs[0].logprobs if field == "logprobs" else out.prompt_logprobs[1:]
    assert all(len(entry) == vocab for entry in entries)


def test_logprobs_at_max_logprobs_is_accepted(llm, generate) -> None:
    (out,) = generate(llm, "fine", SamplingParams(temperature=0.0, max_tokens=2, logprobs=5, prompt_logprobs=5))
    assert all(len(entry) in (5, 6) for entry in out.outputs[0].logprobs)


def test_sampling_params_count_mismatch(llm, generate, good_tokens) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GOOD], use_tqdm=False)
    assert_still_serves(llm, generate, good_tokens)


# ---- engine construction ----


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"logprobs_mode": "softmax"}, "logprobs_mode"),
        ({"dtype": "float64"}, "dtype"),
        ({"lm_head_dtype": "float16"}, "lm_head_dtype"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"not_an_engine_arg": 1}, "not_an_engine_arg"),
    ],
)
def test_bad_engine_arguments(qwen3_dir, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LLM(str(qwen3_dir), num_kv_blocks=kwargs.pop("num_kv_blocks", 64), **kwargs)


def test_kv_cache_too_small_for_max_model_len(qwen3_dir) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(qwen3_dir), block_size=4, num_kv_blocks=4, max_model_len=64)


def test_missing_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "does-not-exist"))


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        LLM(str(tmp_path))
    assert "architecture" in str(info.value)


def test_unsupported_architecture_without_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path))


def test_engine_still_builds_after_failures(qwen3_dir, make_llm, generate, hf) -> None:
    llm = make_llm(qwen3_dir)
    (out,) = generate(llm, "after", GOOD)
    assert out.outputs[0].token_ids == hf.greedy(qwen3_dir, out.prompt_token_ids, 4)


def test_directory_without_weights(qwen3_dir, tmp_path: Path) -> None:
    shutil.copy(qwen3_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path))


def test_checkpoint_missing_a_tensor(qwen3_dir, tmp_path: Path) -> None:
    path = tmp_path / "partial"
    shutil.copytree(qwen3_dir, path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="up_proj"):
        LLM(str(path))


def count_checks(engine: LLM | AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The prompts the engine's one request check (its front end's limits, checked before anything reaches the
    core) sees, in order."""
    checked: list[list[int]] = []
    limits = engine.limits

    class CountingLimits:
        def __getattr__(self, name: str) -> Any:
            return getattr(limits, name)

        def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
            checked.append(prompt_token_ids)
            limits.check(prompt_token_ids, params)

    monkeypatch.setattr(engine, "limits", CountingLimits())
    return checked


def test_each_prompt_is_checked_once(llm, generate, monkeypatch) -> None:
    checked = count_checks(llm, monkeypatch)
    generate(llm, ["one", "two"], SamplingParams(n=2, max_tokens=2))
    assert len(checked) == 2


def test_async_engine_checks_once_and_names_the_field(qwen3_dir, monkeypatch) -> None:
    engine = AsyncLLM(str(qwen3_dir), num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    checked = count_checks(engine, monkeypatch)

    async def outputs(prompt: Any, params: SamplingParams | None = None) -> list[RequestOutput]:
        return [out async for out in engine.generate(prompt, params)]

    async def scenario() -> None:  # one event loop: AsyncLLM binds to the first it runs on
        assert engine.max_model_len == MAX_MODEL_LEN
        assert engine.worker_extension_methods() == set()
        with pytest.raises(ValueError, match=r"^prompt_token_ids\b"):
            engine.validate_prompt({"prompt_token_ids": [1, 10_000]}, GOOD)
        validated = engine.validate_prompt("fine", GOOD)
        assert validated.token_ids and validated.params is GOOD
        assert (await outputs(validated))[-1].finished
        assert len(checked) == 2  # validate_prompt's; generate did not check the validated prompt again
        with pytest.raises(ValueError, match=r"^sampling_params\b"):
            await outputs(validated, SamplingParams(max_tokens=3))
        await outputs("also fine", GOOD)
        assert len(checked) == 3

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kwargs", [{"mode": "later"}, {"mode": "sometimes", "wait_for_inflight_requests": False}])
def test_bad_pause_mode_is_named_and_changes_nothing(qwen3_dir, kwargs: dict[str, Any]) -> None:
    engine = AsyncLLM(str(qwen3_dir), num_kv_blocks=64)

    async def scenario() -> None:
        with pytest.raises(ValueError, match=r"^mode: pause mode must be one of \['abort', 'wait', 'keep'\]"):
            await engine.pause_generation(**kwargs)
        assert not await engine.is_paused()
        # vLLM's deprecated spelling of mode="wait" (nothing in flight: it returns at once).
        await engine.pause_generation(wait_for_inflight_requests=True)
        assert await engine.is_paused()

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
