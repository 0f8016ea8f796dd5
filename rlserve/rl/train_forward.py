"""rlserve's own decoder run as a trainer runs it: whole sequences in one forward, no paged KV cache, gradients allowed.

The engine and this forward share every module (projections, norms, rotary, MLP, LM head); only attention differs.
`ContiguousAttention` implements the engine's `AttentionBackend` protocol but ignores the cache arguments and attends
causally within each packed sequence, so a difference between engine and trainer logprobs on the same weights can only
come from the paged attention path, batching, or the sampler, never from a second model implementation.

A model loaded with `batch_invariant=True` is the reference of the engine's batch-invariant mode: the sequences go
through the engine's own batch-invariant attention backend over a paged cache built for them, every projection
through the same batch-invariant matmul and, on CUDA, every norm, rotary and activation through the engine's fused
kernels, so its logprobs equal the engine's bit for bit. It trains too, in that one forward: each kernel's backward is
that of the PyTorch code computing the same function (rlserve.model.batch_invariant.exact_values), for attention
`ContiguousAttention`'s. The gradients are those of the regular forward's computation evaluated at the exact values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rlserve.model.attention import AttentionBackend, AttentionMetadata, create_attention_backend
from rlserve.model.batch_invariant import exact_values
from rlserve.model.forward_context import ForwardContext
from rlserve.model.loader import load_model
from rlserve.model.models.llama import DecoderForCausalLM


class ContiguousAttention:
    """Causal SDPA per packed sequence; k_cache/v_cache are ignored (nothing is stored, nothing is read back)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        outputs = []
        start = 0
        for length in meta.query_lens_cpu:
            end = start + length
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=gqa,
            )
            outputs.append(o.transpose(0, 1))
            start = end
        # torch.cat rather than writes into a preallocated buffer, so autograd sees plain ops.
        return torch.cat(outputs)


class ExactAttention:
    """The engine's batch-invariant backend for the values (it stores k/v in the paged cache and reads them back),
    `ContiguousAttention`'s backward for the gradients."""

    def __init__(self, engine_backend: AttentionBackend) -> None:
        self.engine_backend = engine_backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        def engine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.engine_backend.forward(q, k, v, k_cache, v_cache, meta, scale)

        def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ContiguousAttention().forward(q, k, v, k_cache, v_cache, meta, scale)

        return exact_values(engine, reference, q, k, v)


def load_training_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    batch_invariant: bool = False,
) -> DecoderForCausalLM:
    """rlserve's model with the checkpoint's weights, parameters trainable (the engine's loader freezes them);
    batch_invariant: the reference forward of the engine's batch-invariant mode (see above)."""
    model, _ = load_model(str(model_dir), dtype, torch.device(device))
    model.set_batch_invariant(batch_invariant)
    return model.train().requires_grad_()


def forward_hidden(
    model: DecoderForCausalLM,
    sequences: Sequence[Sequence[int]],
    routed_experts: Sequence[np.ndarray | torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Final hidden states [len(seq), hidden] of each sequence, from one packed forward through the model's modules.

    routed_experts (a MoE model): per sequence, the experts to route its first tokens to, [tokens, layers, top_k]
    from position 0 (the engine's CompletionOutput.routed_experts of a request with routed_experts_prompt_start 0,
    which covers all but the last token); tokens past them take the router's own choice (see rlserve.model.moe)."""
    device = model.lm_head.weight.device
    lengths = [len(s) for s in sequences]
    if not sequences or min(lengths) == 0:
        raise ValueError("sequences: expected at least one sequence, each with at least one token")
    replay = None if routed_experts is None else _replay_tensor(model, lengths, routed_experts)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    if model.batch_invariant:
        ctx = _paged_prefill_context(model, lengths, cu)
        ctx.replay_experts = replay
        hidden = model(ids, positions, ctx)
        return list(hidden.split(lengths))
    meta = AttentionMetadata(
        slot_mapping=torch.full((len(ids),), -1, dtype=torch.long, device=device),
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=torch.zeros((len(lengths), 0), dtype=torch.int32, device=device),
        max_seqlen_q=max(lengths),
        max_seq_len=max(lengths),
        query_lens_cpu=lengths,
        seq_lens_cpu=lengths,
    )
    # The decoder indexes one (k_cache, v_cache) pair per layer; this backend never touches them.
    no_cache = torch.empty(0, device=device)
    ctx = ForwardContext(
        meta, [(no_cache, no_cache)] * model.spec.num_layers, ContiguousAttention(), replay_experts=replay
    )
    hidden = model(ids, positions, ctx)
    return list(hidden.split(lengths))


def causal_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, L, V] of right-padded sequences [B, L] from a Hugging Face causal LM or rlserve's decoder (every row
    at its full length, in one packed forward). A row's real positions never see its padding; in batch-invariant mode
    they are also the engine's bits, whatever the other rows."""
    if isinstance(model, DecoderForCausalLM):
        hidden = forward_hidden(model, input_ids.tolist())
        return model.compute_logits(torch.cat(hidden)).view(*input_ids.shape, -1)
    return model(input_ids, use_cache=False).logits


def checkpoint_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs for the engine, in a stable order: a Hugging Face model's parameters are named
    so already; rlserve's decoder names the pieces of its fused parameters."""
    if isinstance(model, DecoderForCausalLM):
        yield from model.checkpoint_weights()
        return
    for name, param in model.named_parameters():
        yield name, param.detach()


def _replay_tensor(
    model: DecoderForCausalLM, lengths: list[int], routed_experts: Sequence[np.ndarray | torch.Tensor]
) -> torch.Tensor:
    """The packed sequences' replayed experts [tokens, layers, top_k]; -1 where the router chooses itself."""
    moe = model.spec.moe
    if moe is None:
        raise ValueError(f"routed_experts: {model.spec.architecture} has no routed experts (not a MoE model)")
    if len(routed_experts) != len(lengths):
        raise ValueError(f"routed_experts: got {len(routed_experts)} arrays for {len(lengths)} sequences")
    device = model.lm_head.weight.device
    replay = torch.full((sum(lengths), model.spec.num_layers, moe.top_k), -1, dtype=torch.long, device=device)
    start = 0
    for i, (length, routed) in enumerate(zip(lengths, routed_experts, strict=True)):
        routed = torch.as_tensor(routed).long()
        if routed.dim() != 3 or routed.shape[0] > length or routed.shape[1:] != replay.shape[1:]:
            raise ValueError(
                f"routed_experts[{i}]: shape {list(routed.shape)} does not fit a sequence of {length} tokens "
                f"([<= tokens, {model.spec.num_layers}, {moe.top_k}])"
            )
        if routed.numel() and not 0 <= int(routed.min()) <= int(routed.max()) < moe.num_experts:
            raise ValueError(f"routed_experts[{i}]: expert ids must be in [0, {moe.num_experts})")
        replay[start : start + routed.shape[0]] = routed.to(device)
        start += length
    return replay


def _paged_prefill_context(model: DecoderForCausalLM, lengths: list[int], cu_seqlens_q: torch.Tensor) -> ForwardContext:
    """Every sequence as one prefill through the engine's batch-invariant attention backend, over a paged cache
    holding exactly these sequences (block size 16, blocks in order)."""
    device = model.lm_head.weight.device
    spec = model.spec
    block_size = 16
    num_blocks = [-(-n // block_size) for n in lengths]
    first_block = [0, *torch.tensor(num_blocks).cumsum(0).tolist()]
    block_tables = torch.zeros((len(lengths), max(num_blocks)), dtype=torch.int32)
    for b, count in enumerate(num_blocks):
        block_tables[b, :count] = torch.arange(first_block[b], first_block[b] + count)
    # Sequence b's token j is stored at slot (first block of b) * block_size + j.
    slots = torch.cat([torch.arange(n) + first_block[b] * block_size for b, n in enumerate(lengths)])
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_seqlen_q=max(lengths),
        max_seq_len=max(lengths),
        query_lens_cpu=lengths,
        seq_lens_cpu=lengths,
    )
    shape = (first_block[-1], block_size, spec.num_kv_heads, spec.head_dim)
    dtype = model.lm_head.weight.dtype
    caches = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(spec.num_layers)
    ]
    return ForwardContext(meta, caches, ExactAttention(create_attention_backend("auto", device, batch_invariant=True)))
