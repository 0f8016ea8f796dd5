"""Qwen3-MoE end to end on CPU: greedy tokens and fp32 logprobs equal Hugging Face's, the routed experts the engine
returns equal the HF router's choices, weight updates by per-expert checkpoint names write in place (a refused one
changes nothing), and the MoE layer is batch-invariant in batch-invariant mode.

One tiny Qwen3-MoE (3 layers, the middle one dense through mlp_only_layers, 8 experts, top-2) serves every test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.model.loader import iterate_checkpoint
from rlserve.rl.train_forward import forward_hidden, load_training_model
from rlserve.toy import make_model_dir

INIT_RANGE = 0.2
NUM_LAYERS, DENSE_LAYER, TOP_K, NUM_EXPERTS = 3, 1, 2, 8
PROMPTS = [list(range(5, 22)), [30, 31, 32], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
MAX_TOKENS = 8


def make_moe_dir(path: Path, seed: int) -> Path:
    return make_model_dir(
        path,
        preset="tiny-moe",
        seed=seed,
        initializer_range=INIT_RANGE,
        num_hidden_layers=NUM_LAYERS,
        mlp_only_layers=[DENSE_LAYER],
    )


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_dir(tmp_path_factory.mktemp("moe") / "tiny-moe", seed=3)


@pytest.fixture(scope="module")
def moe_alt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_dir(tmp_path_factory.mktemp("moe-alt") / "tiny-moe", seed=4)


@pytest.fixture(scope="module")
def moe_llm(moe_dir: Path, make_llm):
    llm = make_llm(moe_dir, enable_return_routed_experts=True, num_kv_blocks=64)
    yield llm
    llm.shutdown()


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, **kwargs)


def sampled_logprobs(out) -> list[float]:
    return [position[token].logprob for position, token in zip(out.logprobs, out.token_ids, strict=True)]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, generate):
    return [o.outputs[0] for o in generate(llm, [{"prompt_token_ids": p} for p in prompts], params)]


@torch.inference_mode()
def hf_router_choices(hf_model, token_ids: list[int]) -> np.ndarray:
    """[tokens, layers, top_k] of the HF router's top-k (its output_router_logits); the dense layer's rows stay 0."""
    router_logits = hf_model(torch.tensor([token_ids]), output_router_logits=True).router_logits
    sparse = [i for i in range(NUM_LAYERS) if i != DENSE_LAYER]
    assert len(router_logits) == len(sparse)
    out = np.zeros((len(token_ids), NUM_LAYERS, TOP_K), dtype=np.uint8)
    for layer, logits in zip(sparse, router_logits, strict=True):
        out[:, layer] = torch.topk(logits.softmax(-1), TOP_K, dim=-1).indices.numpy()
    return out


def test_greedy_and_logprobs_equal_hugging_face(moe_llm, moe_dir, hf, generate) -> None:
    outputs = run(moe_llm, PROMPTS, greedy(), generate)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert list(out.token_ids) == hf.greedy(moe_dir, prompt, MAX_TOKENS)
        reference = hf.logits(moe_dir, prompt + list(out.token_ids)).log_softmax(-1)
        for i, (token, position) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert abs(position[token].logprob - float(reference[len(prompt) - 1 + i, token])) < 1e-5


def test_routed_experts_equal_the_hf_router(moe_llm, moe_dir, hf, generate) -> None:
    outputs = run(moe_llm, PROMPTS, greedy(), generate)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        routed = out.routed_experts
        # Every token but the last sampled one, which was never forwarded (vLLM's shape).
        assert routed.dtype == np.uint8 and routed.shape == (len(prompt) + MAX_TOKENS - 1, NUM_LAYERS, TOP_K)
        expected = hf_router_choices(hf.model(moe_dir), prompt + list(out.token_ids)[:-1])
        np.testing.assert_array_equal(routed, expected)
        assert (routed[:, DENSE_LAYER] == 0).all()


def test_routed_experts_of_cached_prefixes_and_prompt_start(moe_llm, generate) -> None:
    prompt = list(range(60, 60 + 40))  # two full KV blocks to reuse
    (first,) = run(moe_llm, [prompt], greedy(4), generate)
    outputs = generate(moe_llm, [{"prompt_token_ids": prompt}], greedy(4, routed_experts_prompt_start=10))
    assert outputs[0].num_cached_tokens >= 32  # served from the prefix cache: the routing comes from the slots
    np.testing.assert_array_equal(outputs[0].outputs[0].routed_experts, first.routed_experts[10:])
    with pytest.raises(ValueError, match="routed_experts_prompt_start"):
        moe_llm.generate([{"prompt_token_ids": [1, 2]}], greedy(routed_experts_prompt_start=3), use_tqdm=False)


def test_each_sample_has_its_routed_experts(moe_llm, generate) -> None:
    # Several samples of one prompt (n=2) each carry their own routing of the same prompt.
    outputs = generate(
        moe_llm, [{"prompt_token_ids": PROMPTS[1]}], SamplingParams(n=2, max_tokens=5, seed=1, ignore_eos=True)
    )
    a, b = outputs[0].outputs
    np.testing.assert_array_equal(a.routed_experts[: len(PROMPTS[1])], b.routed_experts[: len(PROMPTS[1])])
    assert a.routed_experts.shape[0] == b.routed_experts.shape[0] == len(PROMPTS[1]) + 4


def test_routed_experts_of_a_sample_ended_by_a_stop_string(moe_llm, generate) -> None:
    """The front end ends such a sample itself: the routing it returns came with the core's outputs step by step."""
    (full,) = run(moe_llm, [PROMPTS[2]], greedy(12), generate)
    texts = [moe_llm.get_tokenizer().decode([t]) for t in full.token_ids]
    stop_at = next(i for i in range(3, 10) if texts[i].strip() and texts[i] not in "".join(texts[:i]))
    (out,) = run(moe_llm, [PROMPTS[2]], greedy(12, stop=[texts[stop_at]]), generate)
    assert out.finish_reason == "stop" and list(out.token_ids) == list(full.token_ids[: stop_at + 1])
    np.testing.assert_array_equal(out.routed_experts, full.routed_experts[: len(PROMPTS[2]) + stop_at])


def test_in_place_update_equals_a_fresh_engine(moe_llm, moe_dir, moe_alt_dir, make_llm, generate, hf) -> None:
    moe_llm.reset_prefix_cache()  # as every update leaves it: the runs compared below all compute every prompt token
    before = run(moe_llm, PROMPTS, greedy(), generate)
    alt = list(iterate_checkpoint(str(moe_alt_dir)))
    assert any(".mlp.experts.7.down_proj.weight" in name for name, _ in alt)
    # A refused update (one expert tensor of a wrong shape among good ones) changes nothing.
    bad = [(n, t[:, :-1] if n.endswith("experts.3.up_proj.weight") else t) for n, t in alt]
    with pytest.raises(ValueError, match="experts.3.up_proj.weight"):
        moe_llm.load_weights(bad)
    with pytest.raises(ValueError, match="does not exist"):
        moe_llm.load_weights([("model.layers.0.mlp.experts.8.gate_proj.weight", alt[0][1])])
    with pytest.raises(ValueError, match=r"experts.gate_up_proj': shape \[2, 64, 64\]"):
        moe_llm.load_weights([("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(2, 64, 64))])
    unchanged = run(moe_llm, PROMPTS, greedy(), generate)
    assert [o.token_ids for o in unchanged] == [o.token_ids for o in before]
    moe_llm.load_weights(alt)
    updated = run(moe_llm, PROMPTS, greedy(), generate)
    fresh_llm = make_llm(moe_alt_dir, in_process=True, enable_return_routed_experts=True, num_kv_blocks=64)
    try:
        fresh = run(fresh_llm, PROMPTS, greedy(), generate)
    finally:
        fresh_llm.shutdown()
    assert [o.token_ids for o in updated] == [o.token_ids for o in fresh] != [o.token_ids for o in before]
    # Back to the module's weights as a trainer holding the Hugging Face model sends them: transformers 5's stacked
    # experts (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) under its parameter names.
    names = dict(hf.model(moe_dir).named_parameters())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    moe_llm.load_weights(list(names.items()))
    back = run(moe_llm, PROMPTS, greedy(), generate)
    assert [sampled_logprobs(o) for o in back] == [sampled_logprobs(o) for o in before]
    for u, f in zip(updated, fresh, strict=True):
        assert sampled_logprobs(u) == sampled_logprobs(f)
        np.testing.assert_array_equal(u.routed_experts, f.routed_experts)


def test_routed_experts_need_a_moe_model(qwen3_dir, make_llm) -> None:
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        make_llm(qwen3_dir, in_process=True, enable_return_routed_experts=True)


def test_batch_invariant_moe_rows_do_not_depend_on_the_batch(moe_dir) -> None:
    model = load_training_model(moe_dir, batch_invariant=True)
    seqs = [PROMPTS[0], PROMPTS[1], PROMPTS[2] * 3]
    together = forward_hidden(model, seqs)
    for i, seq in enumerate(seqs):
        (alone,) = forward_hidden(model, [seq])
        assert torch.equal(alone, together[i]), i


def test_replayed_routing_reroutes_and_trains_the_router(moe_llm, moe_dir, generate) -> None:
    (out,) = run(moe_llm, [PROMPTS[0]], greedy(), generate)
    sequence = PROMPTS[0] + list(out.token_ids)
    model = load_training_model(moe_dir)
    own = forward_hidden(model, [sequence])[0]
    replayed = forward_hidden(model, [sequence], [out.routed_experts])[0]
    torch.testing.assert_close(replayed, own, rtol=0, atol=1e-5)  # the engine routed as the trainer does
    other = out.routed_experts.copy()
    other[:, 0] = (other[:, 0] + 1) % NUM_EXPERTS  # every token of layer 0 to other experts
    rerouted = forward_hidden(model, [sequence], [other])[0]
    assert (rerouted - own).abs().max() > 1e-2
    rerouted.sum().backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"routed_experts\[0\]"):
        forward_hidden(model, [sequence[:3]], [out.routed_experts])
