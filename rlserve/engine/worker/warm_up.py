"""Forwards whose results are thrown away, run while a rank builds: the memory profile that sizes the KV cache
(`peak_memory_run`) and the warm-up that compiles the kernels the first requests would otherwise wait for."""

from __future__ import annotations

import torch

from rlserve.config import EngineConfig
from rlserve.model.attention import AttentionMetadata
from rlserve.model.forward_context import ForwardContext
from rlserve.model.sampler import Sampler, SamplingMetadata


def dummy_sequence_meta(num_tokens: int, context_len: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """One sequence of num_tokens queries over context_len tokens of block 0, storing nothing (slot -1): for
    forwards whose results are thrown away (the memory profile, the warm-up)."""
    dev = device
    return AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=dev),
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([context_len], dtype=torch.int32, device=dev),
        block_tables=torch.zeros((1, -(-context_len // block_size)), dtype=torch.int32, device=dev),
        max_seqlen_q=num_tokens,
        max_seq_len=context_len,
        query_lens_cpu=[num_tokens],
        seq_lens_cpu=[context_len],
    )


def peak_memory_run(
    model, config: EngineConfig, num_kv_heads: int, dtype: torch.dtype, fp32_head: bool, device: torch.device
) -> None:
    """A forward at the largest token budget with a one-block cache, so its activation peak can be measured."""
    n, block_size, spec = config.max_num_batched_tokens, config.block_size, model.spec
    shape = (1, block_size, num_kv_heads, spec.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device),) * 2 for _ in range(spec.num_layers)]
    ids = torch.zeros(n, dtype=torch.long, device=device)
    meta = dummy_sequence_meta(n, 1, block_size, device)
    # Attention over a 1-token context is cheap; the peak comes from the projections and the MLP at n tokens.
    hidden = model(ids, ids, ForwardContext(meta, caches, _NoAttention()))
    model.compute_logits(hidden[: config.max_num_seqs], fp32_head)
    torch.cuda.synchronize(device)
    del caches, hidden


@torch.inference_mode()
def warm_up(
    model, kv_caches: list, backend, sampler: Sampler, max_model_len: int, block_size: int, fp32_head: bool, device
) -> None:
    """Run the kernel variants that the first requests would otherwise compile: Triton JIT takes seconds on the
    GPU, which the first batch of a run paid (W1's first run took 8.0 s against 4.8 s for the next). Prefill
    attention has a variant per query-length bucket, the fused sampler one per greedy/logprobs combination."""
    dev = device
    hidden = None
    for q in (2, 4, 8, 16, 32, 64):
        if q >= max_model_len:
            break
        meta = dummy_sequence_meta(q, q, block_size, dev)
        ids = torch.zeros(q, dtype=torch.long, device=dev)
        hidden = model(ids, torch.arange(q, device=dev), ForwardContext(meta, kv_caches, backend))
    if hidden is None:  # a model too short for any prefill
        return
    logits = model.compute_logits(hidden[-1:], fp32_head)
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
            sampler(logits, meta)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _NoAttention:
    """Stands in for attention during the memory profile: returns q unchanged."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        return q
