"""Tensor parallel on CPU (gloo): two ranks give the tokens and fp32 logprobs of one, weight updates reach every rank
(or, refused, none), and tensor parallel composes with data parallel."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlserve import LLM, RequestOutput, SamplingParams
from rlserve.config import WeightTransferConfig
from rlserve.engine.wire.process import free_port
from rlserve.engine.worker.tracing import STEP_RANGE
from rlserve.model.layers import ParallelLMHead, QKVParallelLinear, RowParallelLinear
from rlserve.model.parallel import TensorParallelGroup
from rlserve.weight_transfer import (
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
    weight_checksums,
)

ARCHITECTURES = ("llama", "qwen2", "qwen3")
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]}, "hello world"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
EXTENSION = "worker_extension:CheckpointLoader"
TIMEOUT_S = 60.0


class _Engines:
    """Engines made on first use and shared by the module's tests, shut down at its end."""

    def __init__(self, make: Callable[[str], LLM]) -> None:
        self.make = make
        self.engines: dict[str, LLM] = {}

    def __getitem__(self, key: str) -> LLM:
        if key not in self.engines:
            self.engines[key] = self.make(key)
        return self.engines[key]

    def close(self) -> None:
        for llm in self.engines.values():
            llm.shutdown()


@pytest.fixture(scope="module")
def reference(model_dirs, make_llm) -> Iterator[Callable[[str], list[RequestOutput]]]:
    """A one-rank engine's outputs for each toy checkpoint (its name, or a directory)."""
    cache: dict[str, list[RequestOutput]] = {}

    def outputs(model: str) -> list[RequestOutput]:
        if model not in cache:
            llm = make_llm(model_dirs.get(model, model), in_process=True, dtype="float32")
            cache[model] = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            llm.shutdown()
        return cache[model]

    yield outputs


@pytest.fixture(scope="module")
def tp2(model_dirs, make_llm, tmp_path_factory) -> Iterator[_Engines]:
    def make(name: str) -> LLM:
        extra = {}
        if name == "qwen3":  # the one the weight-update and profiling tests use
            extra = dict(weight_transfer_config=WeightTransferConfig(backend="nccl"), worker_extension_cls=EXTENSION)
            traces = tmp_path_factory.mktemp("tp-traces")
            extra["profiler_config"] = {
                "profiler": "torch",
                "torch_profiler_dir": str(traces),
                "torch_profiler_use_gzip": False,
            }
        if name == "qwen2":  # the fp32 LM head (a copy of each rank's part) is gathered like the other
            extra = dict(lm_head_dtype="float32")
        return make_llm(model_dirs[name], tensor_parallel_size=2, dtype="float32", **extra)

    engines = _Engines(make)
    yield engines
    engines.close()


def assert_same_outputs(got: list[RequestOutput], expected: list[RequestOutput], tol: float = 1e-5) -> None:
    for g, e in zip(got, expected, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for lps_g, lps_e in zip(g.outputs[0].logprobs, e.outputs[0].logprobs, strict=True):
            assert lps_g.keys() == lps_e.keys()
            assert all(abs(lps_g[t].logprob - lps_e[t].logprob) <= tol for t in lps_e)
        for lps_g, lps_e in zip(g.prompt_logprobs[1:], e.prompt_logprobs[1:], strict=True):
            assert lps_g.keys() == lps_e.keys()
            assert all(abs(lps_g[t].logprob - lps_e[t].logprob) <= tol for t in lps_e)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_two_ranks_give_the_tokens_and_logprobs_of_one(name, tp2, reference) -> None:
    llm = tp2[name]
    assert llm.get_world_size() == 2
    assert_same_outputs(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference(name))


def test_each_rank_holds_its_heads_and_vocabulary() -> None:
    """Four ranks over two kv heads: each kv head on two ranks (vLLM's replication); q heads and o_proj's input split
    four ways; the vocabulary (10 rows) padded to 3 rows a rank, the last rank holding one."""
    head_dim, hidden = 2, 8
    full = torch.arange(8 * 2 * 3 * hidden, dtype=torch.float32).view(-1, hidden)
    q, k, v = full[:8], full[8:12], full[12:16]  # 4 q heads, 2 kv heads of 2 rows each
    o = torch.arange(hidden * 8, dtype=torch.float32).view(hidden, 8)
    vocab = torch.arange(10 * hidden, dtype=torch.float32).view(10, hidden)
    for rank in range(4):
        tp = TensorParallelGroup(rank, 4)
        qkv = QKVParallelLinear(hidden, head_dim, 4, 2, bias=False, tp=tp)
        assert (qkv.num_heads, qkv.num_kv_heads, qkv.weight.shape[0]) == (1, 1, 6)
        for shard, tensor in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            qkv.weight_loader(qkv.weight, tensor, shard)
        kv_head = rank // 2
        assert torch.equal(qkv.weight.data[:2], q[2 * rank : 2 * rank + 2])
        assert torch.equal(qkv.weight.data[2:4], k[2 * kv_head : 2 * kv_head + 2])
        assert torch.equal(qkv.weight.data[4:], v[2 * kv_head : 2 * kv_head + 2])
        o_proj = RowParallelLinear(8, hidden, bias=True, tp=tp)
        o_proj.weight_loader(o_proj.weight, o)
        assert torch.equal(o_proj.weight.data, o[:, 2 * rank : 2 * rank + 2])
        assert o_proj.shard_slice("bias", None, rank).length is None  # replicated, added by rank 0 alone
        head = ParallelLMHead(10, hidden, tp)
        head.weight.data.zero_()
        head.weight_loader(head.weight, vocab)
        rows = min(3, 10 - 3 * rank)
        assert torch.equal(head.weight.data[:rows], vocab[3 * rank : 3 * rank + rows])
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        QKVParallelLinear(hidden, head_dim, 4, 2, bias=False, tp=TensorParallelGroup(0, 3))


def _update_info(weights: dict[str, torch.Tensor]) -> dict:
    return dict(
        names=list(weights),
        dtype_names=[str(t.dtype).removeprefix("torch.") for t in weights.values()],
        shapes=[list(t.shape) for t in weights.values()],
        packed=True,
        packed_buffer_size_bytes=1 << 16,
    )


def _nccl_update(llm: LLM, weights: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    """A trainer (rank 0, a thread here) sends `sent` to both engine ranks (1 and 2) while the engine is told to
    expect `weights`; joins first, as trainers do once per run."""
    port = free_port()
    info = dict(master_address="127.0.0.1", master_port=port, world_size=1 + llm.get_world_size(), rank_offset=1)
    with ThreadPoolExecutor(1) as pool:
        group = pool.submit(NCCLWeightTransferEngine.trainer_init, {**info, "timeout_s": TIMEOUT_S})
        llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        args = NCCLTrainerSendWeightsArgs(group=group.result(TIMEOUT_S), packed=True, packed_buffer_size_bytes=1 << 16)
        send = pool.submit(NCCLWeightTransferEngine.trainer_send_weights, iter(sent.items()), args)
        llm.start_weight_update()
        try:
            llm.update_weights(WeightTransferUpdateRequest(update_info=_update_info(weights)))
            llm.finish_weight_update(weight_version="new")
        finally:
            send.result(TIMEOUT_S)  # the trainer's broadcasts completed: every rank took them (kept or dropped)
            args.group.shutdown()


def test_weight_updates_reach_every_rank_or_none(tp2, reference, model_dirs, qwen3_alt_dir: Path) -> None:
    llm = tp2["qwen3"]
    original = load_file(str(model_dirs["qwen3"] / "model.safetensors"))
    new = load_file(str(qwen3_alt_dir / "model.safetensors"))
    # Checksums are of the whole tensors, put together from both ranks' parts: equal to the checkpoint's.
    assert llm.weight_checksums() == weight_checksums(original.items())
    assert [d["rank"] for d in llm.collective_rpc("describe")] == [0, 1]
    assert llm.collective_rpc("transfer_backend") == [None, None]  # no trainer has joined yet

    # A wrong shape is refused before any rank writes: the trainer's broadcast is taken and dropped by both.
    bad = {name: t[:-1] if name.endswith("q_proj.weight") else t for name, t in new.items()}
    with pytest.raises(ValueError, match="q_proj.weight"):
        _nccl_update(llm, bad, sent=bad)
    llm.abandon_weight_update()
    assert llm.weight_checksums() == weight_checksums(original.items())
    assert_same_outputs(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference("qwen3"))

    # A full update: each rank keeps its part of every broadcast bucket; the engine then is the new checkpoint's.
    _nccl_update(llm, new, sent=new)
    assert llm.weight_checksums() == weight_checksums(new.items())
    # What a worker extension reads as vLLM's `weight_transfer_engine`: each rank's own, joined to the trainer's group.
    assert llm.collective_rpc("transfer_backend") == ["NCCLWeightTransferEngine"] * 2
    assert_same_outputs(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference(str(qwen3_alt_dir)))

    # Tensors from the front end (load_weights) reach the other rank by a broadcast; a wrong one changes no rank.
    with pytest.raises(ValueError, match="shape"):
        llm.load_weights([("model.norm.weight", torch.ones(3))])
    llm.load_weights(list(original.items()))
    assert llm.weight_checksums() == weight_checksums(original.items())
    # Sleep and wake move every rank's weights out and back.
    llm.sleep(level=1)
    llm.wake_up()
    assert_same_outputs(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference("qwen3"))


def test_profiling_traces_every_rank_for_the_steps_asked(tp2) -> None:
    """LLM.start_profile reaches the follower rank's process too: one trace per rank, named by rank; the session
    skips delay_iterations steps and traces max_iterations of them."""
    llm = tp2["qwen3"]
    traces = Path(llm.config.profiler_config.torch_profiler_dir)
    with pytest.raises(ValueError, match="^profile_prefix must be 1-128 ASCII characters"):
        llm.start_profile("../elsewhere")
    llm.start_profile("tp", delay_iterations=1, max_iterations=2)
    llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)  # 8 steps
    llm.stop_profile()
    names = sorted(p.name for p in traces.iterdir())
    assert [n.split(".")[0] for n in names] == [f"tp_dp0_pp0_tp{r}_dcp0_ep{r}_rank{r}" for r in (0, 1)]
    rank0, rank1 = (json.loads((traces / n).read_text())["traceEvents"] for n in names)
    steps = [e for e in rank0 if e.get("name", "").startswith(STEP_RANGE)]
    assert len(steps) == 2 and {e["pid"] for e in steps} == {llm.client.process.pid}
    follower_pids = {e["pid"] for e in rank1 if isinstance(e.get("pid"), int) and e.get("ph") == "X"}
    assert len(follower_pids) == 1 and follower_pids.isdisjoint({llm.client.process.pid, os.getpid()})


def test_tensor_parallel_within_data_parallel_batch_invariant(model_dirs, make_llm, reference) -> None:
    """TP=2 x DP=2 in lockstep and batch-invariant mode: the TP=1 engine's tokens, and a request's bits alike alone,
    in a batch of others and run again. A lone request's idle core runs dummy steps on both its ranks (rank 0's
    all-reduces would wait forever for a rank that skipped them)."""
    llm = make_llm(
        model_dirs["llama"],
        tensor_parallel_size=2,
        data_parallel_size=2,
        data_parallel_lockstep=True,
        dtype="float32",
        batch_invariant=True,
    )
    try:
        assert (llm.get_world_size(), llm.get_world_size(include_dp=False)) == (4, 2)
        alone = llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
        many = llm.generate(PROMPTS * 4, PARAMS, use_tqdm=False)  # requests spread over both cores
        assert_same_outputs(many, reference("llama") * 4)
        for out in [*many[::2], *llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)]:
            assert out.outputs[0].token_ids == alone[0].outputs[0].token_ids
            assert out.outputs[0].logprobs == alone[0].outputs[0].logprobs  # the same bits
        assert llm.stats()["num_dummy_steps"] > 0
    finally:
        llm.shutdown()


def test_a_model_that_does_not_split_is_refused_by_name(model_dirs, make_llm) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        make_llm(model_dirs["llama"], tensor_parallel_size=0)
    # Three ranks cannot share the toy's two kv heads: refused as the ranks build the model, and they all stop.
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 ranks cannot share 2 kv heads"):
        make_llm(model_dirs["llama"], in_process=True, tensor_parallel_size=3)
