"""Turns a scheduled batch into tensors, runs the model over the paged KV cache and samples."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np
import torch

from rlserve.config import EngineConfig
from rlserve.dtypes import dtype_from_name, dtype_name
from rlserve.engine.sched.batch import ScheduledRequest
from rlserve.engine.sched.request import PLACEHOLDER, Request
from rlserve.engine.worker.block_table import BlockTableBuffer
from rlserve.engine.worker.cuda_graph import DecodeCUDAGraphs
from rlserve.engine.worker.host_staging import HostStaging
from rlserve.engine.worker.logits_inputs import build_logits_adjustments
from rlserve.engine.worker.routed_experts import RoutedExpertsRecorder
from rlserve.lora.peft import PEFTAdapter
from rlserve.model.attention import AttentionMetadata, create_attention_backend
from rlserve.model.loader import load_model
from rlserve.model.lora import lora_mask
from rlserve.model.models.llama import ForwardContext
from rlserve.model.moe import routed_experts_dtype
from rlserve.model.parallel import TensorParallelGroup
from rlserve.model.sampler import LogprobsTensors, Sampler, SamplingMetadata, gather_logprobs
from rlserve.outputs import PositionLogprobsData
from rlserve.weight_transfer.packed import as_bytes

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    """Aligned with the scheduled list: a token where the request sampled, None where it only prefilled."""

    sampled_token_ids: list[int | None]
    logprobs: list[PositionLogprobsData | None]
    # request index in the scheduled list -> logprobs of the prompt tokens this step's chunk predicts
    prompt_logprobs: dict[int, list[PositionLogprobsData]]


@dataclass(eq=False)
class LaunchedStep:
    """A step whose device work is enqueued; its results are read back by `ModelRunner.resolve`."""

    scheduled: list[ScheduledRequest]
    sample_rows: list[int]  # index into `scheduled` of each request that samples
    sample_index: dict[str, int]  # request id -> row of its token in sampled_token_ids
    prompt_rows: list[tuple[int, int, int]]  # (scheduled index, first hidden row, count)
    sampled_token_ids: torch.Tensor  # on the device: the next step's placeholder inputs come from here
    host_token_ids: torch.Tensor  # the same, being copied to (pinned) host memory
    host_logprobs: LogprobsTensors | None
    host_prompt_logprobs: LogprobsTensors | None
    # With routed experts returned: the step's rows (host copy), each input token's slot, (request id, end) pairs.
    host_routed: tuple[torch.Tensor, list[int], list[tuple[str, int]]] | None = None
    done: torch.cuda.Event | None = None  # recorded after the copies; None on the CPU, where work is synchronous


@dataclass(slots=True)
class _StepInputs:
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


class Followers(Protocol):
    """Rank 0's handle on the other tensor-parallel ranks (rlserve.engine.worker.tp_workers.TPWorkers)."""

    def send(self, name: str, *args: Any) -> None: ...

    def mirrored(self, name: str, *args: Any) -> contextlib.AbstractContextManager[list[Any]]: ...

    def shutdown(self) -> None: ...


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


def _to_host(t: LogprobsTensors) -> list[PositionLogprobsData]:
    columns = t.topk_ids.tolist(), t.topk_values.tolist(), t.token_values.tolist(), t.token_ranks.tolist()
    return list(map(PositionLogprobsData._make, zip(*columns, strict=True)))


class ModelRunner:
    """One tensor-parallel rank's model, KV cache and step. Rank 0 (the engine core's) schedules and samples, and
    drives `followers`, the other ranks: each step's inputs go to them as one broadcast tensor (`follow_step`), and
    the calls that change a rank's state run on every rank (`mirrored`)."""

    def __init__(
        self,
        config: EngineConfig,
        tp: TensorParallelGroup | None = None,
        followers: Followers | None = None,
        ep: TensorParallelGroup | None = None,
    ) -> None:
        """`ep`: the expert-parallel group (of the data-parallel ranks) a MoE model's experts are split over."""
        self.config = config
        self.tp = tp or TensorParallelGroup()
        self.ep = ep or TensorParallelGroup()
        self.followers = followers
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        with self.on_device():
            self._build(config)

    def on_device(self) -> contextlib.AbstractContextManager:
        """Make this engine's GPU the thread's current one: Triton kernels and CUDA graph capture use the current
        device (per thread), which for an engine on cuda:1 driven from any thread is not its own."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _build(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.model, self.hf_config = load_model(
            config.model, config.dtype, self.device, self.tp, config.load_format, self.ep, config.quantization
        )
        logger.info("model loaded on %s in %.1f s", self.device, time.perf_counter() - started)
        # Adapter slots before the memory profile and the graphs: they count, and the graphs read them.
        self.num_lora_slots = config.max_loras if config.enable_lora else 0
        if self.num_lora_slots:
            self.model.enable_lora(config.max_loras, config.max_lora_rank)
        self.dtype = self.model.lm_head.weight.dtype
        self.spec = self.model.spec
        self.num_kv_heads = self.model.model.layers[0].self_attn.num_kv_heads  # this rank's
        self.fp32_head = config.lm_head_dtype == "float32"
        self.backend = create_attention_backend(config.attention_backend, self.device, config.batch_invariant)
        self.model.set_batch_invariant(config.batch_invariant)
        self.sampler = Sampler(config.logprobs_mode, batch_invariant=config.batch_invariant)
        # Unfinished requests with penalties, logit bias or token masks: while none is, a step builds nothing for them.
        self._adjusting_logits: set[str] = set()
        self.block_size = config.block_size
        # Every rank holds the same blocks (of its own heads): the smallest count that fits on all of them.
        self.num_blocks = config.num_kv_blocks or self.tp.min(self._num_blocks_that_fit(), self.device)
        # Pinned staging for each step's copies (CUDA only): 16 MiB per step covers batches of 16k tokens.
        self.staging = HostStaging(16 << 20, self.device) if self.device.type == "cuda" else None
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position_embeddings, self.spec.max_position_embeddings
        )
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.block_table_buffer = BlockTableBuffer(self.max_blocks_per_seq, config.max_num_seqs)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cuda_graphs: DecodeCUDAGraphs | None = None
        # Set while asleep: the weights' host copies (sleep level 1) or just their shapes (level 2).
        self._slept_weights: dict[str, torch.Tensor] | None = None
        # Every checkpoint tensor the model has: what a full weight update writes.
        self.weight_names = frozenset(name for name, _ in self.model.checkpoint_weights())
        self._allocate_kv_cache()
        self.routed_experts = self._make_routed_experts_recorder(config)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.bytes_per_block / 2**30,
        )
        phase = time.perf_counter()
        self._capture_graphs()
        if self.cuda_graphs is not None:
            logger.info("decode CUDA graphs captured in %.1f s", time.perf_counter() - phase)
        phase = time.perf_counter()
        self._warm_up()
        logger.info(
            "kernels warmed up in %.1f s; the runner took %.1f s",
            time.perf_counter() - phase,
            time.perf_counter() - started,
        )

    def _allocate_kv_cache(self) -> None:
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.spec.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.spec.num_layers)
        ]

    def _make_routed_experts_recorder(self, config: EngineConfig) -> RoutedExpertsRecorder | None:
        if not config.enable_return_routed_experts:
            return None
        moe = self.spec.moe
        if moe is None:
            raise ValueError(
                f"enable_return_routed_experts: {self.spec.architecture} has no routed experts (not a MoE model)"
            )
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        return RoutedExpertsRecorder(
            self.num_blocks * self.block_size,
            self.spec.num_layers,
            moe.top_k,
            routed_experts_dtype(moe.num_experts),
            max_tokens,
            self.device,
        )

    @property
    def _routed_rows(self) -> torch.Tensor | None:
        return None if self.routed_experts is None else self.routed_experts.device_rows

    def _capture_graphs(self) -> None:
        if self.device.type == "cuda" and not self.config.enforce_eager and self.ep.size > 1:
            # A layer's exchange reads the ranks' token counts on the host, which a graph cannot replay.
            logger.warning("enable_expert_parallel: decode runs eagerly (no CUDA graphs under expert parallel)")
        elif self.device.type == "cuda" and not self.config.enforce_eager:
            self.cuda_graphs = DecodeCUDAGraphs(
                self.model,
                self.kv_caches,
                self.backend,
                self.config.max_num_seqs,
                self.max_blocks_per_seq,
                self.max_model_len,
                self.device,
                self._routed_rows,
                self.num_lora_slots,
            )

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Run the kernel variants that the first requests would otherwise compile: Triton JIT takes seconds on the
        GPU, which the first batch of a run paid (W1's first run took 8.0 s against 4.8 s for the next). Prefill
        attention has a variant per query-length bucket, the fused sampler one per greedy/logprobs combination."""
        dev = self.device
        hidden = None
        for q in (2, 4, 8, 16, 32, 64):
            if q >= self.max_model_len:
                break
            meta = self._dummy_sequence_meta(q, context_len=q)
            ids = torch.zeros(q, dtype=torch.long, device=dev)
            hidden = self.model(ids, torch.arange(q, device=dev), ForwardContext(meta, self.kv_caches, self.backend))
        if hidden is None:  # a model too short for any prefill
            return
        logits = self.model.compute_logits(hidden[-1:], self.fp32_head)
        for greedy in (False, True):
            for num_logprobs in (-1, 0):
                meta = SamplingMetadata(
                    temperature=torch.ones(1, device=dev),
                    greedy=torch.full((1,), greedy, device=dev),
                    top_k=None,
                    top_p=None,
                    min_p=None,
                    generators=[None],
                    min_tokens_mask=[],
                    max_num_logprobs=num_logprobs,
                    all_greedy=greedy,
                    all_random=not greedy,
                )
                self.sampler(logits, meta)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    @property
    def bytes_per_block(self) -> int:
        s = self.spec
        return 2 * s.num_layers * self.block_size * self.num_kv_heads * s.head_dim * self.dtype.itemsize

    def _num_blocks_that_fit(self) -> int:
        if self.device.type != "cuda":
            return max(1, self.config.cpu_kv_cache_bytes // self.bytes_per_block)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = (
            total * self.config.gpu_memory_utilization - used_by_others - torch.cuda.max_memory_allocated(self.device)
        )
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                "gpu_memory_utilization leaves no memory for the KV cache; raise it or use a smaller model"
            )
        return num_blocks

    def _dummy_sequence_meta(self, num_tokens: int, context_len: int) -> AttentionMetadata:
        """One sequence of num_tokens queries over context_len tokens of block 0, storing nothing (slot -1): for
        forwards whose results are thrown away (the memory profile, the warm-up)."""
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([context_len], dtype=torch.int32, device=dev),
            block_tables=torch.zeros((1, -(-context_len // self.block_size)), dtype=torch.int32, device=dev),
            max_seqlen_q=num_tokens,
            max_seq_len=context_len,
            query_lens_cpu=[num_tokens],
            seq_lens_cpu=[context_len],
        )

    def _profile_run(self) -> None:
        """A forward at the largest token budget with a one-block cache, so its activation peak can be measured."""
        n = self.config.max_num_batched_tokens
        shape = (1, self.block_size, self.num_kv_heads, self.spec.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),) * 2 for _ in range(self.spec.num_layers)]
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = self._dummy_sequence_meta(n, context_len=1)
        # Attention over a 1-token context is cheap; the peak comes from the projections and the MLP at n tokens.
        hidden = self.model(ids, ids, ForwardContext(meta, caches, _NoAttention()))
        self.model.compute_logits(hidden[: self.config.max_num_seqs], self.fp32_head)
        torch.cuda.synchronize(self.device)
        del caches, hidden

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """vLLM's: a one-token forward whose result is thrown away and which stores no KV (slot -1): the step of a
        data-parallel rank with no requests while its peers have some (lockstep), so that the collectives inside a
        step (expert parallelism's) find every rank."""
        meta = self._dummy_sequence_meta(1, context_len=1)
        ids = torch.zeros(1, dtype=torch.long, device=self.device)
        # The other tensor-parallel ranks take the same step: the decoder's all-reduces need every rank.
        with self.on_device(), self.mirrored("execute_dummy_batch"):
            self.model(ids, ids, ForwardContext(meta, self.kv_caches, self.backend))

    # ---- one step ----

    def _host_tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor from host values; through pinned memory on CUDA so the copy does not block the host."""
        return self._to_device(torch.tensor(values, dtype=dtype))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host if self.staging is None else self.staging.to_device(host)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.staging is None else self.staging.to_host(t)

    def _copy_to_host(self, t: LogprobsTensors) -> LogprobsTensors:
        return LogprobsTensors(*(self._to_host(getattr(t, f.name)) for f in fields(t)))

    def launch(self, scheduled: list[ScheduledRequest], prev: LaunchedStep | None) -> LaunchedStep:
        """Enqueue one step's forward pass and sampling on the device and return without waiting for them.

        Decode inputs that are placeholders (tokens `prev` sampled, not read back yet) are taken from `prev`'s
        sampled ids on the device, so this step can be prepared while `prev` still runs.
        """
        with self.on_device(), torch.inference_mode():
            return self._launch(scheduled, prev)

    def resolve(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step and return its tokens and logprobs as host values."""
        if step.done is not None:
            step.done.synchronize()
        if step.host_routed is not None:
            self.routed_experts.record(*step.host_routed)
        sampled: list[int | None] = [None] * len(step.scheduled)
        logprobs: list[PositionLogprobsData | None] = [None] * len(step.scheduled)
        for i, token in zip(step.sample_rows, step.host_token_ids.tolist(), strict=True):
            sampled[i] = token
        if step.host_logprobs is not None:
            for i, row in zip(step.sample_rows, _to_host(step.host_logprobs), strict=True):
                k = step.scheduled[i].request.sampling_params.logprobs
                if k is not None:
                    logprobs[i] = row._replace(topk_ids=row.topk_ids[:k], topk_values=row.topk_values[:k])
        prompt_logprobs: dict[int, list[PositionLogprobsData]] = {}
        if step.host_prompt_logprobs is not None:
            host = _to_host(step.host_prompt_logprobs)
            offset = 0
            for i, _, count in step.prompt_rows:
                kk = step.scheduled[i].request.sampling_params.prompt_logprobs
                prompt_logprobs[i] = [
                    PositionLogprobsData(a[:kk], b[:kk], c, d) for a, b, c, d in host[offset : offset + count]
                ]
                offset += count
        return RunnerOutput(sampled, logprobs, prompt_logprobs)

    def _launch(self, scheduled: list[ScheduledRequest], prev: LaunchedStep | None) -> LaunchedStep:
        if self.staging is not None:
            self.staging.next_step()
        inputs = self._gather_inputs(scheduled, prev)
        hidden = self._forward(inputs, prev)
        sampled_token_ids, logprobs = self._sample(hidden, scheduled, inputs, prev)
        prompt_logprobs = self._compute_prompt_logprobs(hidden, scheduled, inputs)
        # Start the copies back now; `resolve` waits for them (and so for the whole step) only when it needs them.
        step = LaunchedStep(
            scheduled=scheduled,
            sample_rows=inputs.sample_rows,
            sample_index={scheduled[i].request.request_id: j for j, i in enumerate(inputs.sample_rows)},
            prompt_rows=inputs.prompt_rows,
            sampled_token_ids=sampled_token_ids,
            host_token_ids=self._to_host(sampled_token_ids),
            host_logprobs=None if logprobs is None else self._copy_to_host(logprobs),
            host_prompt_logprobs=None if prompt_logprobs is None else self._copy_to_host(prompt_logprobs),
            host_routed=self._copy_routed_experts(scheduled, inputs),
        )
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()
        return step

    def _copy_routed_experts(
        self, scheduled: list[ScheduledRequest], inputs: _StepInputs
    ) -> tuple[torch.Tensor, list[int], list[tuple[str, int]]] | None:
        """Start copying this step's routed experts back (on the CPU a copy: the next step reuses the buffer)."""
        if self.routed_experts is None:
            return None
        rows = self.routed_experts.device_rows[: len(inputs.input_ids)]
        host = rows.clone() if self.staging is None else self.staging.to_host(rows)
        ends = [(item.request.request_id, end) for item, end in zip(scheduled, inputs.seq_lens, strict=True)]
        return host, inputs.slot_mapping, ends

    def _gather_inputs(self, scheduled: list[ScheduledRequest], prev: LaunchedStep | None) -> _StepInputs:
        """One pass over the scheduled requests into flat host lists (a loop per list cost more at batch 1024)."""
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
        if self.num_lora_slots and any(item.request.lora_slot >= 0 for item in scheduled):
            lora_mapping = [slot for item in scheduled for slot in [item.request.lora_slot] * item.num_new_tokens]
        bs = self.block_size
        for i, item in enumerate(scheduled):
            request, n = item.request, item.num_new_tokens
            start = request.num_computed_tokens
            first_row = len(input_ids)
            table = request.block_table
            if n == 1:  # decode: the common case, kept free of per-token loops
                token = request.all_token_ids[start]
                if token == PLACEHOLDER:
                    placeholder_rows.append(first_row)
                    placeholder_sources.append(prev.sample_index[request.request_id])
                input_ids.append(token)
                positions.append(start)
                slot_mapping.append(table[start // bs] * bs + start % bs)
            else:  # prefill chunks never hold placeholders: a request samples only once its prompt is computed
                input_ids.extend(request.all_token_ids[start : start + n])
                positions.extend(range(start, start + n))
                slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            table_rows.append(self.block_table_buffer.row(request))
            if start + n == request.num_tokens:
                sample_rows.append(i)
                logits_indices.append(len(input_ids) - 1)
            if request.sampling_params.prompt_logprobs is not None:
                # Hidden row for position p predicts token p + 1; only prompt targets count.
                count = max(0, min(start + n, request.num_prompt_tokens - 1) - start)
                if count:
                    prompt_rows.append((i, first_row, count))
                    prompt_targets.extend(request.all_token_ids[start + 1 : start + 1 + count])
        return _StepInputs(
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

    def _forward(self, inputs: _StepInputs, prev: LaunchedStep | None) -> torch.Tensor:
        """Copy the inputs to the device (placeholders filled from `prev`'s sampled ids there), hand them to the
        other tensor-parallel ranks, and run the decoder."""
        max_seq_len = max(inputs.seq_lens)
        block_tables = self._to_device(
            self.block_table_buffer.gather(inputs.block_table_rows, -(-max_seq_len // self.block_size))
        )
        ids = self._host_tensor(inputs.input_ids, torch.long)
        if inputs.placeholder_rows:
            sources = self._host_tensor(inputs.placeholder_sources, torch.long)
            ids[self._host_tensor(inputs.placeholder_rows, torch.long)] = prev.sampled_token_ids[sources]
        pos = self._host_tensor(inputs.positions, torch.long)
        slots = self._host_tensor(inputs.slot_mapping, torch.long)
        seq_lens = self._host_tensor(inputs.seq_lens, torch.int32)
        lora_mapping = None if inputs.lora_mapping is None else self._host_tensor(inputs.lora_mapping, torch.long)
        if self.followers is not None:
            self._lead_step(inputs, ids, pos, slots, block_tables)
        return self._run_model(
            ids, pos, slots, seq_lens, block_tables, inputs.query_lens, inputs.seq_lens, lora_mapping
        )

    def _lead_step(
        self,
        inputs: _StepInputs,
        ids: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> None:
        """Send the followers this step's inputs: a header of sizes, then the inputs as one tensor, broadcast from
        the device (so the placeholders filled there need no read-back); they run the same forward and LM head."""
        prompt_rows = [r for _, first, count in inputs.prompt_rows for r in range(first, first + count)]
        header = StepHeader(
            len(inputs.input_ids),
            len(inputs.query_lens),
            block_tables.shape[1],
            len(inputs.logits_indices),
            len(prompt_rows),
        )
        lengths = self._host_tensor(
            inputs.query_lens + inputs.seq_lens + inputs.logits_indices + prompt_rows, torch.long
        )
        packed = torch.cat((ids, pos, slots, block_tables.flatten().long(), lengths))
        self.followers.send("follow_step", header)
        self.tp.broadcast(packed)

    @torch.inference_mode()
    def follow_step(self, header: StepHeader) -> None:
        """A follower's step: receive rank 0's inputs (`_lead_step`), run the forward and the LM head's collectives
        as rank 0 does; rank 0 alone samples."""
        with self.on_device():
            if self.staging is not None:
                self.staging.next_step()
            n, num_seqs = header.num_tokens, header.num_seqs
            packed = self.tp.broadcast(torch.empty(header.numel, dtype=torch.long, device=self.device))
            ids, pos, slots, tables, lengths = packed.split(
                (n, n, n, num_seqs * header.block_table_columns, 2 * num_seqs + header.logits_numel)
            )
            lengths = lengths.tolist()
            query_lens, seq_lens = lengths[:num_seqs], lengths[num_seqs : 2 * num_seqs]
            logits_rows = lengths[2 * num_seqs : 2 * num_seqs + header.num_logits_rows]
            prompt_rows = lengths[2 * num_seqs + header.num_logits_rows :]
            block_tables = tables.view(num_seqs, header.block_table_columns).to(torch.int32)
            seq_lens_t = self._host_tensor(seq_lens, torch.int32)
            hidden = self._run_model(ids, pos, slots, seq_lens_t, block_tables, query_lens, seq_lens)
            if logits_rows:
                self._logits(hidden, logits_rows)
            if prompt_rows:
                self.model.compute_logits(hidden[self._host_tensor(prompt_rows, torch.long)], self.fp32_head)

    def _run_model(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        query_lens: list[int],
        seq_lens_cpu: list[int],
        lora_mapping: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder over one step's device inputs: a captured CUDA graph for pure decode batches that fit one,
        eager otherwise. lora_mapping: each token's adapter slot (-1: none), or None when no token has one."""
        num_seqs = len(query_lens)
        is_decode = ids.shape[0] == num_seqs
        if is_decode and self.cuda_graphs is not None and num_seqs <= self.cuda_graphs.max_batch_size:
            return self.cuda_graphs.run(ids, pos, slots, seq_lens, block_tables, lora_mapping)
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=slots,
            cu_seqlens_q=self._host_tensor(cu, torch.int32),
            seq_lens=seq_lens,
            block_tables=block_tables,
            max_seqlen_q=max(query_lens),
            # Decode kernels pick their KV split from this bound: the graphs' bound, so eager and graph decode
            # split (and round) identically.
            max_seq_len=self.max_model_len if is_decode else max(seq_lens_cpu),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens_cpu,
        )
        ctx = ForwardContext(meta, self.kv_caches, self.backend, self._routed_rows)
        if lora_mapping is not None:
            ctx.lora_mask = lora_mask(lora_mapping, self.num_lora_slots, self.dtype)
        return self.model(ids, pos, ctx)

    def _logits(self, hidden: torch.Tensor, logits_indices: list[int]) -> torch.Tensor:
        """The logits of the rows that sample (every rank computes them: the LM head gathers over the ranks)."""
        if len(logits_indices) != hidden.shape[0]:
            hidden = hidden[self._host_tensor(logits_indices, torch.long)]
        return self.model.compute_logits(hidden, self.fp32_head)

    def _sample(
        self, hidden: torch.Tensor, scheduled: list[ScheduledRequest], inputs: _StepInputs, prev: LaunchedStep | None
    ) -> tuple[torch.Tensor, LogprobsTensors | None]:
        """The next token (and its logprobs) of every request whose step reaches its last known token."""
        if not inputs.sample_rows:
            return torch.empty(0, dtype=torch.long, device=self.device), None
        requests = [scheduled[i].request for i in inputs.sample_rows]
        logits = self._logits(hidden, inputs.logits_indices)
        out = self.sampler(logits, self._sampling_metadata(requests, prev))
        return out.token_ids, out.logprobs

    def _compute_prompt_logprobs(
        self, hidden: torch.Tensor, scheduled: list[ScheduledRequest], inputs: _StepInputs
    ) -> LogprobsTensors | None:
        if not inputs.prompt_rows:
            return None
        rows = torch.cat([torch.arange(r, r + c, device=self.device) for _, r, c in inputs.prompt_rows])
        values = self.model.compute_logits(hidden[rows], self.fp32_head).float().log_softmax(-1)
        k = max(scheduled[i].request.sampling_params.prompt_logprobs for i, _, _ in inputs.prompt_rows)
        return gather_logprobs(values, k, self._host_tensor(inputs.prompt_targets, torch.long))

    def add_request(self, request: Request) -> None:
        """Note a new request's needs (once, so that steps need not look for them)."""
        if request.sampling_params.adjusts_logits:
            self._adjusting_logits.add(request.request_id)

    def release(self, request_id: str) -> None:
        """Forget a finished request's host-side state."""
        self.block_table_buffer.release(request_id)
        self._adjusting_logits.discard(request_id)
        if self.routed_experts is not None:
            self.routed_experts.forget(request_id)

    def take_routed_experts(self, request: Request) -> np.ndarray | None:
        """The experts routed for `request`'s tokens not sent yet (see RoutedExpertsRecorder.take), or None when not
        recorded."""
        if self.routed_experts is None:
            return None
        return self.routed_experts.take(request, self.block_size)

    def _sampling_metadata(self, requests: list[Request], prev: LaunchedStep | None) -> SamplingMetadata:
        params = [r.sampling_params for r in requests]
        greedy = [p.greedy for p in params]
        vocab = self.spec.vocab_size

        column = self._host_tensor

        any_top_k = any(p.top_k > 0 and not g for p, g in zip(params, greedy, strict=True))
        any_top_p = any(p.top_p < 1.0 and not g for p, g in zip(params, greedy, strict=True))
        any_min_p = any(p.min_p > 0.0 and not g for p, g in zip(params, greedy, strict=True))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        adjustments = None
        if self._adjusting_logits:  # empty on the common path, which then pays nothing for these
            rows = [i for i, r in enumerate(requests) if r.request_id in self._adjusting_logits]
            if rows:
                prev_sampled, prev_index = (None, {}) if prev is None else (prev.sampled_token_ids, prev.sample_index)
                adjustments = build_logits_adjustments(requests, rows, self._host_tensor, prev_sampled, prev_index)
        return SamplingMetadata(
            temperature=column(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], torch.float32
            ),
            greedy=column(greedy, torch.bool),
            top_k=column([p.top_k if p.top_k > 0 else vocab for p in params], torch.long) if any_top_k else None,
            top_p=column([p.top_p for p in params], torch.float32) if any_top_p else None,
            min_p=column([p.min_p for p in params], torch.float32) if any_min_p else None,
            generators=[r.generator for r in requests],
            min_tokens_mask=[
                (i, sorted(r.stop_ids)) for i, r in enumerate(requests) if r.below_min_tokens and r.stop_ids
            ],
            max_num_logprobs=max(wanted) if wanted else -1,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            adjustments=adjustments,
        )

    # ---- sleep: give the device memory back (a colocated trainer needs it), and take it again ----

    @property
    def weights_resident(self) -> bool:
        return self._slept_weights is None

    @property
    def kv_cache_resident(self) -> bool:
        return bool(self.kv_caches)

    @contextlib.contextmanager
    def mirrored(self, name: str, *args: Any) -> Iterator[list[Any]]:
        """Run the body on this rank while the followers run their `name(*args)`; the list yielded holds their
        results (rank order) once the body is done. A failure on any rank raises, this rank's first."""
        if self.followers is None:
            yield []
            return
        with self.followers.mirrored(name, *args) as results:
            yield results

    def call_followers(self, name: str, *args: Any) -> list[Any]:
        """The followers' results of `name(*args)` (rank order); nothing runs on this rank."""
        with self.mirrored(name, *args) as results:
            pass
        return results

    def shutdown(self) -> None:
        """Stop the followers and leave the group (rank 0's; a follower's ends with its process)."""
        if self.followers is not None:
            self.followers.shutdown()
            self.followers = None
        self.tp.shutdown()
        self.ep.shutdown()

    def release_kv_cache(self) -> None:
        """Drop the KV cache and the CUDA graphs that read it (they record its addresses)."""
        with self.mirrored("release_kv_cache"):
            self._release_kv_cache()

    def _release_kv_cache(self) -> None:
        self.cuda_graphs = None
        self.kv_caches = []
        self._empty_device_cache()

    def release_weights(self, keep_host_copy: bool) -> None:
        """Drop the weights from the device, keeping a host copy (to restore) or only their shapes (to be
        overwritten by a weight update). The parameter objects stay, so loaders and caches keyed by them still work."""
        with self.mirrored("release_weights", keep_host_copy):
            self._release_weights(keep_host_copy)

    def _release_weights(self, keep_host_copy: bool) -> None:
        if not self.weights_resident:
            return
        self.cuda_graphs = None
        slept = {}
        for name, param in self.model.named_parameters():  # tied weights appear once
            if keep_host_copy:  # pinned on CUDA, so that waking up copies at full speed
                slept[name] = torch.empty(param.shape, dtype=param.dtype, pin_memory=self.device.type == "cuda")
                slept[name].copy_(param.data)
            else:
                slept[name] = torch.empty(param.shape, dtype=param.dtype, device="meta")
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        self._slept_weights = slept
        self.model.drop_derived_weights()
        self._empty_device_cache()

    def restore(self, weights: bool, kv_cache: bool) -> None:
        """Bring back what was released; weights released without a host copy come back uninitialised."""
        with self.mirrored("restore", weights, kv_cache), self.on_device():
            if weights and not self.weights_resident:
                params = dict(self.model.named_parameters())
                for name, host in self._slept_weights.items():
                    if host.is_meta:
                        params[name].data = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                    else:
                        params[name].data = host.to(self.device)
                self._slept_weights = None
            if kv_cache and not self.kv_cache_resident:
                self._allocate_kv_cache()
            if self.weights_resident and self.kv_cache_resident and self.cuda_graphs is None:
                self._capture_graphs()

    def _empty_device_cache(self) -> None:
        if self.device.type == "cuda":
            with self.on_device():
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()  # back to the driver, where another process can have it

    # ---- LoRA adapters: written in place into the slots the graphs read ----

    def load_lora(self, slot: int, adapter: PEFTAdapter) -> None:
        """Put `adapter` in `slot` (checked whole before anything is written)."""
        with self.on_device():
            self.model.load_lora(slot, adapter)

    def clear_lora(self, slot: int) -> None:
        with self.on_device():
            self.model.clear_lora(slot)

    # ---- weights ----

    def load_weights(self, weights) -> int:
        """Load whole checkpoint tensors into this rank (its part of each); a weight-transfer backend receives
        them on every rank itself."""
        return self.model.load_weights(weights)

    def load_weights_on_all_ranks(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load tensors that only rank 0 has (from a front end, a directory) on every rank: checked first, then each
        broadcast to the followers, which keep their part."""
        self.model.check_weights(((name, tuple(t.shape), t.dtype) for name, t in weights), whole_update=True)
        if self.followers is None:
            return self.model.load_weights(weights)
        metas = [(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in weights]
        written = 0
        with self.mirrored("receive_broadcast_weights", metas), self.on_device():
            for name, tensor in weights:
                tensor = tensor.to(self.device).contiguous()
                self.tp.broadcast(as_bytes(tensor))
                written += self.model.load_weights([(name, tensor)])
        return written

    def receive_broadcast_weights(self, metas: list[tuple[str, str, tuple[int, ...]]]) -> None:
        """A follower's end of `load_weights_on_all_ranks`."""
        with self.on_device():
            for name, dtype, shape in metas:
                tensor = torch.empty(shape, dtype=dtype_from_name(dtype), device=self.device)
                self.tp.broadcast(as_bytes(tensor))
                self.model.load_weights([(name, tensor)])

    def full_checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole checkpoint tensors, put together from every rank's part (for checksums)."""
        with self.mirrored("full_checkpoint_weights"), self.on_device():
            yield from self.model.full_checkpoint_weights()

    def checkpoint_names(self, names) -> set[str]:
        """The entries of `weight_names` that checkpoint tensors `names` write."""
        # Under expert parallel another rank's experts are checked here but written there: not this rank's names.
        return {key for name in names for key in self.model.written_names(name)} & self.weight_names

    def snapshot_weights(self, into: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Host copies of the parameters, written into `into` (the previous snapshot's buffers) when given: a copy
        per update, not an allocation (pinned memory is slow to allocate). Each follower keeps its own."""
        with self.mirrored("snapshot_weights"):
            return self._snapshot_weights(into)

    def _snapshot_weights(self, into: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        if into is None:
            into = {
                name: torch.empty(param.shape, dtype=param.dtype, pin_memory=self.device.type == "cuda")
                for name, param in self.model.named_parameters()
            }
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                into[name].copy_(param.data)
        return into

    def restore_weights(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Write back a `snapshot_weights` copy, in place (the parameters stay the objects loaders and caches hold).
        Each follower writes back its own."""
        with self.mirrored("restore_weights"), self.on_device(), torch.no_grad():
            for name, param in self.model.named_parameters():
                param.data.copy_(snapshot[name])
        self.model.drop_derived_weights()


class _NoAttention:
    """Stands in for attention during the memory profile: returns q unchanged."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        return q
