"""Turns a scheduled batch into tensors, runs the model over the paged KV cache and samples."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import fields
from typing import Any, Protocol

import numpy as np
import torch

from rlserve.config import EngineConfig
from rlserve.dtypes import dtype_from_name, dtype_name
from rlserve.engine.sched.batch import ScheduledRequest
from rlserve.engine.sched.request import Request
from rlserve.engine.worker.block_table import BlockTableBuffer
from rlserve.engine.worker.cuda_graph import DecodeCUDAGraphs
from rlserve.engine.worker.host_staging import HostStaging
from rlserve.engine.worker.kv_memory import zeroed
from rlserve.engine.worker.routed_experts import make_routed_experts_recorder
from rlserve.engine.worker.sampling_inputs import sampling_metadata
from rlserve.engine.worker.step_inputs import StepHeader, StepInputs, follower_header, gather_inputs
from rlserve.engine.worker.step_outputs import LaunchedStep, RunnerOutput
from rlserve.engine.worker.warm_up import dummy_sequence_meta, peak_memory_run, warm_up
from rlserve.lora.peft import PEFTAdapter
from rlserve.model.attention import AttentionMetadata, PrefixGroups, create_attention_backend, members_per_item
from rlserve.model.forward_context import ForwardContext
from rlserve.model.loader import load_model
from rlserve.model.lora import lora_mask
from rlserve.model.parallel import TensorParallelGroup
from rlserve.model.sampler import LogprobsTensors, Sampler, gather_logprobs
from rlserve.weight_transfer.packed import as_bytes

logger = logging.getLogger(__name__)


class Followers(Protocol):
    """Rank 0's handle on the other tensor-parallel ranks (rlserve.engine.worker.tp_workers.TPWorkers)."""

    def send(self, name: str, *args: Any) -> None: ...

    def mirrored(self, name: str, *args: Any) -> contextlib.AbstractContextManager[list[Any]]: ...

    def shutdown(self) -> None: ...


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

    @property
    def vllm_config(self) -> EngineConfig:
        """vLLM's `model_runner.vllm_config` (verl's worker extension reads it): the engine's config."""
        return self.config

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
        # Set: decode steps read a prefix that sequences share once per work item of this many (AttentionMetadata).
        group = self.spec.num_heads // self.spec.num_kv_heads
        self.prefix_item_size = members_per_item(group) if config.grouped_prefix_attention else None
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
        self.routed_experts = make_routed_experts_recorder(
            config, self.spec, self.num_blocks * self.block_size, self.device
        )
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
        warm_up(
            self.model,
            self.kv_caches,
            self.backend,
            self.sampler,
            self.max_model_len,
            self.block_size,
            self.fp32_head,
            self.device,
        )
        logger.info(
            "kernels warmed up in %.1f s; the runner took %.1f s",
            time.perf_counter() - phase,
            time.perf_counter() - started,
        )

    def _allocate_kv_cache(self) -> None:
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.spec.head_dim)
        self.kv_caches = [
            (zeroed(shape, self.dtype, self.device), zeroed(shape, self.dtype, self.device))
            for _ in range(self.spec.num_layers)
        ]

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
                self.prefix_item_size,
            )

    @property
    def bytes_per_block(self) -> int:
        s = self.spec
        return 2 * s.num_layers * self.block_size * self.num_kv_heads * s.head_dim * self.dtype.itemsize

    def _num_blocks_that_fit(self) -> int:
        if self.device.type != "cuda":
            return max(1, self.config.cpu_kv_cache_bytes // self.bytes_per_block)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        peak_memory_run(self.model, self.config, self.num_kv_heads, self.dtype, self.fp32_head, self.device)
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

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """vLLM's: a one-token forward whose result is thrown away and which stores no KV (slot -1): the step of a
        data-parallel rank with no requests while its peers have some (lockstep), so that the collectives inside a
        step (expert parallelism's) find every rank."""
        meta = dummy_sequence_meta(1, 1, self.block_size, self.device)
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
        return step.output()

    def _launch(self, scheduled: list[ScheduledRequest], prev: LaunchedStep | None) -> LaunchedStep:
        if self.staging is not None:
            self.staging.next_step()
        prev_index = {} if prev is None else prev.sample_index
        inputs = gather_inputs(scheduled, prev_index, self.block_table_buffer, self.block_size, self.num_lora_slots)
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
        self, scheduled: list[ScheduledRequest], inputs: StepInputs
    ) -> tuple[torch.Tensor, list[int], list[tuple[str, int]]] | None:
        """Start copying this step's routed experts back (on the CPU a copy: the next step reuses the buffer)."""
        if self.routed_experts is None:
            return None
        rows = self.routed_experts.device_rows[: len(inputs.input_ids)]
        host = rows.clone() if self.staging is None else self.staging.to_host(rows)
        ends = [(item.request.request_id, end) for item, end in zip(scheduled, inputs.seq_lens, strict=True)]
        return host, inputs.slot_mapping, ends

    def _forward(self, inputs: StepInputs, prev: LaunchedStep | None) -> torch.Tensor:
        """Copy the inputs to the device (placeholders filled from `prev`'s sampled ids there), hand them to the
        other tensor-parallel ranks, and run the decoder."""
        num_blocks = -(-max(inputs.seq_lens) // self.block_size)
        host_tables = self.block_table_buffer.gather(inputs.block_table_rows, num_blocks)
        # Groups are found on the host tables: no read-back from the device.
        prefix_groups = inputs.prefix_groups(host_tables, self.block_size, self.prefix_item_size, self._to_device)
        block_tables = self._to_device(host_tables)
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
            ids, pos, slots, seq_lens, block_tables, inputs.query_lens, inputs.seq_lens, lora_mapping, prefix_groups
        )

    def _lead_step(
        self,
        inputs: StepInputs,
        ids: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> None:
        """Send the followers this step's inputs: a header of sizes, then the inputs as one tensor, broadcast from
        the device (so the placeholders filled there need no read-back); they run the same forward and LM head."""
        header, lengths = follower_header(inputs, block_tables.shape[1])
        packed = torch.cat((ids, pos, slots, block_tables.flatten().long(), self._host_tensor(lengths, torch.long)))
        self.followers.send("follow_step", header)
        self.tp.broadcast(packed)

    @torch.inference_mode()
    def follow_step(self, header: StepHeader) -> None:
        """A follower's step: receive rank 0's inputs (`_lead_step`), run the forward and the LM head's collectives
        as rank 0 does; rank 0 alone samples."""
        with self.on_device():
            if self.staging is not None:
                self.staging.next_step()
            packed = self.tp.broadcast(torch.empty(header.numel, dtype=torch.long, device=self.device))
            ids, pos, slots, block_tables, query_lens, seq_lens, logits_rows, prompt_rows = header.unpack(packed)
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
        prefix_groups: PrefixGroups | None = None,
    ) -> torch.Tensor:
        """The decoder over one step's device inputs: a captured CUDA graph for pure decode batches that fit one,
        eager otherwise. lora_mapping: each token's adapter slot (-1: none), or None when no token has one.
        prefix_groups: a decode step's groups of sequences sharing a prefix (grouped_prefix_attention), or None."""
        num_seqs = len(query_lens)
        is_decode = ids.shape[0] == num_seqs
        if is_decode and self.cuda_graphs is not None and self.cuda_graphs.fits(num_seqs, prefix_groups):
            return self.cuda_graphs.run(ids, pos, slots, seq_lens, block_tables, lora_mapping, prefix_groups)
        cu = [0, *itertools.accumulate(query_lens)]
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
            prefix_groups=prefix_groups,
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
        self, hidden: torch.Tensor, scheduled: list[ScheduledRequest], inputs: StepInputs, prev: LaunchedStep | None
    ) -> tuple[torch.Tensor, LogprobsTensors | None]:
        """The next token (and its logprobs) of every request whose step reaches its last known token."""
        if not inputs.sample_rows:
            return torch.empty(0, dtype=torch.long, device=self.device), None
        requests = [scheduled[i].request for i in inputs.sample_rows]
        logits = self._logits(hidden, inputs.logits_indices)
        prev_sampled, prev_index = (None, {}) if prev is None else (prev.sampled_token_ids, prev.sample_index)
        vocab = self.spec.vocab_size
        metadata = sampling_metadata(
            requests, self._adjusting_logits, vocab, self._host_tensor, prev_sampled, prev_index
        )
        out = self.sampler(logits, metadata)
        return out.token_ids, out.logprobs

    def _compute_prompt_logprobs(
        self, hidden: torch.Tensor, scheduled: list[ScheduledRequest], inputs: StepInputs
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
