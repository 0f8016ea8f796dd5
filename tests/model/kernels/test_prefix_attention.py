"""CPU checks of the grouped decode kernels (rlserve.model.kernels.prefix_attention) under TRITON_INTERPRET=1: the
prefix read once per group, each sequence's own keys alone, merged by log-sum-exp, equal a float64 per-sequence
reference and today's per-sequence decode kernel, with the groups found from the block tables by the host-side
detection the engine uses. Shapes are tiny (the interpreter is slow); blocks nobody owns hold NaN, so a stray read
shows, and the output starts as NaN, so an unwritten element does too.
"""

from __future__ import annotations

import interpret_helpers  # first: sets TRITON_INTERPRET before anything imports triton
import pytest
import torch

interpret_helpers.require_triton()

from prefix_batches import build_grouped_batch, group_rows, reference_decode  # noqa: E402

from rlserve.model.attention import AttentionMetadata  # noqa: E402
from rlserve.model.attention.prefix_groups import find_prefix_groups  # noqa: E402
from rlserve.model.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from rlserve.model.attention.triton_backend import TritonBackend  # noqa: E402
from rlserve.model.kernels.paged_attention import paged_decode_attention  # noqa: E402
from rlserve.model.kernels.prefix_attention import grouped_decode_attention  # noqa: E402

interpreted = interpret_helpers.interpreted

if not interpret_helpers.IN_PROCESS:

    def test_in_fresh_process():
        interpret_helpers.run_in_fresh_process(__file__)


TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def run_grouped(batch, scale, item_size, **splits) -> torch.Tensor:
    groups = find_prefix_groups(batch.block_tables, batch.seq_lens.tolist(), batch.k_cache.shape[1], item_size)
    found = [rows for rows, _ in group_rows(groups, batch.block_tables, batch.k_cache.shape[1])]
    assert found == sorted(map(sorted, batch.expected_groups))  # the path under test really groups
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype)
    result = grouped_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, scale, groups.member_rows,
        groups.items, groups.suffix_starts, groups.members_per_item, groups.max_shared_len, out=out, max_seq_len=256,
        **splits,
    )  # fmt: skip
    assert result is out
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "some output element was not written (still NaN)"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


# Groups as (members, shared whole blocks, each member's own tokens after the prefix), then ungrouped context lengths
# (0: a padding row). Own tokens that start mid-block model a divergence mid-block: the member's copy of that block
# has its own id, so it is not shared.
@interpreted
@pytest.mark.parametrize(
    ("dtype", "group", "head_dim", "block_size", "groups", "alone", "item_size", "splits"),
    [
        # Two groups of different sizes and prefix lengths beside ungrouped rows and padding; one split each.
        (torch.float32, 2, 32, 16, [(3, 4, [1, 17, 40]), (5, 9, [3, 16, 1, 33, 7])], [70, 0, 5], 32, (1, 1)),
        # A group of 20 in two items (16 members x G 4 = 64 rows, and 4), prefixes and contexts split in several.
        (torch.bfloat16, 4, 64, 32, [(20, 5, list(range(1, 41, 2))), (2, 2, [30, 64])], [100], 16, (3, 2)),
        # G not a power of two, fp16, a 3-block prefix that is not a whole key tile, items of 3; default splits.
        (torch.float16, 3, 32, 32, [(4, 3, [2, 32, 9, 50])], [1, 130], 3, (None, None)),
    ],
)
def test_grouped_decode_equals_per_sequence(dtype, group, head_dim, block_size, groups, alone, item_size, splits):
    gen = torch.Generator().manual_seed(11)
    batch = build_grouped_batch(groups, alone, 2, group, head_dim, block_size, dtype, gen)
    scale = head_dim**-0.5
    num_splits, prefix_splits = splits
    out = run_grouped(batch, scale, item_size, num_splits=num_splits, prefix_splits=prefix_splits)
    assert_close(out, reference_decode(batch, scale), dtype)
    today = paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, scale, max_seq_len=256
    )
    assert_close(out, today.double(), dtype)


@interpreted
def test_unused_items_of_a_graph_capacity_do_nothing():
    """A CUDA graph's metadata has room for one item per sequence: the step's items first, then items of 0 members,
    which must neither write nor change anything (the unused partial slots are merged as empty)."""
    gen = torch.Generator().manual_seed(12)
    batch = build_grouped_batch([(3, 4, [1, 17, 40]), (2, 5, [9, 20])], [70, 0], 2, 2, 32, 16, torch.float32, gen)
    groups = find_prefix_groups(batch.block_tables, batch.seq_lens.tolist(), 16, 32)
    capacity = batch.q.shape[0]
    items = torch.zeros((capacity, 3), dtype=torch.int32)
    items[: groups.items.shape[0]] = groups.items
    members = torch.zeros(capacity, dtype=torch.int32)
    members[: groups.member_rows.shape[0]] = groups.member_rows
    out = grouped_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, 0.2, members, items,
        groups.suffix_starts, 32, 256, max_seq_len=256,
    )  # fmt: skip
    assert_close(out, reference_decode(batch, 0.2), torch.float32)


@interpreted
def test_the_triton_backend_runs_the_groups_it_is_given():
    """The backend the engine uses on CUDA takes AttentionMetadata.prefix_groups to the grouped kernels, and equals the
    CPU reference backend's split of the same step."""
    gen = torch.Generator().manual_seed(13)
    batch = build_grouped_batch([(3, 4, [1, 17, 40]), (2, 5, [9, 20])], [70, 0], 2, 2, 32, 16, torch.float32, gen)
    seq_lens = batch.seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=torch.full((len(seq_lens),), -1, dtype=torch.long),  # the keys are in the cache already
        cu_seqlens_q=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        max_seqlen_q=1,
        max_seq_len=256,
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=seq_lens,
        prefix_groups=find_prefix_groups(batch.block_tables, seq_lens, 16, 2),  # items of 2: the group of 3 in two
    )
    k_new = torch.zeros(len(seq_lens), 2, 32)
    out = TritonBackend().forward(batch.q, k_new, k_new, batch.k_cache, batch.v_cache, meta, 0.3)
    expected = TorchReferenceBackend().forward(batch.q, k_new, k_new, batch.k_cache, batch.v_cache, meta, 0.3)
    assert_close(out, expected, torch.float32)
    assert_close(out, reference_decode(batch, 0.3), torch.float32)
