"""FP8 engines on CPU (the reference GEMM): an FP8 checkpoint loads as the same bf16 checkpoint quantized at load,
logprobs stay close to the bf16 engine's, and weight updates (bf16 quantized in place, or fp8 with scales as the
trainer quantized them) equal a fresh load of the same weights quantized, through `load_weights` and the nccl and
sparse_nccl backends over gloo, with every refused update changing nothing."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlserve import LLM, SamplingParams
from rlserve.config import WeightTransferConfig
from rlserve.distributed.weight_transfer import ModuleSource, ParamMeta, WeightSource, WeightTransferTrainerFactory
from rlserve.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
from rlserve.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLTrainerInitInfo
from rlserve.model.fp8 import FP8_DTYPE, Fp8Scheme, quantize_checkpoint
from rlserve.model.loader import iterate_checkpoint
from rlserve.rl.engine_server import free_port
from rlserve.rl.fp8_weights import Fp8QuantizedSource
from rlserve.rl.parity import make_peaked_model_dir
from rlserve.toy import make_fp8_model_dir, make_model_dir
from rlserve.weight_transfer import compare_checksums, weight_checksums
from rlserve.weight_transfer.sparse_nccl import SparseDelta

TIMEOUT_S = 60.0
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]}, "hello world"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
Q_PROJ = "model.layers.0.self_attn.q_proj"
# |logprob(bf16 + FP8 projections) - logprob(bf16)| of the bf16 engine's sampled tokens on the peaked toy (logits x16,
# mean logprob -1.8): measured mean 0.16 and max 0.78 for both layouts, about 8x bf16's own rounding against fp32 (the
# x16 logits amplify it; a trained model's logits are not scaled up). A wrong scale or layout gives errors of several
# nats.
MEAN_ABS_TOLERANCE, MAX_ABS_TOLERANCE = 0.3, 1.5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    old = make_peaked_model_dir(root / "old", preset="tiny-fp8", seed=0)
    new = make_model_dir(root / "new", preset="tiny-fp8", seed=1)
    return {
        "old": old,
        "new": new,
        "fp8": make_fp8_model_dir(root / "old-fp8", old, "fp8"),
        "fbgemm_fp8": make_fp8_model_dir(root / "old-fbgemm", old, "fbgemm_fp8"),
    }


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return dict(iterate_checkpoint(str(path)))


def _quantized(path: Path, method: str = "fp8") -> dict[str, torch.Tensor]:
    return dict(quantize_checkpoint(_checkpoint(path).items(), Fp8Scheme(method)))


def _greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [
        (list(s.token_ids), [lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids, strict=True)])
        for s in (o.outputs[0] for o in outputs)
    ]


def _pointers(llm: LLM) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in llm.engine_core.runner.model.named_parameters()}


@pytest.fixture(scope="module")
def engine(dirs: dict[str, Path], make_llm) -> Iterator[LLM]:
    """One block-wise FP8 engine over the bf16 checkpoint, in this process (the tests read its parameters)."""
    llm = make_llm(dirs["old"], in_process=True, quantization="fp8")
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("method", ["fp8", "fbgemm_fp8"])
def test_fp8_checkpoint_loads_as_the_bf16_checkpoint_quantized_at_load(dirs, make_llm, method: str) -> None:
    """The FP8 checkpoint (its config's quantization_config picks the layout; no flag needed) holds the file's fp8
    tensors and scales bit for bit, the same as online quantization of the bf16 checkpoint, and generates the same."""
    from_file = make_llm(dirs[method], in_process=True)
    online = make_llm(dirs["old"], in_process=True, quantization=method)
    try:
        file_tensors = load_file(str(dirs[method] / "model.safetensors"))
        held = dict(from_file.engine_core.runner.model.checkpoint_weights())
        assert set(held) == set(file_tensors)
        scale = f"{Q_PROJ}.{Fp8Scheme(method).scale_name}"
        assert held[f"{Q_PROJ}.weight"].dtype == FP8_DTYPE and held[scale].dtype == torch.float32
        for name, tensor in held.items():
            assert torch.equal(tensor.view(torch.uint8), file_tensors[name].view(torch.uint8)), name
        assert from_file.weight_checksums() == online.weight_checksums() == weight_checksums(file_tensors.items())
        assert _greedy(from_file) == _greedy(online)
    finally:
        from_file.shutdown()
        online.shutdown()


def test_fp8_logprobs_are_close_to_bf16(dirs, make_llm) -> None:
    """The bf16 engine's sampled rollouts, teacher-forced through bf16 engines with and without FP8 projections."""
    prompts = [[(7 * i + 3 * j) % 250 for j in range(16)] for i in range(4)]
    sampling = SamplingParams(temperature=1.0, seed=0, max_tokens=32, ignore_eos=True, detokenize=False)
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    logprobs, sequences = {}, None
    for quantization in (None, "fp8", "fbgemm_fp8"):
        llm = make_llm(dirs["old"], dtype="bfloat16", quantization=quantization)
        try:
            if sequences is None:
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
                sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
            scored = llm.generate([{"prompt_token_ids": s} for s in sequences], scoring, use_tqdm=False)
        finally:
            llm.shutdown()
        logprobs[quantization] = torch.tensor(
            [
                entry[token].logprob
                for o, s in zip(scored, sequences, strict=True)
                for entry, token in list(zip(o.prompt_logprobs, s, strict=True))[len(prompts[0]) :]
            ]
        )
    for method in ("fp8", "fbgemm_fp8"):
        diff = (logprobs[method] - logprobs[None]).abs()
        assert 0 < diff.mean() < MEAN_ABS_TOLERANCE, (method, diff.mean())
        assert diff.max() < MAX_ABS_TOLERANCE, (method, diff.max())


def test_bf16_update_is_quantized_in_place_and_equals_a_fresh_load(dirs, engine: LLM, make_llm) -> None:
    pointers = _pointers(engine)
    engine.load_weights(list(_checkpoint(dirs["new"]).items()))
    assert _pointers(engine) == pointers  # the same storage: CUDA graphs' captured pointers stay valid
    assert compare_checksums(weight_checksums(_quantized(dirs["new"]).items()), engine.weight_checksums())["match"]
    fresh = make_llm(dirs["new"], in_process=True, quantization="fp8")
    try:
        assert _greedy(engine) == _greedy(fresh)
    finally:
        fresh.shutdown()
    # The trainer quantized: fp8 weights with their scales are loaded as they are, into the same storage.
    engine.load_weights(list(_quantized(dirs["old"]).items()))
    assert _pointers(engine) == pointers
    assert engine.weight_checksums() == weight_checksums(_quantized(dirs["old"]).items())


def _bad_updates(dirs: dict[str, Path]) -> dict[str, list[tuple[str, torch.Tensor]]]:
    q = _quantized(dirs["new"])
    weight, scale = q[f"{Q_PROJ}.weight"], q[f"{Q_PROJ}.weight_scale_inv"]
    bf16 = _checkpoint(dirs["new"])[f"{Q_PROJ}.weight"]
    return {
        "needs its scales": [(f"{Q_PROJ}.weight", weight)],
        "scales come with their fp8 weight .* this update has no weight": [(f"{Q_PROJ}.weight_scale_inv", scale)],
        "this update has the weight in torch.float32": [
            (f"{Q_PROJ}.weight", bf16),
            (f"{Q_PROJ}.weight_scale_inv", scale),
        ],
        "weight_scale_inv': shape \\[1, 1\\] does not match the model's \\[2, 1\\]": [
            (f"{Q_PROJ}.weight", weight),
            (f"{Q_PROJ}.weight_scale_inv", torch.ones(1, 1)),
        ],
        "dtype torch.float8_e5m2 does not fit": [(f"{Q_PROJ}.weight", bf16.to(torch.float8_e5m2))],
        "model.norm.weight': dtype torch.float8_e4m3fn does not fit .* is not in FP8": [
            ("model.norm.weight", torch.ones(128).to(FP8_DTYPE))
        ],
        "weight_scale' does not exist": [(f"{Q_PROJ}.weight_scale", torch.ones(256, 1))],
    }


def test_refused_updates_change_nothing(dirs, engine: LLM) -> None:
    before, outputs = engine.weight_checksums(), _greedy(engine)
    good = [(name, t) for name, t in _checkpoint(dirs["new"]).items() if name != f"{Q_PROJ}.weight"]
    for message, update in _bad_updates(dirs).items():
        with pytest.raises(ValueError, match=message):
            engine.load_weights(good + update)  # the valid tensors before it are not written either
        assert engine.weight_checksums() == before, message
    # The same tokens (the logprobs may differ in the last bit: the second run reads the prompt from the prefix cache).
    assert engine.not_serving is None and [t for t, _ in _greedy(engine)] == [t for t, _ in outputs]


class _Tensors(WeightSource):
    """Named tensors as a trainer's WeightSource."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._tensors.items()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._tensors.items()


def _send_over_gloo(llm: LLM, source: WeightSource) -> None:
    init_info = NCCLTrainerInitInfo("127.0.0.1", free_port(), llm.get_world_size() + 1, timeout_s=TIMEOUT_S)
    trainer = WeightTransferTrainerFactory.trainer_init(init_info, client=llm, source=source)
    try:
        trainer.send_weights()
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("method", ["fp8", "fbgemm_fp8"])
def test_nccl_updates_bf16_and_trainer_quantized(dirs, make_llm, method: str) -> None:
    """Over the nccl backend (gloo on CPU): a bf16 trainer's weights, quantized by the engine; then the same trainer's
    weights quantized by the trainer (Fp8QuantizedSource); both equal the checkpoint quantized, checked by checksum."""
    llm = make_llm(dirs["old"], quantization=method, weight_transfer_config=WeightTransferConfig("nccl"))
    try:
        trainer_model = AutoModelForCausalLM.from_pretrained(str(dirs["new"]), dtype=torch.float32)
        expected = weight_checksums(quantize_checkpoint(trainer_model.state_dict().items(), Fp8Scheme(method)))
        _send_over_gloo(llm, ModuleSource(trainer_model))
        assert compare_checksums(expected, llm.weight_checksums())["match"]
        old_model = AutoModelForCausalLM.from_pretrained(str(dirs["old"]), dtype=torch.float32)
        _send_over_gloo(llm, Fp8QuantizedSource(ModuleSource(old_model), method))
        assert llm.weight_checksums() == weight_checksums(_quantized(dirs["old"], method).items())
        before = llm.weight_checksums()
        bad = dict(_quantized(dirs["new"], method))
        del bad[f"{Q_PROJ}.{Fp8Scheme(method).scale_name}"]
        with pytest.raises(ValueError, match="needs its scales"):  # refused, the bytes taken and dropped
            _send_over_gloo(llm, _Tensors(bad))
        assert llm.abandon_weight_update() == "unchanged"
        assert llm.weight_checksums() == before and llm.not_serving is None
    finally:
        llm.shutdown()


def test_sparse_update_of_fp8_weights(dirs, make_llm) -> None:
    """The sparse backend patches the served tensors: a trainer diffs its quantized weights (fp8 bytes, fp32
    scales) against the last version it sent."""
    llm = make_llm(dirs["old"], quantization="fp8", weight_transfer_config=WeightTransferConfig("sparse_nccl"))
    init_info = SparseNCCLTrainerInitInfo("127.0.0.1", free_port(), 2, timeout_s=TIMEOUT_S)
    trainer = WeightTransferTrainerFactory.trainer_init(init_info, client=llm)
    try:
        delta = SparseDelta(_quantized(dirs["old"]).items())
        gen = torch.Generator().manual_seed(0)
        moved = {
            name: torch.where(torch.rand(t.shape, generator=gen) < 0.03, t * 1.01, t)
            for name, t in _checkpoint(dirs["old"]).items()
        }
        new = dict(quantize_checkpoint(moved.items(), Fp8Scheme("fp8")))
        patches = delta.patches(new.items())
        assert any(p.values.dtype == FP8_DTYPE for p in patches)
        trainer.send_weights(patches)
        assert llm.weight_checksums() == weight_checksums(new.items())
        assert _greedy(llm)
    finally:
        trainer.shutdown()
        llm.shutdown()


def test_dummy_load_quantizes_its_random_weights(dirs, make_llm) -> None:
    """load_format dummy (a trainer sends the weights first): random values in +-1e-3, quantized with their scales."""
    llm = make_llm(dirs["old"], in_process=True, quantization="fp8", load_format="dummy")
    try:
        qkv = llm.engine_core.runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == FP8_DTYPE and qkv.weight.float().abs().max() == 448.0
        assert (qkv.weight_scale_inv > 0).all() and qkv.weight_scale_inv.max() <= 1e-3 / 448
        assert _greedy(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow  # two engines of two processes each: ~35 s on CI's two cores
@pytest.mark.parametrize("method", ["fp8", "fbgemm_fp8"])
def test_two_tensor_parallel_ranks_hold_their_parts_of_the_same_quantization(dirs, make_llm, method: str) -> None:
    """Each rank quantizes the whole checkpoint tensor and keeps its part (a per-channel scale covers the whole row,
    a block never straddles two ranks): the gathered weights are one rank's, before and after a bf16 update."""
    llm = make_llm(dirs["old"], tensor_parallel_size=2, quantization=method)
    try:
        assert llm.weight_checksums() == weight_checksums(_quantized(dirs["old"], method).items())
        llm.load_weights(list(_checkpoint(dirs["new"]).items()))  # broadcast to the other rank, which keeps its part
        assert llm.weight_checksums() == weight_checksums(_quantized(dirs["new"], method).items())
        assert _greedy(llm)
    finally:
        llm.shutdown()


# --- MoE: FP8 experts (rlserve.model.moe.FusedExperts), the CPU path of the fused MoE kernel's arithmetic ---------

EXPERT = "model.layers.0.mlp.experts.1.up_proj"


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8-moe")
    return {
        "old": make_peaked_model_dir(root / "old", preset="tiny-moe-fp8", seed=0),
        "new": make_model_dir(root / "new", preset="tiny-moe-fp8", seed=1),
    }


def test_moe_experts_in_fp8_load_update_and_refuse(moe_dirs: dict[str, Path], make_llm) -> None:
    """A Qwen3-MoE engine with FP8 experts: loaded as the checkpoint quantized (each expert's weights and block
    scales), logprobs close to the unquantized engine's, an update in the model dtype quantized in place (per-expert
    names, and transformers 5's stacked experts) equal to the new checkpoint quantized and to a fresh engine of it, the
    trainer's quantized experts loaded as they are, and a wrong expert scale refused with nothing changed."""
    old, new = moe_dirs["old"], moe_dirs["new"]
    plain = make_llm(old, in_process=True)
    try:
        reference = _greedy(plain)
    finally:
        plain.shutdown()
    llm = make_llm(old, in_process=True, quantization="fp8")
    try:
        assert compare_checksums(weight_checksums(_quantized(old).items()), llm.weight_checksums())["match"]
        got = _greedy(llm)
        diffs = torch.tensor(
            [a - b for (_, x), (_, y) in zip(got, reference, strict=True) for a, b in zip(x, y, strict=True)]
        )
        assert diffs.abs().mean() < MEAN_ABS_TOLERANCE, diffs
        pointers = _pointers(llm)
        llm.load_weights(list(_checkpoint(new).items()))
        assert _pointers(llm) == pointers
        expected = weight_checksums(_quantized(new).items())
        assert compare_checksums(expected, llm.weight_checksums())["match"]
        fresh = make_llm(new, in_process=True, quantization="fp8")
        try:
            assert _greedy(llm) == _greedy(fresh)
        finally:
            fresh.shutdown()
        quantized_old = _quantized(old)
        before = llm.weight_checksums()
        wrong = dict(quantized_old, **{f"{EXPERT}.weight_scale_inv": torch.ones(2, 1)})
        with pytest.raises(
            ValueError, match=f"{EXPERT}.weight_scale_inv': shape \\[2, 1\\] does not match .*\\[1, 1\\]"
        ):
            llm.load_weights(list(wrong.items()))
        assert llm.weight_checksums() == before
        llm.load_weights(list(quantized_old.items()))  # the trainer quantized: weights and scales as they are
        assert llm.weight_checksums() == weight_checksums(quantized_old.items())
        hf = AutoModelForCausalLM.from_pretrained(str(new))  # transformers 5: stacked experts [E, 2I, H], [E, H, I]
        stacked = [
            (n, t) for n, t in hf.state_dict().items() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
        ]
        assert stacked and all(t.dim() == 3 for _, t in stacked)
        llm.load_weights(stacked)
        assert compare_checksums(expected, llm.weight_checksums())["match"] is False  # the rest is still old
        experts_only = {n: c for n, c in expected.items() if ".experts." in n}
        assert compare_checksums(experts_only, {n: c for n, c in llm.weight_checksums().items() if n in experts_only})[
            "match"
        ]
    finally:
        llm.shutdown()


def test_block_wise_experts_need_whole_blocks(tmp_path: Path, make_llm) -> None:
    model = make_model_dir(tmp_path / "moe", preset="tiny-moe-fp8", moe_intermediate_size=96)
    with pytest.raises(ValueError, match="moe_intermediate_size is 96, hidden_size 128 .*fbgemm_fp8"):
        make_llm(model, in_process=True, quantization="fp8")
