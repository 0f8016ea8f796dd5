"""Decode batches whose sequences share leading KV blocks as prefix caching makes them share (the checks of the
grouped decode path, CPU reference and Triton kernels alike, build theirs here), and a float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeBatch:
    q: torch.Tensor  # [B, Hq, D]: each sequence's one query
    k_cache: torch.Tensor  # NaN in the blocks no sequence owns
    v_cache: torch.Tensor
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, columns] int32; unused columns hold garbage that must never be read
    expected_groups: list[list[int]]  # the rows of each group, as built


def build_grouped_batch(
    groups: list[tuple[int, int, list[int]]],
    alone: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> DecodeBatch:
    """groups: (members, shared whole blocks, each member's own context tokens after them); alone: the context
    lengths of sequences in no group (0: padding). Rows are interleaved (a group's members are not neighbours) and
    physical blocks shuffled, as a running engine's are."""
    # (group index or -1, shared blocks, own tokens) per row
    rows_spec = [(g, shared, own) for g, (_, shared, owns) in enumerate(groups) for own in owns]
    rows_spec += [(-1, 0, length) for length in alone]
    perm_rows = torch.randperm(len(rows_spec), generator=gen).tolist()
    specs = [rows_spec[i] for i in perm_rows]
    prefix_blocks = [shared for _, shared, _ in groups]
    own_blocks = [-(-(shared * block_size + own) // block_size) - shared for _, shared, own in specs]
    num_blocks = sum(prefix_blocks) + sum(own_blocks) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    prefix_ids = []
    for count in prefix_blocks:
        prefix_ids.append(ids[:count])
        ids = ids[count:]
    columns = max(shared + own for shared, own in zip([s for _, s, _ in specs], own_blocks, strict=True)) + 2
    block_tables = torch.randint(10**6, 2 * 10**6, (len(specs), columns), generator=gen, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    seq_lens, expected = [], [[] for _ in groups]
    for row, ((g, shared, own), extra) in enumerate(zip(specs, own_blocks, strict=True)):
        table = (prefix_ids[g] if g >= 0 else []) + ids[:extra]
        ids = ids[extra:]
        block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        seq_lens.append(shared * block_size + own)
        if g >= 0:
            expected[g].append(row)
    unowned = torch.tensor(ids, dtype=torch.long)  # the 3 blocks left over
    k_cache[unowned] = float("nan")
    v_cache[unowned] = float("nan")
    q = torch.randn(len(specs), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return DecodeBatch(q, k_cache, v_cache, torch.tensor(seq_lens, dtype=torch.int32), block_tables, expected)


def reference_decode(batch: DecodeBatch, scale: float) -> torch.Tensor:
    """float64 attention of each sequence's query over its whole context; zeros for padding rows."""
    batch_size, num_heads, head_dim = batch.q.shape
    block_size, num_kv_heads = batch.k_cache.shape[1], batch.k_cache.shape[2]
    out = torch.zeros(batch_size, num_heads, head_dim, dtype=torch.float64)
    for row, seq_len in enumerate(batch.seq_lens.tolist()):
        if seq_len == 0:
            continue
        blocks = batch.block_tables[row, : -(-seq_len // block_size)].long()
        keys = batch.k_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(num_heads // num_kv_heads, 1)
        values = batch.v_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(num_heads // num_kv_heads, 1)
        scores = torch.einsum("hd,khd->hk", batch.q[row].double(), keys) * scale
        out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
    return out


def group_rows(groups, block_tables: torch.Tensor, block_size: int) -> list[tuple[list[int], int]]:
    """(sorted batch rows, shared tokens) of each group of a PrefixGroups, sorted: its items' members together (the
    items of one group are those whose members hold the same prefix blocks)."""
    members, by_prefix = groups.member_rows.tolist(), {}
    for first, count, shared_len in groups.items.tolist():
        rows = members[first : first + count]
        prefix = tuple(block_tables[rows[0], : shared_len // block_size].tolist())
        assert all(tuple(block_tables[r, : shared_len // block_size].tolist()) == prefix for r in rows)
        by_prefix.setdefault(prefix, []).extend(rows)
    return sorted((sorted(rows), len(prefix) * block_size) for prefix, rows in by_prefix.items())
