"""Why and where generation stops: EOS, stop token ids, stop strings, min_tokens, max_tokens and max_model_len.

The toy tokenizer is byte-level, so each output token is one byte: stop strings are picked from the text of a first
greedy run (printable ASCII bytes the run had not produced before), which makes the expected cut exact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlserve import SamplingParams
from rlserve.toy import make_tokenizer

PROMPT = "Hello, world!"
N = 24


def greedy(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", N)
    return SamplingParams(temperature=0.0, **kwargs)


def first_new_token_at(token_ids: list[int], start: int) -> int:
    """Index (>= start) of the first token that does not occur earlier in the list."""
    for j in range(start, len(token_ids)):
        if token_ids[j] not in token_ids[:j]:
            return j
    raise AssertionError(f"no fresh token from position {start} in {token_ids}")


def fresh_ascii_stop(tokenizer, token_ids: list[int], length: int, start: int = 2) -> tuple[str, int]:
    """A stop string of `length` printable ASCII bytes generated at positions j-length+1..j, new to the text there.

    Returns (stop string, j): j is the output position whose token completes the stop string.
    """
    chars = [tokenizer.decode([t]) for t in token_ids]
    for j in range(start + length - 1, len(token_ids)):
        piece = chars[j - length + 1 : j + 1]
        if all(len(c) == 1 and c.isascii() and c.isprintable() and not c.isspace() for c in piece):
            stop = "".join(piece)
            if stop not in tokenizer.decode(token_ids[:j]):
                return stop, j
    raise AssertionError(f"no usable stop string of length {length} in {chars}")


@pytest.fixture(scope="module")
def baseline(qwen3_dir, make_llm, generate):
    """The LLM and its unconstrained greedy run of PROMPT: (llm, token ids, text)."""
    llm = make_llm(qwen3_dir)
    (out,) = generate(llm, PROMPT, greedy(ignore_eos=True))
    completion = out.outputs[0]
    assert len(completion.token_ids) == N
    return llm, completion.token_ids, completion.text


@pytest.fixture(scope="module")
def eos_model(qwen3_dir, hf, tmp_path_factory) -> tuple[Path, int, int]:
    """qwen3_dir with the EOS id set to a token its greedy run of PROMPT emits first at output position j >= 3.

    Returns (directory, eos id, j).
    """
    generated = hf.greedy(qwen3_dir, make_tokenizer()(PROMPT).input_ids, N)
    j = first_new_token_at(generated, 3)
    eos = generated[j]
    path = tmp_path_factory.mktemp("eos") / "qwen3-eos"
    shutil.copytree(qwen3_dir, path)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((path / name).read_text())
        data["eos_token_id"] = eos
        (path / name).write_text(json.dumps(data))
    return path, eos, j


# ---- EOS ----


def test_eos_stops_with_no_stop_reason(eos_model, make_llm, generate, hf) -> None:
    path, eos, j = eos_model
    (out,) = generate(make_llm(path), PROMPT, greedy())
    completion = out.outputs[0]
    assert completion.token_ids == hf.greedy(path, out.prompt_token_ids, N, eos_token_id=eos)
    assert len(completion.token_ids) == j + 1 and completion.token_ids[-1] == eos
    assert completion.finish_reason == "stop"
    assert completion.stop_reason is None


def test_ignore_eos_runs_to_max_tokens(eos_model, make_llm, generate, hf) -> None:
    path, eos, j = eos_model
    (out,) = generate(make_llm(path), PROMPT, greedy(ignore_eos=True))
    completion = out.outputs[0]
    assert completion.token_ids == hf.greedy(path, out.prompt_token_ids, N)
    assert completion.token_ids[j] == eos
    assert completion.finish_reason == "length"


def test_min_tokens_suppresses_eos(eos_model, make_llm, generate, hf) -> None:
    path, eos, j = eos_model
    min_tokens = j + 3
    (out,) = generate(make_llm(path), PROMPT, greedy(min_tokens=min_tokens))
    completion = out.outputs[0]
    expected = hf.greedy(path, out.prompt_token_ids, N, eos_token_id=eos, min_new_tokens=min_tokens)
    assert completion.token_ids == expected
    assert len(completion.token_ids) >= min_tokens
    assert eos not in completion.token_ids[:min_tokens]
    if len(expected) < N:
        assert completion.token_ids[-1] == eos and completion.finish_reason == "stop"
    else:
        assert completion.finish_reason == "length"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_listed_in_stop_token_ids_reports_it(eos_model, ignore_eos, make_llm, generate) -> None:
    """ignore_eos ignores only the model's EOS; the same id listed in stop_token_ids still stops."""
    path, eos, j = eos_model
    (out,) = generate(make_llm(path), PROMPT, greedy(stop_token_ids=[eos], ignore_eos=ignore_eos))
    completion = out.outputs[0]
    assert len(completion.token_ids) == j + 1
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == eos


# ---- stop token ids ----


def test_stop_token_ids(baseline, generate) -> None:
    llm, full, _ = baseline
    j = first_new_token_at(full, 2)
    (out,) = generate(llm, PROMPT, greedy(stop_token_ids=[full[j], 258], ignore_eos=True))
    completion = out.outputs[0]
    assert completion.token_ids == full[: j + 1]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == full[j]


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_follows_include_stop_str_in_output(baseline, generate, include) -> None:
    """vLLM renders the token that stopped a request (stop_token_ids or EOS) into the text only with
    include_stop_str_in_output; token_ids always keep it."""
    llm, full, full_text = baseline
    char, j = fresh_ascii_stop(llm.get_tokenizer(), full, 1)
    params = greedy(stop_token_ids=[full[j]], include_stop_str_in_output=include, ignore_eos=True)
    (out,) = generate(llm, PROMPT, params)
    completion = out.outputs[0]
    assert completion.token_ids == full[: j + 1]
    assert completion.text == full_text[: full_text.index(char) + (1 if include else 0)]


def test_min_tokens_suppresses_stop_token_ids(baseline, generate, hf, qwen3_dir) -> None:
    llm, full, _ = baseline
    j = first_new_token_at(full, 2)
    stop_id, eos = full[j], llm.get_tokenizer().eos_token_id
    (out,) = generate(llm, PROMPT, greedy(stop_token_ids=[stop_id], min_tokens=j + 2))
    completion = out.outputs[0]
    expected = hf.greedy(qwen3_dir, out.prompt_token_ids, N, eos_token_id=[stop_id, eos], min_new_tokens=j + 2)
    assert completion.token_ids == expected
    assert stop_id not in completion.token_ids[: j + 2]


# ---- stop strings ----


@pytest.mark.parametrize("length", [1, 2])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_text(baseline, generate, length, include) -> None:
    llm, full, full_text = baseline
    stop, j = fresh_ascii_stop(llm.get_tokenizer(), full, length)
    params = greedy(stop=["never-generated", stop], include_stop_str_in_output=include, ignore_eos=True)
    (out,) = generate(llm, PROMPT, params)
    completion = out.outputs[0]
    cut = full_text.index(stop) + (len(stop) if include else 0)
    assert completion.text == full_text[:cut]
    assert completion.token_ids == full[: j + 1]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop
    assert (stop in completion.text) is include


def test_stop_string_with_n_seeded_samples(qwen3_dir, make_llm, generate) -> None:
    """Each sample stops at its own first occurrence; samples without one run to max_tokens."""
    llm = make_llm(qwen3_dir)
    params = dict(n=6, temperature=1.0, seed=77, max_tokens=N, ignore_eos=True)
    (free,) = generate(llm, PROMPT, SamplingParams(**params))
    # The commonest printable byte across samples, so that some samples hit it and maybe some do not.
    counts: dict[str, int] = {}
    for c in free.outputs:
        for ch in set(c.text):
            if ch.isascii() and ch.isprintable():
                counts[ch] = counts.get(ch, 0) + 1
    stop = max(counts, key=counts.get)
    (out,) = generate(llm, PROMPT, SamplingParams(**params, stop=stop))
    hits = 0
    for unconstrained, completion in zip(free.outputs, out.outputs, strict=True):
        if stop in unconstrained.text:
            hits += 1
            assert completion.text == unconstrained.text[: unconstrained.text.index(stop)]
            assert completion.finish_reason == "stop" and completion.stop_reason == stop
            assert completion.token_ids == unconstrained.token_ids[: len(completion.token_ids)]
        else:
            assert completion.token_ids == unconstrained.token_ids
            assert completion.finish_reason == "length" and completion.stop_reason is None
    assert hits > 0


def test_text_does_not_depend_on_stop_strings_being_set(qwen3_dir, make_llm, generate) -> None:
    """A stop string that never matches must not change the text. Random bytes often end inside a UTF-8 sequence, so
    this compares how both code paths (with and without stop strings) render an incomplete trailing character."""
    llm = make_llm(qwen3_dir)
    prompts = [f"text {i}" for i in range(12)]
    params = dict(temperature=1.0, seed=5, max_tokens=N, ignore_eos=True)
    plain = generate(llm, prompts, SamplingParams(**params))
    with_stop = generate(llm, prompts, SamplingParams(**params, stop=["never generated"]))
    for a, b in zip(plain, with_stop, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text


# ---- length limits ----


def test_max_tokens_finishes_with_length(baseline, generate) -> None:
    llm, full, _ = baseline
    (out,) = generate(llm, PROMPT, greedy(max_tokens=5, ignore_eos=True))
    assert out.outputs[0].token_ids == full[:5]
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].stop_reason is None


@pytest.mark.parametrize("max_tokens", [None, 100, 19])
def test_max_model_len_caps_output(qwen3_dir, max_tokens, make_llm, generate, hf) -> None:
    llm = make_llm(qwen3_dir, max_model_len=32)
    (out,) = generate(llm, PROMPT, greedy(max_tokens=max_tokens, ignore_eos=True))
    budget = 32 - len(out.prompt_token_ids)
    assert budget == 19
    assert out.outputs[0].token_ids == hf.greedy(qwen3_dir, out.prompt_token_ids, budget)
    assert out.outputs[0].finish_reason == "length"


def test_prompt_one_short_of_max_model_len_gets_one_token(qwen3_dir, make_llm, generate, hf) -> None:
    llm = make_llm(qwen3_dir, max_model_len=32)
    ids = list(range(65, 65 + 31))
    (out,) = generate(llm, {"prompt_token_ids": ids}, greedy(ignore_eos=True))
    assert out.outputs[0].token_ids == hf.greedy(qwen3_dir, ids, 1)
    assert out.outputs[0].finish_reason == "length"
