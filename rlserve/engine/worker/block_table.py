"""Block tables of the scheduled requests kept in one host tensor, updated only where a request gained blocks.

Rebuilding a padded [batch, blocks] table from Python lists every step costs milliseconds at batch 1024; here each
request owns a row, new block ids are appended as they are allocated, and a step gathers its rows in one index op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlserve.engine.sched.request import Request


@dataclass
class _Row:
    index: int
    num_synced: int
    num_preemptions: int


class BlockTableBuffer:
    def __init__(self, max_blocks_per_seq: int, initial_rows: int) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.table = torch.zeros((initial_rows, max_blocks_per_seq), dtype=torch.int32)
        self.rows: dict[str, _Row] = {}
        self.free_rows = list(range(initial_rows - 1, -1, -1))

    def row(self, request: Request) -> int:
        entry = self.rows.get(request.request_id)
        if entry is None:
            if not self.free_rows:
                self._grow()
            entry = self.rows[request.request_id] = _Row(self.free_rows.pop(), 0, request.num_preemptions)
        elif entry.num_preemptions != request.num_preemptions:  # preemption replaced its blocks
            entry.num_synced, entry.num_preemptions = 0, request.num_preemptions
        table = request.block_table
        if len(table) > entry.num_synced:
            self.table[entry.index, entry.num_synced : len(table)] = torch.tensor(
                table[entry.num_synced :], dtype=torch.int32
            )
            entry.num_synced = len(table)
        return entry.index

    def release(self, request_id: str) -> None:
        entry = self.rows.pop(request_id, None)
        if entry is not None:
            self.free_rows.append(entry.index)

    def gather(self, rows: list[int], num_blocks: int) -> torch.Tensor:
        out = torch.empty((len(rows), num_blocks), dtype=torch.int32)
        torch.index_select(self.table[:, :num_blocks], 0, torch.tensor(rows), out=out)
        return out

    def _grow(self) -> None:
        old = self.table.shape[0]
        self.table = torch.cat([self.table, torch.zeros_like(self.table)])
        self.free_rows.extend(range(2 * old - 1, old - 1, -1))
