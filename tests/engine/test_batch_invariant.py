"""Batch-invariant mode: a request's tokens and logprobs do not depend on what else the engine runs or on how its
prompt is split into steps, and they equal the trainer-side forward of rlserve.rl.train_forward bit for bit."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch
from safetensors.torch import load_file

from rlserve import SamplingParams, WeightTransferConfig
from rlserve.dtypes import dtype_name
from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.rl.train_forward import load_training_model
from rlserve.rl.trainer_logprobs import trainer_logprobs
from rlserve.weight_transfer import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

TEMPERATURE = 0.7
TARGET = list(range(30, 57))  # 27 tokens: one full block of 16 and a partial one
OTHERS = [list(range(100 + i, 100 + i + n)) for i, n in enumerate((5, 40, 12, 3, 33, 18, 9, 26, 1, 47))]


def params(seed: int, max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=max_tokens, logprobs=0, ignore_eos=True)


def token_logprobs(sample) -> list[float]:
    return [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)]


def run(llm, generate, prompts: list[list[int]], seeds: list[int]) -> list[tuple[list[int], list[float]]]:
    outputs = generate(llm, [{"prompt_token_ids": p} for p in prompts], [params(s) for s in seeds])
    return [(list(out.outputs[0].token_ids), token_logprobs(out.outputs[0])) for out in outputs]


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
    assert llm.stats()["prefix_cache_hits"] > 0
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


@pytest.mark.usefixtures("model_names_as_dirs")
def test_cli_flag_reaches_the_engine_config() -> None:
    from rlserve.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "model-dir", "--batch-invariant"])
    assert engine_kwargs(args)["batch_invariant"] is True
    assert "batch_invariant" not in engine_kwargs(build_parser().parse_args(["serve", "model-dir"]))


def test_continuation_after_a_live_update_equals_a_fresh_engine_on_the_new_weights(
    qwen3_dir, qwen3_alt_dir, make_llm
) -> None:
    """vLLM's rlhf_async_new_apis check, exact: requests paused (keep, clear_cache) mid-generation, weights replaced
    over the native API (nccl backend, gloo on CPU), resumed; what each generates after the update, tokens and logprob
    bits, equals a fresh engine on the new weights fed the prompt plus the tokens generated before the pause."""
    new = load_file(str(qwen3_alt_dir / "model.safetensors"))
    names = sorted(new)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, logprobs=0, ignore_eos=True)
    prompts = [TARGET, *OTHERS[:3]]
    engine = AsyncLLM(
        str(qwen3_dir), batch_invariant=True, logprobs_mode="processed_logprobs", num_kv_blocks=256,
        weight_transfer_config=WeightTransferConfig(backend="nccl"),
    )  # fmt: skip

    async def run() -> list:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        _, group = await asyncio.gather(
            engine.init_weight_transfer_engine({"init_info": init}),
            asyncio.to_thread(NCCLWeightTransferEngine.trainer_init, {**init, "timeout_s": 60}),
        )
        latest: dict[int, object] = {}

        async def consume(i: int) -> None:
            async for out in engine.generate({"prompt_token_ids": prompts[i]}, greedy, request_id=f"r{i}"):
                latest[i] = out

        tasks = [asyncio.create_task(consume(i)) for i in range(len(prompts))]
        while len(latest) < len(prompts) or min(len(o.outputs[0].token_ids) for o in latest.values()) < 5:
            await asyncio.sleep(0.005)
        await engine.pause_generation(mode="keep", clear_cache=True)
        await engine.start_weight_update()
        update_info = {
            "names": names,
            "dtype_names": [dtype_name(new[n].dtype) for n in names],
            "shapes": [list(new[n].shape) for n in names],
        }
        send = NCCLWeightTransferEngine.trainer_send_weights
        await asyncio.gather(
            engine.update_weights({"update_info": update_info}),
            asyncio.to_thread(send, ((n, new[n]) for n in names), NCCLTrainerSendWeightsArgs(group=group)),
        )
        await engine.finish_weight_update(weight_version="new")
        await engine.resume_generation()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        group.shutdown()
        return [latest[i].outputs[0] for i in range(len(prompts))]

    try:
        samples = asyncio.run(run())
    finally:
        engine.shutdown()
    fresh = make(make_llm, qwen3_alt_dir)
    for prompt, sample in zip(prompts, samples, strict=True):
        switch = sample.weight_versions.index("new")
        assert 0 < switch < len(sample.token_ids)
        assert sample.weight_versions[switch:] == ["new"] * (len(sample.token_ids) - switch)
        tokens, logprobs = sample.token_ids, token_logprobs(sample)
        params = SamplingParams(temperature=0.0, max_tokens=len(tokens) - switch, logprobs=0, ignore_eos=True)
        (out,) = fresh.generate([{"prompt_token_ids": prompt + tokens[:switch]}], params, use_tqdm=False)
        again = out.outputs[0]
        assert again.token_ids == tokens[switch:]
        assert token_logprobs(again) == logprobs[switch:]


def test_one_trainer_forward_gives_the_engine_bits_and_the_regular_gradients(qwen3_dir, make_llm, generate) -> None:
    llm = make(make_llm, qwen3_dir)
    prompts = [TARGET, *OTHERS[:3]]
    results = run(llm, generate, prompts, list(range(len(prompts))))
    completions = [tokens for tokens, _ in results]
    exact_model = load_training_model(qwen3_dir, batch_invariant=True)
    exact = trainer_logprobs(exact_model, prompts, completions, temperature=TEMPERATURE, processed=True)
    for (_, engine_logprobs), values in zip(results, exact, strict=True):
        assert values.requires_grad and engine_logprobs == values.tolist()
    regular_model = load_training_model(qwen3_dir)
    regular = trainer_logprobs(regular_model, prompts, completions, temperature=TEMPERATURE, processed=True)
    # The regular forward is close to the engine but not bit-equal: what the batch-invariant forward buys.
    assert any(e != r.tolist() for (_, e), r in zip(results, regular, strict=True))
    for values in (exact, regular):
        torch.stack([v.sum() for v in values]).sum().backward()
    for (name, p), q in zip(exact_model.named_parameters(), regular_model.parameters(), strict=True):
        # The same function's gradients at values ~1e-7 apart: ~1e-6 relative in fp32.
        assert q.grad.norm() > 0 and (p.grad - q.grad).norm() <= 1e-5 * q.grad.norm(), name


def test_top_k_top_p_logprobs_equal_the_trainer_forward_too(make_llm, generate, model_dirs) -> None:
    model_dir = model_dirs["qwen3"]
    llm = make(make_llm, model_dir)
    prompts = [TARGET, *OTHERS[:4]]
    sampling = [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=s, max_tokens=16, logprobs=0, ignore_eos=True)
        for s in range(len(prompts))
    ]
    outputs = generate(llm, [{"prompt_token_ids": p} for p in prompts], sampling)
    alone = generate(llm, [{"prompt_token_ids": prompts[2]}], [sampling[2]])[0].outputs[0]
    assert alone.token_ids == outputs[2].outputs[0].token_ids and token_logprobs(alone) == token_logprobs(
        outputs[2].outputs[0]
    )
    trainer = load_training_model(model_dir, batch_invariant=True)
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    mine = trainer_logprobs(trainer, prompts, completions, temperature=0.9, top_k=20, top_p=0.8, processed=True)
    for out, values in zip(outputs, mine, strict=True):
        assert token_logprobs(out.outputs[0]) == values.tolist()


def test_prompt_logprobs_do_not_depend_on_the_batch_or_chunking(make_llm, generate, model_dirs) -> None:
    """Prompt logprobs (raw, at every prompt position) of a request alone, in a batch, and chunked: the same bits,
    equal to the trainer forward's log_softmax over the prompt."""
    model_dir = model_dirs["qwen3"]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)

    def prompt_values(outputs, i) -> list[float]:
        out = outputs[i]
        return [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], TARGET[1:], strict=True)]

    llm = make_llm(model_dir, batch_invariant=True)
    alone = prompt_values(generate(llm, [{"prompt_token_ids": TARGET}], params), 0)
    batch = [{"prompt_token_ids": p} for p in [*OTHERS[:3], TARGET]]
    assert prompt_values(generate(llm, batch, params), 3) == alone
    chunked_llm = make_llm(model_dir, batch_invariant=True, max_num_batched_tokens=8)
    assert prompt_values(generate(chunked_llm, batch, params), 3) == alone
    trainer = load_training_model(model_dir, batch_invariant=True)
    (mine,) = trainer_logprobs(trainer, [TARGET[:1]], [TARGET[1:]])
    assert mine.tolist() == alone


@pytest.mark.usefixtures("model_names_as_dirs")
def test_vllm_environment_switch_turns_it_on(monkeypatch) -> None:
    from rlserve.engine.frontend.llm import make_engine_config

    assert not make_engine_config("m").batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert make_engine_config("m").batch_invariant
    assert not make_engine_config("m", batch_invariant=False).batch_invariant  # an explicit argument wins
