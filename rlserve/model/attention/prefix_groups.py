"""Decode sequences that share leading KV blocks, found on the host from a step's block tables.

Prefix caching gives the samples of one prompt (a GRPO group) the same physical blocks for their prompt, and a
conversation's later turns the blocks of its earlier ones. Attention can then read such a shared prefix once per step
for the whole group (Hydragen's decomposition: the prefix attended as one matmul over the group's queries, each
sequence's own blocks after it alone, the two merged by log-sum-exp) instead of once per sequence.

Only whole blocks are shared: two sequences whose contexts diverge mid-block hold different copies of that block,
so their block ids differ there and the shared prefix ends at the whole blocks before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# A group's prefix is worth reading once only when the bytes it saves outweigh what the split adds. Per layer and kv
# head, each member but one no longer reads the prefix's K and V (bf16: 4D bytes per token); every member writes two
# partial results per query head instead of one output (prefix and suffix: fp32 output and lse, ~4D bytes each) which
# the merge reads back, ~16D * G bytes per member. Grouping m members pays from prefix_len >= 4G * m / (m - 1)
# tokens on: at most 8G, 64 tokens for G = 8 (Qwen3-30B-A3B's 32 / 4; Qwen3-0.6B to 8B have 2 to 4). The extra
# kernel launch per layer (a few microseconds) is paid only by steps that have a group at all. A floor from bytes,
# not a tuned figure: the GPU measurement of issue 34 is pending.
MIN_SHARED_TOKENS = 64


# Query rows of one prefix tile in the Triton kernel: members x G query heads. 64 rows make the prefix a real matmul
# (a decode tile has 16 rows, mostly empty) while keeping a 128-dim head's fp32 accumulator at 32 KB per program.
PREFIX_TILE_ROWS = 64


def members_per_item(query_heads_per_kv_head: int) -> int:
    """How many members one work item (one prefix tile) holds: a group larger than that is several items, each
    reading the group's prefix once."""
    return max(1, PREFIX_TILE_ROWS // query_heads_per_kv_head)


@dataclass(frozen=True)
class PrefixGroups:
    """One decode step's groups: each a set of batch rows whose first shared_len context tokens sit in the same
    physical blocks, cut into work items of at most `members_per_item` members (one prefix tile each). Tensors are
    int32, on the host when built and on the step's device after `to_device`; a CUDA graph's copies are longer
    (capacity), their unused items holding 0 members."""

    member_rows: torch.Tensor  # [num_members] batch rows of the grouped sequences, item after item
    items: torch.Tensor  # [num_items, 3]: (first index in member_rows, member count, shared_len in tokens)
    suffix_starts: torch.Tensor  # [batch] first context position a sequence attends to alone (0: ungrouped)
    members_per_item: int
    max_shared_len: int  # a host bound on shared_len
    num_groups: int

    def to_device(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> PrefixGroups:
        """The same groups with each tensor passed through `copy` (the runner's host-to-device copy)."""
        return dataclasses.replace(
            self, member_rows=copy(self.member_rows), items=copy(self.items), suffix_starts=copy(self.suffix_starts)
        )


def find_prefix_groups(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    block_size: int,
    item_size: int,
    min_shared_tokens: int = MIN_SHARED_TOKENS,
) -> PrefixGroups | None:
    """Group a decode step's sequences by the leading whole blocks their block tables share; None when no group of
    two or more shares at least `min_shared_tokens` (the step then takes the per-sequence path unchanged).

    block_tables: the step's [batch, columns] host table; seq_lens: each sequence's context length after this step's
    key is stored; item_size: the members of one work item (members_per_item). A block counts only when it lies
    wholly inside every member's context. Rows are sorted by their block ids, so that sequences sharing a prefix are
    neighbours, and cut into the groups that save the most reads (_most_saving_groups). Each sequence is in at most
    one group: one shared prefix per sequence.
    """
    batch = len(seq_lens)
    whole_blocks = np.asarray(seq_lens, dtype=np.int64) // block_size
    width = min(int(whole_blocks.max(initial=0)), block_tables.shape[1])
    min_blocks = -(-min_shared_tokens // block_size)
    if batch < 2 or width < min_blocks:
        return None
    # Past a row's whole blocks, and in one column past them all, a value no other row holds (block ids are >= 0):
    # no shared prefix runs on through it, and every pair of rows differs somewhere.
    table = np.empty((batch, width + 1), dtype=np.int32)
    table[:, :width] = block_tables[:, :width].numpy()
    table[np.arange(width + 1)[None, :] >= whole_blocks[:, None]] = -1
    table -= np.where(table < 0, np.arange(batch, dtype=np.int32)[:, None], 0)
    # Sorting the rows as byte strings puts rows with equal leading blocks next to each other (the order among
    # different rows does not matter), at a fraction of a lexsort's cost on long tables.
    order = np.argsort(table.view(np.dtype((np.void, table.itemsize * (width + 1)))).ravel())
    ordered = table[order]
    neighbour_shared = np.argmin(ordered[1:] == ordered[:-1], axis=1)  # leading equal blocks of each sorted pair
    runs = _most_saving_groups(neighbour_shared, min_blocks)
    if not runs:
        return None
    return _pack(order, np.array(runs, dtype=np.int64).reshape(-1, 3), batch, block_size, item_size)


def _most_saving_groups(neighbour_shared: np.ndarray, min_blocks: int) -> list[tuple[int, int, int]]:
    """(first, last, shared blocks) of the groups, as runs of the sorted rows, that save the most block reads.

    Rows whose neighbours share fewer than min_blocks never group across that pair, which cuts the batch into
    independent runs; a run whose neighbours all share the same count is one group (a GRPO group's samples, the
    common case, found without a Python loop over rows); any other run is chosen by _best_split_of_run."""
    cut = np.flatnonzero(neighbour_shared < min_blocks)
    firsts, lasts = np.r_[0, cut + 1], np.r_[cut, len(neighbour_shared)]
    keep = lasts > firsts  # a run of at least two rows
    firsts, lasts = firsts[keep], lasts[keep]
    if not len(firsts):
        return []
    bounds = np.column_stack([firsts, lasts]).ravel()  # each run's pairs are neighbour_shared[first:last]
    padded = np.append(neighbour_shared, 0)
    lows = np.minimum.reduceat(padded, bounds)[::2]
    highs = np.maximum.reduceat(padded, bounds)[::2]
    groups = []
    for first, last, low, high in zip(firsts.tolist(), lasts.tolist(), lows.tolist(), highs.tolist(), strict=True):
        if low == high:
            groups.append((first, last, low))
        else:
            run = neighbour_shared[first:last].tolist()
            groups += [(first + a, first + b, shared) for a, b, shared in _best_split_of_run(run, min_blocks)]
    return groups


def _best_split_of_run(neighbour_shared: list[int], min_blocks: int) -> list[tuple[int, int, int]]:
    """The groups (first, last, shared blocks) of one run of sorted rows that save the most block reads.

    neighbour_shared[i]: the leading blocks sorted rows i and i + 1 share. A run of rows shares the smallest of its
    neighbours' counts, m; grouped at m it saves (rows - 1) * m reads (only when m >= min_blocks). Otherwise it splits
    where its neighbours share just m, into runs that each choose alike (a row alone saves nothing). So a system
    prompt common to many GRPO groups does not swallow them (each group keeps its whole prompt), while later turns of
    a conversation join the group of the turn they continue where that saves more. The choice depends only on which
    rows share what, not on the order of the sort. Runs are visited children first, on an explicit stack (nesting is
    as deep as a context has blocks)."""
    best: dict[tuple[int, int], tuple[int, list[tuple[int, int, int]]]] = {}
    children: dict[tuple[int, int], list[tuple[int, int]]] = {}
    stack = [(0, len(neighbour_shared))]
    while stack:
        run = stack[-1]
        first, last = run
        shared = min(neighbour_shared[first:last])
        if run not in children:
            splits = [i for i in range(first, last) if neighbour_shared[i] == shared]
            bounds = zip([first] + [i + 1 for i in splits], splits + [last], strict=True)
            children[run] = [(a, b) for a, b in bounds if b > a]
            stack.extend(children[run])
            continue
        stack.pop()
        split_saving = sum(best[child][0] for child in children[run])
        one_saving = (last - first) * shared if shared >= min_blocks else 0
        if one_saving and one_saving >= split_saving:
            best[run] = (one_saving, [(first, last, shared)])
        else:
            best[run] = (split_saving, [group for child in children[run] for group in best[child][1]])
    return best[(0, len(neighbour_shared))][1]


def _pack(order: np.ndarray, runs: np.ndarray, batch: int, block_size: int, item_size: int) -> PrefixGroups:
    """The groups' tensors from their runs [G, 3] (first, last, shared blocks) over the rows sorted by `order`."""
    sizes = runs[:, 1] - runs[:, 0] + 1
    shared_lens = runs[:, 2] * block_size
    starts = np.cumsum(sizes) - sizes  # each group's first index in member_rows
    member_rows = order[np.arange(sizes.sum()) - np.repeat(starts - runs[:, 0], sizes)]
    suffix_starts = np.zeros(batch, dtype=np.int32)
    suffix_starts[member_rows] = np.repeat(shared_lens, sizes)
    # Each group in items of item_size members, the last one holding the rest.
    item_counts = -(-sizes // item_size)
    item_group = np.repeat(np.arange(len(runs)), item_counts)
    within = (np.arange(item_counts.sum()) - np.repeat(np.cumsum(item_counts) - item_counts, item_counts)) * item_size
    items = np.column_stack(
        [starts[item_group] + within, np.minimum(item_size, sizes[item_group] - within), shared_lens[item_group]]
    )
    return PrefixGroups(
        member_rows=torch.from_numpy(member_rows.astype(np.int32)),
        items=torch.from_numpy(items.astype(np.int32)),
        suffix_starts=torch.from_numpy(suffix_starts),
        members_per_item=item_size,
        max_shared_len=int(shared_lens.max()),
        num_groups=len(runs),
    )
