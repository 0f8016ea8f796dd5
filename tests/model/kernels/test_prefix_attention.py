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

from prefix_batches import build_grouped_batch, reference_decode  # noqa: E402

from rlserve.model.attention.prefix_groups import find_prefix_groups  # noqa: E402
from rlserve.model.kernels.paged_attention import paged_decode_attention  # noqa: E402
from rlserve.model.kernels.prefix_attention import grouped_decode_attention  # noqa: E402

interpreted = interpret_helpers.interpreted

if not interpret_helpers.IN_PROCESS:

    def test_in_fresh_process():
        interpret_helpers.run_in_fresh_process(__file__)


TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def run_grouped(batch, scale, **splits) -> torch.Tensor:
    groups = find_prefix_groups(batch.block_tables, batch.seq_lens.tolist(), batch.k_cache.shape[1])
    starts, members = groups.group_starts.tolist(), groups.member_rows.tolist()
    found = sorted(sorted(members[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True))
    assert found == sorted(sorted(rows) for rows in batch.expected_groups)  # the path under test really groups
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype)
    result = grouped_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, scale, groups.member_rows,
        groups.group_starts, groups.shared_lens, groups.suffix_starts, groups.max_group_size, groups.max_shared_len,
        out=out, max_seq_len=256, **splits,
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
    ("dtype", "group", "head_dim", "block_size", "groups", "alone", "splits"),
    [
        # Two groups of different sizes and prefix lengths beside ungrouped rows and padding; one split each.
        (torch.float32, 2, 32, 16, [(3, 4, [1, 17, 40]), (5, 9, [3, 16, 1, 33, 7])], [70, 0, 5], (1, 1)),
        # A group larger than one prefix tile (20 members x G 4 > 64 rows), prefixes and contexts split in several.
        (torch.bfloat16, 4, 64, 32, [(20, 5, list(range(1, 41, 2))), (2, 2, [30, 64])], [100], (3, 2)),
        # G not a power of two, fp16, a 3-block prefix that is not a whole key tile; default splits.
        (torch.float16, 3, 32, 32, [(4, 3, [2, 32, 9, 50])], [1, 130], (None, None)),
    ],
)
def test_grouped_decode_equals_per_sequence(dtype, group, head_dim, block_size, groups, alone, splits):
    gen = torch.Generator().manual_seed(11)
    batch = build_grouped_batch(groups, alone, 2, group, head_dim, block_size, dtype, gen)
    scale = head_dim**-0.5
    num_splits, prefix_splits = splits
    out = run_grouped(batch, scale, num_splits=num_splits, prefix_splits=prefix_splits)
    assert_close(out, reference_decode(batch, scale), dtype)
    today = paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, scale, max_seq_len=256
    )
    assert_close(out, today.double(), dtype)
