"""LoRA adapters in the engine: an adapter gives what the checkpoint with it merged gives (rlserve and transformers),
mixed batches, the prefix cache, in-place reloads, removal, refusals, sleep, checksums; the core in its own process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlserve import LLM, LoRARequest, SamplingParams
from rlserve.config import EngineConfig
from rlserve.toy import make_lora_dir, merge_lora

PROMPTS = ["hello world, how are", "The quick brown fox", "1 2 3 4 5 6", "Once upon a time there"]
# Several full blocks of 16 tokens (byte-level tokenizer): what the prefix cache can share.
LONG_PROMPT = "You are a helpful assistant. Answer briefly and politely. Question: why?"
RANK = 8


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> dict[str, Path]:
    """Adapters for the qwen3 and llama checkpoints and, beside each, its merged checkpoint ("<name>-merged")."""
    root = tmp_path_factory.mktemp("lora")
    qwen3, llama = model_dirs["qwen3"], model_dirs["llama"]
    dirs = {
        "a1": make_lora_dir(root / "a1", qwen3, rank=RANK, seed=1),
        # rsLoRA, a smaller rank and only some targets: scaling alpha / sqrt(r), zero-padding, parts left out
        "a2": make_lora_dir(
            root / "a2", qwen3, rank=4, seed=2, target_modules=("q_proj", "v_proj", "down_proj"), use_rslora=True
        ),
        "a1-new": make_lora_dir(root / "a1-new", qwen3, rank=RANK, seed=3),  # a1 after an optimizer step
        "llama": make_lora_dir(root / "llama", llama, rank=RANK, seed=4, alpha=8.0),
    }
    for name, base in (("a1", qwen3), ("a2", qwen3), ("a1-new", qwen3), ("llama", llama)):
        dirs[f"{name}-merged"] = merge_lora(root / f"{name}-merged", base, dirs[name])
    return dirs


def lora(adapters: dict[str, Path], name: str, lora_id: int, **kwargs) -> LoRARequest:
    return LoRARequest(name, lora_id, str(adapters[name]), **kwargs)


@pytest.fixture(scope="module")
def lora_llm(qwen3_dir: Path, make_llm) -> LLM:
    """The engine under test: the core in its own process, two adapter slots."""
    llm = make_llm(qwen3_dir, enable_lora=True, max_loras=2, max_lora_rank=RANK)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def base_llm(qwen3_dir: Path, make_llm) -> LLM:
    """The base model without adapter slots, and without a prefix cache (see test_mixed_batch_equals_each_alone)."""
    llm = make_llm(qwen3_dir, in_process=True, enable_prefix_caching=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference(adapters: dict[str, Path], make_llm, generate):
    """reference(name, prompts) -> the outputs of an engine on adapter `name`'s merged checkpoint (no prefix cache),
    engines started on first use and kept for the module."""
    engines: dict[str, LLM] = {}

    def run(name: str, prompts: list[str], max_tokens: int = 8):
        if name not in engines:
            engines[name] = make_llm(adapters[f"{name}-merged"], in_process=True, enable_prefix_caching=False)
        return [o.outputs[0] for o in generate(engines[name], prompts, greedy(max_tokens))]

    yield run
    for engine in engines.values():
        engine.shutdown()


def assert_close(outputs, expected, tol: float = 1e-5) -> None:
    for out, ref in zip(outputs, expected, strict=True):
        assert out.token_ids == ref.token_ids
        for mine, theirs in zip(out.logprobs, ref.logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            for token in mine:
                assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=tol)


def assert_bit_equal(outputs, expected) -> None:
    for out, ref in zip(outputs, expected, strict=True):
        assert out.token_ids == ref.token_ids
        assert [{t: lp.logprob for t, lp in row.items()} for row in out.logprobs] == [
            {t: lp.logprob for t, lp in row.items()} for row in ref.logprobs
        ]


def run(llm: LLM, prompts, lora_request=None, max_tokens: int = 8, cold: bool = False):
    """cold: with the prefix cache emptied first, so that a run computes what an earlier one did, bit for bit."""
    if cold:
        llm.reset_prefix_cache()
    outputs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False, lora_request=lora_request)
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_cache_free_blocks"] == stats["kv_cache_blocks"]
    return outputs


def test_adapter_equals_merged_checkpoint(lora_llm, adapters, reference, hf) -> None:
    a1, a2 = lora(adapters, "a1", 1), lora(adapters, "a2", 2)
    for request, name in ((a1, "a1"), (a2, "a2")):
        outputs = [o.outputs[0] for o in run(lora_llm, PROMPTS, request)]
        assert_close(outputs, reference(name, PROMPTS))
        tokenizer = lora_llm.get_tokenizer()
        merged = adapters[f"{name}-merged"]
        assert outputs[0].token_ids == hf.greedy(merged, tokenizer(PROMPTS[0]).input_ids, 8)
    assert lora_llm.list_loras() == {1, 2}


def test_llama_adapter_against_transformers(model_dirs, adapters, make_llm, hf) -> None:
    llm = make_llm(model_dirs["llama"], in_process=True, enable_lora=True, max_lora_rank=RANK)
    try:
        request = lora(adapters, "llama", 7)
        (out,) = llm.generate(PROMPTS[1], greedy(), use_tqdm=False, lora_request=request)
        merged = adapters["llama-merged"]
        ids = out.prompt_token_ids
        completion = out.outputs[0].token_ids
        assert completion == hf.greedy(merged, ids, 8)
        expected = hf.logits(merged, ids + completion).log_softmax(-1)[len(ids) - 1 : -1]
        got = torch.tensor([row[t].logprob for row, t in zip(out.outputs[0].logprobs, completion, strict=True)])
        torch.testing.assert_close(got, expected[torch.arange(len(completion)), completion], atol=1e-5, rtol=0)
    finally:
        llm.shutdown()


def test_mixed_batch_equals_each_alone(lora_llm, base_llm, adapters) -> None:
    a1, a2 = lora(adapters, "a1", 1), lora(adapters, "a2", 2)
    loras = [None, a1, a2, None, a1]
    prompts = [*PROMPTS, PROMPTS[0]]
    mixed = [o.outputs[0] for o in run(lora_llm, prompts, loras, cold=True)]
    # The base requests get the base model's bits: an engine without adapters running the same batch (same shapes,
    # so the same matmul blocking) gives them exactly. Same shapes means whole prefills on both: the adapter engine's
    # cache emptied (blocks an earlier test cached would cut prompts short) and none in the base engine (its last
    # prompt would share the first one's blocks, which the adapter engine keys apart). A CPU GEMM's rows can depend
    # on the number of rows, so a shorter prefill can change the base requests' last bits.
    plain = [o.outputs[0] for o in run(base_llm, prompts)]
    for prompt, request, out, base in zip(prompts, loras, mixed, plain, strict=True):
        alone = run(lora_llm, [prompt], request)[0].outputs[0]
        assert_close([out], [alone])
        if request is None:
            assert_bit_equal([out], [base])
    assert mixed[0].token_ids != mixed[4].token_ids  # the adapter changes the outputs


def test_prefix_cache_never_crosses_adapters_or_versions(lora_llm, adapters, reference) -> None:
    a1 = lora(adapters, "a1", 1)
    lora_llm.reset_prefix_cache()
    run(lora_llm, [LONG_PROMPT])
    (again,) = run(lora_llm, [LONG_PROMPT])
    assert again.num_cached_tokens > 0  # the cache is on and serves the base model its own blocks
    (first,) = run(lora_llm, [LONG_PROMPT], a1)
    assert first.num_cached_tokens == 0
    assert_close([first.outputs[0]], reference("a1", [LONG_PROMPT]))
    (second,) = run(lora_llm, [LONG_PROMPT], a1)
    assert second.num_cached_tokens > 0
    assert_close([second.outputs[0]], [first.outputs[0]])

    # The trainer re-saved the adapter: reloaded in place under the same name and id, a new version.
    assert lora_llm.add_lora(LoRARequest("a1", 1, str(adapters["a1-new"]), load_inplace=True))
    (reloaded,) = run(lora_llm, [LONG_PROMPT], a1)
    assert reloaded.num_cached_tokens == 0
    assert_close([reloaded.outputs[0]], reference("a1-new", [LONG_PROMPT]))
    assert reloaded.outputs[0].token_ids != first.outputs[0].token_ids
    # The base model never got the adapters' blocks either.
    (base_after,) = run(lora_llm, [LONG_PROMPT])
    assert_bit_equal([base_after.outputs[0]], [again.outputs[0]])
    # A generate whose request asks for an in-place reload reloads once, before its requests run.
    outputs = run(lora_llm, [LONG_PROMPT, PROMPTS[0]], lora(adapters, "a1", 1, load_inplace=True))
    assert_close([o.outputs[0] for o in outputs], reference("a1", [LONG_PROMPT, PROMPTS[0]]))
    assert outputs[0].num_cached_tokens == 0


def test_remove_then_generate_reloads_from_path(lora_llm, adapters, reference) -> None:
    a2 = lora(adapters, "a2", 2)
    run(lora_llm, [PROMPTS[0]], a2)
    assert 2 in lora_llm.list_loras()
    assert lora_llm.remove_lora(2) is True
    assert 2 not in lora_llm.list_loras()
    assert lora_llm.remove_lora(2) is False  # not loaded
    outputs = run(lora_llm, PROMPTS[:2], a2)
    assert 2 in lora_llm.list_loras()
    assert_close([o.outputs[0] for o in outputs], reference("a2", PROMPTS[:2]))
    assert lora_llm.add_lora(a2) is True  # loaded already: a no-op
    messages = [{"role": "user", "content": "hi"}]
    (chat,) = lora_llm.chat(messages, greedy(), use_tqdm=False, lora_request=a2)
    text = lora_llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert_close([chat.outputs[0]], reference("a2", [text]))


def write_bad_adapter(root: Path, adapters: dict[str, Path], case: str) -> Path:
    """A copy of adapter a1 broken in one way."""
    path = root / case
    path.mkdir()
    config = json.loads((adapters["a1"] / "adapter_config.json").read_text())
    tensors = load_file(str(adapters["a1"] / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0."
    if case == "rank":
        config["r"] = 2 * RANK
    elif case in ("use_dora", "bias", "modules_to_save", "fan_in_fan_out"):
        config[case] = {"use_dora": True, "bias": "all", "modules_to_save": ["lm_head"], "fan_in_fan_out": True}[case]
    elif case == "target_modules":
        config["target_modules"] = ["q_proj", "embed_tokens"]
    elif case == "lm_head":
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(RANK, 64)
        tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(100, RANK)
    elif case == "shape":
        tensors[prefix + "self_attn.k_proj.lora_B.weight"] = torch.zeros(48, RANK)
    elif case == "unpaired":
        del tensors[prefix + "mlp.up_proj.lora_B.weight"]
    if case != "no_safetensors":
        save_file(tensors, str(path / "adapter_model.safetensors"))
    else:
        (path / "adapter_model.bin").write_bytes(b"pickle")
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


BAD_ADAPTERS = {
    "rank": "^r: the adapter's rank 16 exceeds max_lora_rank 8",
    "use_dora": "^use_dora:",
    "bias": "^bias:",
    "modules_to_save": "^modules_to_save:",
    "fan_in_fan_out": "^fan_in_fan_out:",
    "target_modules": r"^target_modules: \['embed_tokens'\] not supported",
    "lm_head": "lm_head.lora_A.weight: target_modules: 'lm_head' is not supported",
    "shape": "k_proj.lora_A.weight / lora_B.weight: shapes .* do not fit the layer",
    "unpaired": "up_proj.lora_B.weight: missing",
    "no_safetensors": "^lora_path: .* has no adapter_model.safetensors",
}


def test_refusals_change_nothing(lora_llm, base_llm, adapters, tmp_path) -> None:
    a1 = lora(adapters, "a1", 1)
    before = [o.outputs[0] for o in run(lora_llm, PROMPTS[:2], a1, cold=True)]
    loaded = lora_llm.list_loras()
    for case, message in BAD_ADAPTERS.items():
        bad = write_bad_adapter(tmp_path, adapters, case)
        # As an in-place reload of a loaded adapter: refused before any byte of it is written.
        with pytest.raises(ValueError, match=message):
            lora_llm.add_lora(LoRARequest("a1", 1, str(bad), load_inplace=True))
    with pytest.raises(ValueError, match="^lora_path: .* is not a directory"):
        lora_llm.generate(PROMPTS[0], greedy(), use_tqdm=False, lora_request=LoRARequest("x", 5, str(tmp_path / "no")))
    assert len(loaded) == 2
    with pytest.raises(ValueError, match=r"^max_loras: all 2 adapter slots are taken"):
        lora_llm.add_lora(lora(adapters, "a1-new", 3))
    with pytest.raises(ValueError, match="^lora_int_id: 1 is loaded as adapter 'a1'"):
        lora_llm.add_lora(LoRARequest("other", 1, str(adapters["a1"])))
    with pytest.raises(ValueError, match="^lora_name: adapter 'a1' is loaded with lora_int_id 1"):
        lora_llm.add_lora(LoRARequest("a1", 4, str(adapters["a1"])))
    with pytest.raises(ValueError, match="^lora_request: got 1 for 2 prompts"):
        lora_llm.generate(PROMPTS[:2], greedy(), use_tqdm=False, lora_request=[a1])
    with pytest.raises(ValueError, match="^lora_int_id: must be an integer >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="^lora_path: must be a non-empty string"):
        LoRARequest("a", 1, "")
    with pytest.raises(ValueError, match="^lora_request: not supported without enable_lora"):
        base_llm.generate(PROMPTS[0], greedy(), use_tqdm=False, lora_request=a1)
    with pytest.raises(ValueError, match="^lora_request: not supported without enable_lora"):
        base_llm.add_lora(a1)
    assert lora_llm.list_loras() == loaded
    assert_bit_equal([o.outputs[0] for o in run(lora_llm, PROMPTS[:2], a1, cold=True)], before)


def test_remove_while_in_use_lets_running_requests_finish(qwen3_dir, adapters, make_llm) -> None:
    """An adapter removed while requests use it leaves at once for new requests; those running finish with it (the
    tokens of a run that nothing removed) and its slot is free only after the last of them."""
    llm = make_llm(qwen3_dir, in_process=True, enable_lora=True, max_loras=1, max_lora_rank=RANK)
    try:
        a1, a2 = lora(adapters, "a1", 1), lora(adapters, "a2", 2)
        prompt = [5, 6, 7, 8]

        def drive(removing: bool) -> dict[str, list[int]]:
            core = llm.engine_core
            for rid in ("r1", "r2"):
                core.add_request(rid, prompt, greedy(12), lora_request=a1)
            tokens: dict[str, list[int]] = {"r1": [], "r2": []}
            for i in range(100):
                for out in core.step():
                    tokens[out.request_id] += out.new_token_ids
                if removing and i == 1:
                    # On the core itself, as this loop drives it (a front end's call would take the outputs that
                    # add_lora's drain reads back).
                    assert core.remove_lora(1) is True and core.list_loras() == set()
                    with pytest.raises(ValueError, match=r"^max_loras: all 1 adapter slots are taken .*1 removed"):
                        core.add_lora(a2)  # the removed adapter's slot still serves r1 and r2
                if not core.has_unfinished_requests():
                    return tokens
            raise AssertionError("requests did not finish")

        assert llm.add_lora(a1)
        undisturbed = drive(removing=False)
        assert llm.list_loras() == {1}
        removed_midway = drive(removing=True)
        assert removed_midway == undisturbed and len(undisturbed["r1"]) == 12
        assert llm.add_lora(a2) and llm.list_loras() == {2}  # the slot is free again
    finally:
        llm.shutdown()


def test_adapters_survive_sleep_and_are_not_weights(lora_llm, base_llm, adapters) -> None:
    a1 = lora(adapters, "a1", 1)
    before = [o.outputs[0] for o in run(lora_llm, PROMPTS[:2], a1, cold=True)]
    # Adapter tensors are no checkpoint weights: the checksums are the base model's.
    assert lora_llm.weight_checksums() == base_llm.weight_checksums()
    lora_llm.sleep(level=1)
    assert lora_llm.wake_up()
    assert 1 in lora_llm.list_loras()
    assert_bit_equal([o.outputs[0] for o in run(lora_llm, PROMPTS[:2], a1, cold=True)], before)


def test_config_refusals(model_names_as_dirs, tmp_path) -> None:
    with pytest.raises(ValueError, match="^enable_lora: not with tensor_parallel_size > 1"):
        EngineConfig(model="m", enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="^enable_lora: not with data_parallel_size > 1"):
        EngineConfig(model="m", enable_lora=True, data_parallel_size=2)
    with pytest.raises(ValueError, match="^enable_lora: not with enable_expert_parallel"):
        EngineConfig(model="m", enable_lora=True, data_parallel_size=2, enable_expert_parallel=True)
    for name in ("max_loras", "max_lora_rank"):
        with pytest.raises(ValueError, match=f"^{name} must be >= 1"):
            EngineConfig(model="m", **{name: 0})


def test_moe_model_refused(tmp_path) -> None:
    from rlserve.model.loader import load_model
    from rlserve.toy import make_model_dir

    model, _ = load_model(str(make_model_dir(tmp_path / "moe", preset="tiny-moe")), "float32", torch.device("cpu"))
    with pytest.raises(ValueError, match="^enable_lora: Qwen3MoeForCausalLM is a MoE model"):
        model.enable_lora(1, RANK)


def test_async_llm_with_the_core_in_its_own_process(qwen3_dir, adapters, reference) -> None:
    from rlserve import AsyncLLM

    engine = AsyncLLM(str(qwen3_dir), num_kv_blocks=64, enable_lora=True, max_lora_rank=RANK)
    a1, a2 = lora(adapters, "a1", 1), lora(adapters, "a2", 2)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def final(prompt: str, request_id: str, request: LoRARequest | None):
        outputs = [o async for o in engine.generate(prompt, greedy(), request_id, lora_request=request)]
        return outputs[-1].outputs[0]

    async def go() -> None:
        assert_close([await final(PROMPTS[0], "g1", a1)], reference("a1", PROMPTS[:1]))
        assert await engine.list_loras() == {1}
        with pytest.raises(ValueError, match="^max_loras: all 1 adapter slots are taken"):
            await engine.add_lora(a2)
        # Removed while a request runs with it: gone for new requests at once, its slot freed when that request ends.
        collector = await engine.add_request("busy", PROMPTS[1], long, lora_request=a1)
        await asyncio.wait_for(collector.get(), 60)
        assert await engine.remove_lora(1) is True
        assert await engine.list_loras() == set()
        with pytest.raises(ValueError, match="^max_loras: all 1 adapter slots are taken .*1 removed"):
            await engine.add_lora(a2)
        await engine.abort("busy")
        assert await engine.add_lora(a2) is True
        assert_close([await final(PROMPTS[1], "g2", a2)], reference("a2", PROMPTS[1:2]))
        with pytest.raises(ValueError, match="^lora_path: .* is not a directory"):
            await final(PROMPTS[0], "g3", LoRARequest("x", 3, "/nonexistent"))
        assert await engine.list_loras() == {2}

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()


def test_batch_invariant_mode_keeps_adapter_requests_invariant(qwen3_dir, adapters, make_llm) -> None:
    llm = make_llm(qwen3_dir, in_process=True, enable_lora=True, max_loras=2, max_lora_rank=RANK, batch_invariant=True)
    try:
        a1, a2 = lora(adapters, "a1", 1), lora(adapters, "a2", 2)
        mixed = run(llm, PROMPTS, [a1, None, a2, a1], cold=True)
        for prompt, request, out in zip(PROMPTS, [a1, None, a2, a1], mixed, strict=True):
            (alone,) = run(llm, [prompt], request, cold=True)
            assert_bit_equal([out.outputs[0]], [alone.outputs[0]])
    finally:
        llm.shutdown()
