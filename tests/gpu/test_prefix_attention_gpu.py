"""The grouped decode path (grouped_prefix_attention, issue 34) compiled on a GPU: its kernels at the benchmark
model's head shapes against today's per-sequence decode kernel, captured in a CUDA graph over fixed-capacity
metadata, and the engine's tokens and logprobs with and without it (eager and under its CUDA graphs).

The CPU interpreter tests (tests/model/kernels/test_prefix_attention.py) check the logic on tiny shapes; these check
what the compiler made of it. Written in a session without a GPU: not run yet.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.model.attention.prefix_groups import find_prefix_groups, members_per_item
from rlserve.toy import make_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("triton")  # a CPU machine without it still collects (and skips) this file

from rlserve.model.kernels.paged_attention import paged_decode_attention  # noqa: E402
from rlserve.model.kernels.prefix_attention import grouped_decode_attention  # noqa: E402

# The batch builder the interpreter tests use (tests/model/kernels is not on this directory's import path).
_spec = importlib.util.spec_from_file_location(
    "prefix_batches", Path(__file__).resolve().parents[1] / "model" / "kernels" / "prefix_batches.py"
)
prefix_batches = sys.modules.setdefault("prefix_batches", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(prefix_batches)  # registered first: its dataclass looks its module up there

HKV, D, BLOCK = 8, 128, 16
# Groups of different sizes and prefix lengths (GRPO n = 8 and 32, a 4k-token prompt, a prefix ending on a key-tile
# boundary and one not), own tokens ragged and mid-block, beside ungrouped sequences and a padding row.
GROUPS = [(8, 32, list(range(1, 257, 32))), (32, 33, list(range(3, 99, 3))), (4, 256, [1, 16, 17, 200]), (2, 8, [5, 9])]
ALONE = [700, 0, 1, 4096]


def _batch(group: int, seed: int):
    batch = prefix_batches.build_grouped_batch(
        GROUPS, ALONE, HKV, group, D, BLOCK, torch.bfloat16, torch.Generator().manual_seed(seed)
    )
    for name in ("q", "k_cache", "v_cache", "seq_lens", "block_tables"):
        setattr(batch, name, getattr(batch, name).cuda())
    return batch


def _grouped(batch, groups, **kwargs) -> torch.Tensor:
    return grouped_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, D**-0.5, groups.member_rows,
        groups.items, groups.suffix_starts, groups.members_per_item, groups.max_shared_len, **kwargs,
    )  # fmt: skip


def _groups(batch, group: int):
    host = find_prefix_groups(batch.block_tables.cpu(), batch.seq_lens.tolist(), BLOCK, members_per_item(group))
    assert host is not None and host.num_groups == len(GROUPS)
    return host.to_device(lambda t: t.cuda())


@pytest.mark.parametrize("group", [2, 4])
def test_grouped_kernels_equal_the_per_sequence_kernel(group: int) -> None:
    batch = _batch(group, seed=group)
    groups = _groups(batch, group)
    today = paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, D**-0.5, max_seq_len=8192
    )
    ref = prefix_batches.reference_decode(
        prefix_batches.DecodeBatch(*(t.cpu() if torch.is_tensor(t) else t for t in vars(batch).values())), D**-0.5
    )
    for splits in ({}, {"num_splits": 1, "prefix_splits": 1}, {"num_splits": 4, "prefix_splits": 8}):
        out = _grouped(batch, groups, max_seq_len=8192, **splits)
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), today.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_grouped_kernels_replay_in_a_cuda_graph_with_other_groups() -> None:
    """Captured once over capacity buffers (one item per sequence), replayed with a step's groups and with none."""
    batch = _batch(2, seed=5)
    capacity = batch.q.shape[0]
    member_rows = torch.zeros(capacity, dtype=torch.int32, device="cuda")
    items = torch.zeros((capacity, 3), dtype=torch.int32, device="cuda")
    suffix_starts = torch.zeros(capacity, dtype=torch.int32, device="cuda")
    out = torch.empty_like(batch.q)

    def launch() -> None:
        grouped_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, D**-0.5, member_rows, items,
            suffix_starts, members_per_item(2), 8192, out=out, max_seq_len=8192,
        )  # fmt: skip

    launch()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    today = paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, D**-0.5, max_seq_len=8192
    )
    step = _groups(batch, 2)
    for grouped in (True, False):  # the step's groups, then a step without any (every item empty)
        items.zero_()
        member_rows.zero_()
        suffix_starts.zero_()
        if grouped:
            items[: step.items.shape[0]] = step.items
            member_rows[: step.member_rows.shape[0]] = step.member_rows
            suffix_starts.copy_(step.suffix_starts)
        graph.replay()
        torch.testing.assert_close(out.float(), today.float(), atol=2e-2, rtol=2e-2)
        if grouped:
            torch.testing.assert_close(
                out.float(), _grouped(batch, step, max_seq_len=8192).float(), atol=2e-2, rtol=2e-2
            )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_model_dir(tmp_path_factory.mktemp("prefix-gpu"), preset="small", seed=3))


def test_engine_tokens_and_logprobs_equal_with_and_without_groups(model_dir: str) -> None:
    prompts = [{"prompt_token_ids": [5 + i % 250 for i in range(n)]} for n in (300, 130)]  # vocab 259
    params = SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=24, logprobs=2, ignore_eos=True)
    runs = {}
    for name, kwargs in {
        "plain": {},
        "grouped": {"grouped_prefix_attention": True},
        "grouped-eager": {"grouped_prefix_attention": True, "enforce_eager": True},
    }.items():
        llm = LLM(model_dir, dtype="float32", device="cuda", num_kv_blocks=1024, **kwargs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[name] = [(c.token_ids, c.logprobs) for o in outputs for c in o.outputs]
        llm.shutdown()
    for name in ("grouped", "grouped-eager"):
        for (tokens, logprobs), (plain_tokens, plain_logprobs) in zip(runs[name], runs["plain"], strict=True):
            assert tokens == plain_tokens, name
            for a, b in zip(logprobs, plain_logprobs, strict=True):
                for t in a:
                    assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4), name
