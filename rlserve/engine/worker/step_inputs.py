"""A step's inputs on the host, gathered from the scheduler's batch, and the header that tells a follower (another
tensor-parallel rank) their sizes: rank 0 broadcasts the inputs as one tensor, which the header splits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlserve.engine.sched.batch import ScheduledRequest
from rlserve.engine.sched.request import PLACEHOLDER
from rlserve.engine.worker.block_table import BlockTableBuffer
from rlserve.model.attention.prefix_groups import PrefixGroups, find_prefix_groups


@dataclass(slots=True)
class StepInputs:
    """One step's inputs in host form, one entry per input token or per scheduled request."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_table_rows: list[int]  # each request's row in the BlockTableBuffer
    sample_rows: list[int]  # index into `scheduled` of each request that samples
    logits_indices: list[int]  # input row whose hidden state samples, per sampling request
    placeholder_rows: list[int]  # input rows whose token the previous step sampled ...
    placeholder_sources: list[int]  # ... and where it sits in that step's sampled ids
    prompt_rows: list[tuple[int, int, int]]  # (scheduled index, first hidden row, count) for prompt logprobs
    prompt_targets: list[int]  # the prompt tokens those rows predict
    lora_mapping: list[int] | None  # each input token's LoRA slot (-1: none); None when no request has an adapter

    def prefix_groups(
        self,
        host_tables: torch.Tensor,
        block_size: int,
        item_size: int | None,
        to_device: Callable[[torch.Tensor], torch.Tensor],
    ) -> PrefixGroups | None:
        """A decode step's groups of sequences that share leading KV blocks, in work items of item_size members,
        copied with `to_device`; None without item_size (grouped_prefix_attention off), for a step with a prompt
        chunk (the varlen kernel attends it) or without a group."""
        if item_size is None or len(self.input_ids) != len(self.query_lens):
            return None
        groups = find_prefix_groups(host_tables, self.seq_lens, block_size, item_size)
        return None if groups is None else groups.to_device(to_device)


@dataclass(frozen=True)
class StepHeader:
    """The sizes of one step's inputs, which a follower needs to receive them (the inputs follow as one tensor)."""

    num_tokens: int
    num_seqs: int
    block_table_columns: int
    num_logits_rows: int  # rows whose logits the step samples
    num_prompt_rows: int  # rows whose logits give prompt logprobs

    @property
    def numel(self) -> int:
        return 3 * self.num_tokens + self.num_seqs * (self.block_table_columns + 2) + self.logits_numel

    @property
    def logits_numel(self) -> int:
        return self.num_logits_rows + self.num_prompt_rows

    def unpack(self, packed: torch.Tensor) -> tuple:
        """A follower's view of the broadcast inputs: token ids, positions, slots, block tables (device tensors), and
        the query lengths, sequence lengths, logits rows and prompt-logprobs rows (host lists)."""
        n, num_seqs = self.num_tokens, self.num_seqs
        ids, pos, slots, tables, lengths = packed.split(
            (n, n, n, num_seqs * self.block_table_columns, 2 * num_seqs + self.logits_numel)
        )
        lengths = lengths.tolist()
        query_lens, seq_lens = lengths[:num_seqs], lengths[num_seqs : 2 * num_seqs]
        logits_rows = lengths[2 * num_seqs : 2 * num_seqs + self.num_logits_rows]
        prompt_rows = lengths[2 * num_seqs + self.num_logits_rows :]
        block_tables = tables.view(num_seqs, self.block_table_columns).to(torch.int32)
        return ids, pos, slots, block_tables, query_lens, seq_lens, logits_rows, prompt_rows


def follower_header(inputs: StepInputs, block_table_columns: int) -> tuple[StepHeader, list[int]]:
    """The header of a step's broadcast, and the lengths that follow its token tensors and block tables in it (query
    and sequence lengths, then the rows whose logits the followers compute with rank 0)."""
    prompt_rows = [r for _, first, count in inputs.prompt_rows for r in range(first, first + count)]
    header = StepHeader(
        len(inputs.input_ids),
        len(inputs.query_lens),
        block_table_columns,
        len(inputs.logits_indices),
        len(prompt_rows),
    )
    return header, inputs.query_lens + inputs.seq_lens + inputs.logits_indices + prompt_rows


def gather_inputs(
    scheduled: list[ScheduledRequest],
    prev_index: dict[str, int],
    block_table_buffer: BlockTableBuffer,
    block_size: int,
    num_lora_slots: int,
) -> StepInputs:
    """One pass over the scheduled requests into flat host lists (a loop per list cost more at batch 1024).
    `prev_index`: each request's row in the previous step's sampled ids, where its placeholder's token is."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    table_rows: list[int] = []
    sample_rows: list[int] = []
    logits_indices: list[int] = []
    placeholder_rows: list[int] = []
    placeholder_sources: list[int] = []
    prompt_rows: list[tuple[int, int, int]] = []
    prompt_targets: list[int] = []
    lora_mapping: list[int] | None = None
    if num_lora_slots and any(item.request.lora_slot >= 0 for item in scheduled):
        lora_mapping = [slot for item in scheduled for slot in [item.request.lora_slot] * item.num_new_tokens]
    bs = block_size
    for i, item in enumerate(scheduled):
        request, n = item.request, item.num_new_tokens
        start = request.num_computed_tokens
        first_row = len(input_ids)
        table = request.block_table
        if n == 1:  # decode: the common case, kept free of per-token loops
            token = request.all_token_ids[start]
            if token == PLACEHOLDER:
                placeholder_rows.append(first_row)
                placeholder_sources.append(prev_index[request.request_id])
            input_ids.append(token)
            positions.append(start)
            slot_mapping.append(table[start // bs] * bs + start % bs)
        else:  # prefill chunks never hold placeholders: a request samples only once its prompt is computed
            input_ids.extend(request.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        query_lens.append(n)
        seq_lens.append(start + n)
        table_rows.append(block_table_buffer.row(request))
        if start + n == request.num_tokens:
            sample_rows.append(i)
            logits_indices.append(len(input_ids) - 1)
        if request.sampling_params.prompt_logprobs is not None:
            # Hidden row for position p predicts token p + 1; only prompt targets count.
            count = max(0, min(start + n, request.num_prompt_tokens - 1) - start)
            if count:
                prompt_rows.append((i, first_row, count))
                prompt_targets.extend(request.all_token_ids[start + 1 : start + 1 + count])
    return StepInputs(
        input_ids,
        positions,
        slot_mapping,
        query_lens,
        seq_lens,
        table_rows,
        sample_rows,
        logits_indices,
        placeholder_rows,
        placeholder_sources,
        prompt_rows,
        prompt_targets,
        lora_mapping,
    )
