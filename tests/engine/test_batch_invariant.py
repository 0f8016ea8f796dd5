"""Batch-invariant mode: a request's tokens and logprobs do not depend on what else the engine runs or on how its
prompt is split into steps, and they equal the trainer-side forward of rlserve.rl.train_forward bit for bit."""

from __future__ import annotations

import pytest

from rlserve import SamplingParams
from rlserve.rl.parity import trainer_logprobs
from rlserve.rl.train_forward import load_training_model

TEMPERATURE = 0.7
TARGET = list(range(30, 57))  # 27 tokens: one full block of 16 and a partial one
OTHERS = [list(range(100 + i, 100 + i + n)) for i, n in enumerate((5, 40, 12, 3, 33, 18, 9, 26, 1, 47))]


def params(seed: int, max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=max_tokens, logprobs=0, ignore_eos=True)


def run(llm, generate, prompts: list[list[int]], seeds: list[int]) -> list[tuple[list[int], list[float]]]:
    outputs = generate(llm, [{"prompt_token_ids": p} for p in prompts], [params(s) for s in seeds])
    results = []
    for out in outputs:
        sample = out.outputs[0]
        logprobs = [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)]
        results.append((list(sample.token_ids), logprobs))
    return results


@pytest.fixture(params=["qwen3", "llama"])
def model_dir(request, model_dirs):
    return model_dirs[request.param]


def make(make_llm, model_dir, **kwargs):
    return make_llm(model_dir, batch_invariant=True, logprobs_mode="processed_logprobs", **kwargs)


def test_a_request_gives_the_same_bits_alone_in_a_batch_chunked_and_from_the_prefix_cache(
    model_dir, make_llm, generate
) -> None:
    llm = make(make_llm, model_dir)
    alone = run(llm, generate, [TARGET], [7])[0]
    # In a batch of requests of other lengths, in the middle of it (prefill and decode rows of other requests
    # around it, different batch sizes at every step as the others finish).
    batch = OTHERS[:5] + [TARGET] + OTHERS[5:]
    in_batch = run(llm, generate, batch, [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12])[5]
    assert in_batch == alone
    # Again: its full prompt blocks now come from the prefix cache, only the rest is computed.
    cached = run(llm, generate, [TARGET], [7])[0]
    assert cached == alone
    assert llm.engine_core.kv_cache.prefix_hits > 0
    # A budget of 8 tokens per step: the prompt is computed in chunks, mixed with other requests' decode rows.
    chunked_llm = make(make_llm, model_dir, max_num_batched_tokens=8, enable_prefix_caching=False)
    chunked = run(chunked_llm, generate, OTHERS[:3] + [TARGET], [1, 2, 3, 7])[3]
    assert chunked == alone


def test_logprobs_equal_the_trainer_forward_bit_for_bit(model_dir, make_llm, generate) -> None:
    llm = make(make_llm, model_dir)
    prompts = [TARGET, *OTHERS[:5]]
    results = run(llm, generate, prompts, list(range(len(prompts))))
    trainer = load_training_model(model_dir, batch_invariant=True)
    completions = [tokens for tokens, _ in results]
    mine = trainer_logprobs(trainer, prompts, completions, temperature=TEMPERATURE, processed=True)
    for (_, engine_logprobs), trainer_values in zip(results, mine, strict=True):
        assert engine_logprobs == trainer_values.tolist()


def test_the_batch_invariant_trainer_forward_has_no_gradients(model_dirs) -> None:
    trainer = load_training_model(model_dirs["qwen3"], batch_invariant=True)
    assert not any(p.requires_grad for p in trainer.parameters())
    (values,) = trainer_logprobs(trainer, [TARGET], [[1, 2, 3]])
    assert not values.requires_grad


def test_cli_flag_reaches_the_engine_config() -> None:
    from rlserve.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "model-dir", "--batch-invariant"])
    assert engine_kwargs(args)["batch_invariant"] is True
    assert engine_kwargs(build_parser().parse_args(["serve", "model-dir"]))["batch_invariant"] is False
