"""The in-place weight loader: partial updates touch exactly their rows, bad input changes nothing, and the
checkpoint view round-trips with Hugging Face's state_dict."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.model.loader import iterate_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello, world!", "weights", {"prompt_token_ids": list(range(60, 90))}]


def snapshot(llm: LLM) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's model, by module name (fused ones whole), copied."""
    return {name: p.detach().clone() for name, p in llm.engine_core.runner.model.named_parameters()}


def checkpoint_view(llm: LLM) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in llm.engine_core.runner.model.checkpoint_weights()}


def assert_same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], except_: set[str] = frozenset()):
    assert before.keys() == after.keys()
    for name in before:
        if name not in except_:
            assert torch.equal(before[name], after[name]), f"{name} changed"


@torch.inference_mode()
def hf_greedy_with(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()


def test_partial_update_changes_exactly_those_rows(qwen3_dir, make_llm, generate, hf) -> None:
    llm = make_llm(qwen3_dir, in_process=True)  # in process: the model's parameters are read and written directly
    model = llm.engine_core.runner.model
    before_params, before_view = snapshot(llm), checkpoint_view(llm)
    generate(llm, PROMPTS, GREEDY)  # fill the prefix cache with KV of the old weights

    gen = torch.Generator().manual_seed(0)
    q_name, gate_name = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"
    new_q = torch.randn(before_view[q_name].shape, generator=gen) * 0.2
    new_gate = torch.randn(before_view[gate_name].shape, generator=gen) * 0.2
    assert model.load_weights([(q_name, new_q), (gate_name, new_gate)]) == 2

    after_view = checkpoint_view(llm)
    assert torch.equal(after_view[q_name], new_q)
    assert torch.equal(after_view[gate_name], new_gate)
    assert_same(before_view, after_view, except_={q_name, gate_name})

    # The same through the fused parameters: only the q rows of layer 0's qkv and the gate rows of layer 1.
    after_params = snapshot(llm)
    q_rows, gate_rows = new_q.shape[0], new_gate.shape[0]
    qkv, gate_up = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"
    assert torch.equal(after_params[qkv][:q_rows], new_q)
    assert torch.equal(after_params[qkv][q_rows:], before_params[qkv][q_rows:])
    assert torch.equal(after_params[gate_up][:gate_rows], new_gate)
    assert torch.equal(after_params[gate_up][gate_rows:], before_params[gate_up][gate_rows:])
    assert_same(before_params, after_params, except_={qkv, gate_up})

    # The engine now computes with the new rows (HF with the same two tensors replaced as the reference); the
    # front-end loader is used so the prefix cache of the old weights is dropped.
    llm.load_weights([(q_name, new_q), (gate_name, new_gate)])
    reference = copy.deepcopy(hf.model(qwen3_dir))
    state = reference.state_dict()
    state[q_name], state[gate_name] = new_q, new_gate
    reference.load_state_dict(state)
    for out in generate(llm, PROMPTS, GREEDY):
        assert out.num_cached_tokens == 0
        assert out.outputs[0].token_ids == hf_greedy_with(reference, out.prompt_token_ids, 12)


H = 64  # hidden size of the tiny preset
# Each is refused by the loader: a name the model lacks, a shape that differs, or a non-float dtype.
BAD: dict[str, tuple[str, torch.Tensor]] = {
    "unknown-name": ("model.layers.0.self_attn.q_proj.weigth", torch.zeros(H, H)),
    "layer-out-of-range": ("model.layers.7.mlp.down_proj.weight", torch.zeros(H, 128)),
    "missing-bias": ("model.layers.0.mlp.down_proj.bias", torch.zeros(H)),
    "not-a-parameter": ("model.layers.0.mlp", torch.zeros(H)),
    "wrong-shape": ("model.layers.0.self_attn.k_proj.weight", torch.zeros(33, H)),
    "transposed": ("model.layers.0.mlp.up_proj.weight", torch.zeros(H, 128)),
    "wrong-rank": ("model.norm.weight", torch.zeros(1, H)),
    "int-dtype": ("model.norm.weight", torch.ones(H, dtype=torch.int64)),
    "bool-dtype": ("model.layers.1.input_layernorm.weight", torch.ones(H, dtype=torch.bool)),
}
GOOD = [
    ("model.layers.0.self_attn.q_proj.weight", torch.full((H, H), 0.5)),
    ("lm_head.weight", torch.zeros(259, H)),
    ("model.norm.weight", torch.full((H,), 3.0)),
]


@pytest.mark.parametrize("position", ["alone", "after-good", "between-good"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_tensor_changes_nothing(qwen3_dir, make_llm, generate, case: str, position: str) -> None:
    llm = make_llm(qwen3_dir, in_process=True, lm_head_dtype="float32")  # in process: the model is read directly
    model = llm.engine_core.runner.model
    assert model.spec.hidden_size == H
    (baseline,) = generate(llm, PROMPTS[0], GREEDY)
    before = snapshot(llm)
    bad = BAD[case]
    weights = {"alone": [bad], "after-good": GOOD + [bad], "between-good": GOOD[:2] + [bad] + GOOD[2:]}[position]

    with pytest.raises(ValueError) as info:
        model.load_weights(weights)
    assert bad[0] in str(info.value)
    assert_same(before, snapshot(llm))

    with pytest.raises(ValueError):
        llm.load_weights(iter(weights))  # a one-shot iterator: validation must not need a second pass over it
    assert_same(before, snapshot(llm))

    # Nothing half-applied either (e.g. the fp32 copy of the head): the engine still computes what it did.
    (again,) = generate(llm, PROMPTS[0], GREEDY)
    assert again.outputs[0].token_ids == baseline.outputs[0].token_ids


def test_checkpoint_weights_match_hf_state_dict(toy_model, make_llm, hf) -> None:
    _, path = toy_model
    llm = make_llm(path, in_process=True)  # in process: the model's checkpoint view is read directly
    model = llm.engine_core.runner.model
    ours = dict(model.checkpoint_weights())
    theirs = hf.model(path).state_dict()
    expected_names = set(theirs)
    if model.spec.tie_word_embeddings:
        # HF lists the tied head under both names; it is one tensor and rlserve names it once.
        assert torch.equal(theirs["lm_head.weight"], theirs["model.embed_tokens.weight"])
        expected_names.discard("lm_head.weight")
    assert set(ours) == expected_names
    for name, tensor in ours.items():
        assert tensor.shape == theirs[name].shape, name
        assert tensor.dtype == theirs[name].dtype, name
        assert torch.equal(tensor, theirs[name]), name


def test_checkpoint_weights_round_trip_through_load_weights(toy_model, make_llm, generate, hf) -> None:
    """Loading an engine's own checkpoint view (or HF's state_dict) back writes every tensor and changes nothing."""
    _, path = toy_model
    llm = make_llm(path, in_process=True)  # in process: the model's parameters are read directly
    before = snapshot(llm)
    view = list(llm.engine_core.runner.model.checkpoint_weights())
    assert llm.load_weights([(n, t.clone()) for n, t in view]) == len(view)
    assert_same(before, snapshot(llm))
    assert llm.load_weights(list(hf.model(path).state_dict().items())) >= len(view)
    assert_same(before, snapshot(llm))
    (out,) = generate(llm, PROMPTS[0], GREEDY)
    assert out.outputs[0].token_ids == hf.greedy(path, out.prompt_token_ids, 12)


@pytest.mark.parametrize("lm_head_dtype", [None, "float32"])
def test_full_update_serves_the_new_model(qwen3_dir, qwen3_alt_dir: Path, lm_head_dtype, make_llm, generate, hf):
    """After loading another checkpoint's weights the engine is that model: HF on the new weights agrees."""
    llm = make_llm(qwen3_dir, lm_head_dtype=lm_head_dtype, block_size=4)
    old = generate(llm, PROMPTS, GREEDY)
    llm.load_weights(hf.model(qwen3_alt_dir).state_dict().items())
    new = generate(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1))
    changed = 0
    for before, after in zip(old, new, strict=True):
        assert after.num_cached_tokens == 0, "KV of the old weights was served after the update"
        expected = hf.greedy(qwen3_alt_dir, after.prompt_token_ids, 12)
        assert after.outputs[0].token_ids == expected
        changed += before.outputs[0].token_ids != expected
        ids = after.prompt_token_ids + expected
        rows = hf.logits(qwen3_alt_dir, ids)[len(after.prompt_token_ids) - 1 : -1].log_softmax(-1)
        for j, (token, entry) in enumerate(zip(expected, after.outputs[0].logprobs, strict=True)):
            assert entry[token].logprob == pytest.approx(float(rows[j, token]), abs=1e-4)
    assert changed > 0
    # SHA-256 of every tensor of the checkpoint view: equal bit for bit to a fresh engine on the new checkpoint.
    assert llm.weight_checksums() == make_llm(qwen3_alt_dir).weight_checksums()


def test_tied_head_follows_embedding_updates(model_dirs, make_llm, generate, hf) -> None:
    path = model_dirs["qwen3-tied"]
    llm = make_llm(path, in_process=True, lm_head_dtype="float32")  # in process: the head's tensor is read directly
    model = llm.engine_core.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    generate(llm, PROMPTS[0], GREEDY)  # builds the fp32 head copy
    new_embed = torch.randn(model.model.embed_tokens.weight.shape, generator=torch.Generator().manual_seed(3)) * 0.2
    llm.load_weights([("model.embed_tokens.weight", new_embed)])
    assert torch.equal(model.lm_head.weight, new_embed)
    reference = copy.deepcopy(hf.model(path))
    with torch.no_grad():
        reference.get_input_embeddings().weight.copy_(new_embed)
    assert reference.lm_head.weight.data_ptr() == reference.get_input_embeddings().weight.data_ptr()
    for out in generate(llm, PROMPTS, GREEDY):
        assert out.outputs[0].token_ids == hf_greedy_with(reference, out.prompt_token_ids, 12)


def test_bf16_update_matches_a_fresh_engine(qwen3_dir, qwen3_alt_dir: Path, make_llm, generate) -> None:
    """In bf16 the fp32 LM head is a real copy (in fp32 it aliases the weight), so only here can it go stale."""
    kwargs = dict(dtype="bfloat16", lm_head_dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    updated = make_llm(qwen3_dir, **kwargs)
    generate(updated, PROMPTS, params)
    updated.load_weights(iterate_checkpoint(str(qwen3_alt_dir)))
    fresh = make_llm(qwen3_alt_dir, **kwargs)
    for a, b in zip(generate(updated, PROMPTS, params), generate(fresh, PROMPTS, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert {t: e.logprob for t, e in x.items()} == pytest.approx({t: e.logprob for t, e in y.items()}, abs=1e-6)
