"""CUDA graphs for decode steps: one graph per batch-size bucket (two with grouped_prefix_attention: today's decode
and the grouped one), replayed with padded static inputs.

Padding rows write nowhere (slot -1) and attend to nothing (seq_len 0). Graphs read the model's parameters by address,
so weight updates must write in place (the loader does) and the graphs stay valid across updates. The LM head and the
sampler run outside the graph.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from rlserve.model.attention.base import AttentionBackend, AttentionMetadata
from rlserve.model.attention.prefix_groups import PrefixGroups
from rlserve.model.lora import lora_mask
from rlserve.model.models.llama import DecoderForCausalLM, ForwardContext


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(320, max_batch_size + 64, 64))
    return sorted({min(s, max_batch_size) for s in sizes})


class DecodeCUDAGraphs:
    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        max_batch_size: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: torch.device,
        routed_experts: torch.Tensor | None = None,
        num_lora_slots: int = 0,
        prefix_members_per_item: int | None = None,
    ) -> None:
        """routed_experts: the buffer a MoE model records its routing in (ForwardContext.routed_experts), if any.
        num_lora_slots: the model's adapter slots (enable_lora), if any: each token's slot is then an input too,
        and the graphs compute its mask (a token of slot -1, padding included, adds nothing).
        prefix_members_per_item: set (grouped_prefix_attention), each batch size also gets a graph of the grouped
        decode path, whose groups are inputs of fixed capacity (PrefixGroups' items, at most one per sequence)."""
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        n = max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.lora_mapping = torch.full((n,), -1, dtype=torch.long, device=device) if num_lora_slots else None
        self.prefix_groups: PrefixGroups | None = None
        if prefix_members_per_item is not None:
            zeros = torch.zeros(n, dtype=torch.int32, device=device)
            items = torch.zeros((n, 3), dtype=torch.int32, device=device)
            # max_shared_len: the context limit bounds every prefix, so one prefix split count serves every replay.
            self.prefix_groups = PrefixGroups(zeros, items, zeros.clone(), prefix_members_per_item, max_seq_len, 0)
        dtype = model.lm_head.weight.dtype
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        # torch.cuda.graph's default capture stream is created once per process, on whichever device was current
        # then: an engine on another GPU needs a stream of its own device.
        capture_stream = torch.cuda.Stream(device)
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
                for grouped in (False, True) if self.prefix_groups is not None else (False,):
                    ctx = ForwardContext(self._metadata(bs, grouped), kv_caches, backend, routed_experts)

                    def forward(bs: int = bs, ctx: ForwardContext = ctx) -> torch.Tensor:
                        if self.lora_mapping is not None:  # computed inside the graph from the slot input
                            ctx.lora_mask = lora_mask(self.lora_mapping[:bs], num_lora_slots, dtype)
                        return model(self.input_ids[:bs], self.positions[:bs], ctx)

                    forward()  # compile kernels outside the capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                        hidden = forward()
                    self.graphs[bs, grouped] = (graph, hidden)
        torch.cuda.synchronize(device)

    def _metadata(self, bs: int, grouped: bool) -> AttentionMetadata:
        groups = self.prefix_groups
        if grouped:
            groups = dataclasses.replace(
                groups,
                member_rows=groups.member_rows[:bs],
                items=groups.items[:bs],
                suffix_starts=groups.suffix_starts[:bs],
            )
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_seqlen_q=1,
            max_seq_len=self.max_seq_len,
            prefix_groups=groups if grouped else None,
        )

    def fits(self, num_seqs: int, prefix_groups: PrefixGroups | None) -> bool:
        """Whether a decode step of num_seqs sequences (with these groups, if any) has a graph."""
        return num_seqs <= self.max_batch_size and (prefix_groups is None or self.prefix_groups is not None)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        lora_mapping: torch.Tensor | None = None,
        prefix_groups: PrefixGroups | None = None,
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        if self.lora_mapping is not None:
            if lora_mapping is None:
                self.lora_mapping[:bs].fill_(-1)
            else:
                self.lora_mapping[:n].copy_(lora_mapping, non_blocking=True)
                self.lora_mapping[n:bs].fill_(-1)
        if prefix_groups is not None:
            self._copy_groups(prefix_groups, n, bs)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(0)
        graph, hidden = self.graphs[bs, prefix_groups is not None]
        graph.replay()
        return hidden[:n]

    def _copy_groups(self, groups: PrefixGroups, n: int, bs: int) -> None:
        """The step's groups into the graph's inputs: its items (at most one per sequence, so they fit), then items of
        no member up to the graph's capacity."""
        static = self.prefix_groups
        num_items, num_members = groups.items.shape[0], groups.member_rows.shape[0]
        static.items[:num_items].copy_(groups.items, non_blocking=True)
        static.items[num_items:bs].fill_(0)
        static.member_rows[:num_members].copy_(groups.member_rows, non_blocking=True)
        static.suffix_starts[:n].copy_(groups.suffix_starts, non_blocking=True)
        static.suffix_starts[n:bs].fill_(0)
