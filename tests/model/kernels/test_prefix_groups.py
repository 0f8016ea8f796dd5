"""CPU checks of the grouped decode path's host side and its PyTorch reference: the groups found from block tables
(random groups, ragged prefixes, block-boundary splits, divergence mid-block, a system prompt common to several
groups), the log-sum-exp merge, and the reference backend's split equal to its per-sequence attention. They sit beside
the Triton kernels' checks, whose batch builder they share; none needs Triton."""

from __future__ import annotations

import pytest
import torch
from prefix_batches import build_grouped_batch, group_rows, reference_decode

from rlserve.model.attention import AttentionMetadata
from rlserve.model.attention.prefix_groups import (
    MIN_SHARED_TOKENS,
    _best_split_of_run,
    _most_saving_groups,
    find_prefix_groups,
)
from rlserve.model.attention.torch_ref import TorchReferenceBackend, attend_with_lse, merge_partials


def found(block_tables: torch.Tensor, seq_lens: list[int], item_size: int = 64) -> list[tuple[list[int], int]]:
    """(sorted member rows, shared tokens) of each group find_prefix_groups finds, sorted ([] for None); checks that
    every item holds 1..item_size members."""
    groups = find_prefix_groups(block_tables, seq_lens, 16, item_size)
    if groups is None:
        return []
    assert all(0 < count <= item_size for _, count, _ in groups.items.tolist())
    return group_rows(groups, block_tables, 16)


@pytest.mark.parametrize("seed", range(4))
def test_random_groups_are_found_with_their_whole_shared_blocks(seed):
    gen = torch.Generator().manual_seed(seed)
    block_size = 16
    spec = []
    for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
        members = int(torch.randint(2, 9, (1,), generator=gen))
        shared = int(torch.randint(4, 12, (1,), generator=gen))  # >= MIN_SHARED_TOKENS / block_size
        spec.append((members, shared, torch.randint(1, 60, (members,), generator=gen).tolist()))  # ragged, mid-block
    alone = torch.randint(0, 200, (3,), generator=gen).tolist()
    batch = build_grouped_batch(spec, alone, 1, 1, 4, block_size, torch.float32, gen)
    item_size = int(torch.randint(1, 9, (1,), generator=gen))  # groups of up to 8 in one or several items
    groups = find_prefix_groups(batch.block_tables, batch.seq_lens.tolist(), block_size, item_size)
    expected = sorted(
        (sorted(rows), shared * block_size) for rows, (_, shared, _) in zip(batch.expected_groups, spec, strict=True)
    )
    assert found(batch.block_tables, batch.seq_lens.tolist(), item_size) == expected
    suffix_starts = [0] * batch.q.shape[0]
    for rows, shared_len in expected:
        for row in rows:
            suffix_starts[row] = shared_len
    assert groups.suffix_starts.tolist() == suffix_starts
    assert groups.num_groups == len(spec) and groups.members_per_item == item_size
    assert groups.max_shared_len == max(s for _, s in expected)


def tables(*rows: list[int], columns: int = 12) -> torch.Tensor:
    """Block tables with garbage past each row's blocks (equal in every row: it must never count as shared)."""
    out = torch.full((len(rows), columns), 999, dtype=torch.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return out


def test_divergence_mid_block_shares_the_whole_blocks_before():
    # Two samples agree on 5 blocks and 7 more tokens: the 6th block is each one's own copy (ids 6 and 7).
    table, seq_lens = tables([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7]), [5 * 16 + 9, 5 * 16 + 12]
    assert found(table, seq_lens) == [([0, 1], 80)]
    assert find_prefix_groups(table, seq_lens, 16, 64).suffix_starts.tolist() == [80, 80]


def test_a_block_counts_only_when_wholly_inside_every_context():
    # Same ids in every column, but the 5th block is not full for the first sequence (70 tokens = 4 blocks + 6).
    assert found(tables([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]), [70, 80]) == [([0, 1], 64)]
    # On a block boundary both contexts hold the 5th block whole.
    assert found(tables([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]), [80, 81]) == [([0, 1], 80)]


def test_groups_under_a_common_system_prompt_keep_their_own_prompts():
    """Two GRPO groups whose prompts start with the same 5-block system prompt (itself long enough to group on), and
    later turns of the second group's conversations (which reuse its prompt's blocks): each prompt makes its own group
    rather than one group of the system prompt, and the later turns join the group of the prompt they continue."""
    system = [1, 2, 3, 4, 5]
    first = [system + [10, 11, 12, 20 + i] for i in range(3)]
    second = [system + [30, 31, 40 + i] for i in range(2)]
    later_turn = [system + [30, 31, 50, 51, 52, 60 + i] for i in range(2)]
    rows = first + second + later_turn
    seq_lens = [len(r) * 16 - 3 for r in rows]
    expected = [([0, 1, 2], 128), ([3, 4, 5, 6], 112)]
    assert found(tables(*rows), seq_lens) == expected
    # The same rows in another order make the same groups.
    perm = [6, 2, 4, 0, 5, 3, 1]
    permuted = found(tables(*[rows[i] for i in perm]), [seq_lens[i] for i in perm])
    assert sorted((sorted(perm[i] for i in rows), shared) for rows, shared in permuted) == expected


def test_no_group_below_the_minimum_prefix_or_alone():
    short = MIN_SHARED_TOKENS // 16 - 1
    assert find_prefix_groups(tables(list(range(short)) + [50], list(range(short)) + [51]), [100, 100], 16, 8) is None
    assert find_prefix_groups(tables([1, 2, 3, 4, 5]), [80], 16, 8) is None  # one sequence
    assert find_prefix_groups(tables([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), [80, 80], 16, 8) is None  # nothing shared


def test_merge_of_disjoint_parts_equals_attention_over_all_keys():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=gen, dtype=torch.float64)
    keys, values = torch.randn(20, 2, 8, generator=gen), torch.randn(20, 2, 8, generator=gen)
    whole, whole_lse = attend_with_lse(q, keys, values, 0.3)
    parts = [attend_with_lse(q, keys[a:b], values[a:b], 0.3) for a, b in [(0, 7), (7, 7), (7, 20)]]  # one empty
    merged = merge_partials(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    torch.testing.assert_close(merged, whole, atol=1e-6, rtol=1e-6)
    assert parts[1][1].isneginf().all()
    empty = merge_partials(torch.zeros(2, 3, 4, 8), torch.full((2, 3, 4), float("-inf")))
    assert torch.equal(empty, torch.zeros(3, 4, 8))  # no keys at all: zeros, not NaN


def test_reference_backend_split_equals_its_per_sequence_attention():
    gen = torch.Generator().manual_seed(5)
    spec = [(3, 4, [1, 17, 40]), (4, 6, [16, 2, 33, 5])]
    batch = build_grouped_batch(spec, [70, 0, 5], 2, 2, 16, 16, torch.float32, gen)
    seq_lens = batch.seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=torch.full((len(seq_lens),), -1, dtype=torch.long),  # the keys are in the cache already
        cu_seqlens_q=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        max_seqlen_q=1,
        max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=seq_lens,
    )
    groups = find_prefix_groups(batch.block_tables, seq_lens, 16, 3)  # the group of 4 in two items
    assert groups is not None and groups.num_groups == 2 and groups.items.shape[0] == 3
    backend, k_new = TorchReferenceBackend(), torch.zeros(len(seq_lens), 2, 16)
    plain = backend.forward(batch.q, k_new, k_new, batch.k_cache, batch.v_cache, meta, 0.25)
    meta.prefix_groups = groups
    grouped = backend.forward(batch.q, k_new, k_new, batch.k_cache, batch.v_cache, meta, 0.25)
    ref = reference_decode(batch, 0.25).float()
    torch.testing.assert_close(grouped, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grouped, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("min_blocks", [1, 2, 4])
def test_the_numpy_cut_chooses_what_the_full_walk_chooses(min_blocks):
    """_most_saving_groups takes runs of equal sharing whole and walks only the others: it returns the groups the
    walk over the whole batch chooses (pairs sharing less than the minimum can never be inside a group). Random
    neighbour counts stand for any sorted batch (every such sequence is some sorted set of block tables')."""
    gen = torch.Generator().manual_seed(min_blocks)
    for _ in range(50):
        pairs = torch.randint(0, 8, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).numpy()
        assert _most_saving_groups(pairs, min_blocks) == _best_split_of_run(pairs.tolist(), min_blocks)
