"""Expert parallel: the data-parallel ranks of a MoE model each hold num_experts / N experts, and every sparse MoE
layer sends each token to the ranks holding its experts and brings their outputs back (`enable_expert_parallel`).

Attention stays data-parallel (each rank its own requests); the ranks step in lockstep (dp_wave.py), an idle rank
running dummy steps, so every rank reaches every layer's collectives.

The exchange uses only collectives gloo has (it lacks all_to_all), the same on NCCL (vLLM's "naive" all2all):

- dispatch: an all-gather of each rank's token count, then an all-gather of the hidden states and of the routing
  (fp32 weights and expert ids in one tensor), each padded to the largest count: every rank sees every token.
- every rank runs its own experts on every token routed to them, and sums each token's top-k outputs over its
  experts, in top-k order and in fp32 (`experts_reference` with the other ranks' experts absent; on CUDA too: the
  fused kernel has no map of absent experts yet, so EP runs the experts eagerly in PyTorch).
- combine: an all-reduce of those partial sums (fp32), from which each rank keeps its own tokens' rows.

Cost per sparse layer: three collectives (a sync of the host on the counts), N * max_count * (H + 2K) values gathered
and N * max_count * H fp32 values all-reduced: the all-reduce moves N times what a reduce-scatter would, the price of
one code path gloo runs. The combine sums a token's partials in a fixed order (two ranks: a + b; more: the group's
deterministic rank-order sum in batch-invariant mode), so its result depends on nothing but the values; it differs
from one rank's top-k sum by fp32 rounding (the experts' terms are added per rank first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlserve.model.parallel import TensorParallelGroup


@dataclass(frozen=True)
class ExpertShard:
    """The experts of one rank: [first, first + count) of `total`."""

    total: int
    first: int
    num_local: int

    def is_local(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.num_local


def shard_experts(num_experts: int, ep: TensorParallelGroup) -> ExpertShard:
    if num_experts % ep.size:
        raise ValueError(
            f"enable_expert_parallel: the model's {num_experts} experts do not divide over data_parallel_size "
            f"{ep.size} ranks"
        )
    count = num_experts // ep.size
    return ExpertShard(num_experts, ep.rank * count, count)


@dataclass(frozen=True)
class Dispatched:
    """Every rank's tokens, padded to `max_count` rows per rank: x [N * M, H], routing weights/ids [N * M, K]
    (ids in global numbering), `rows` this rank's rows of them."""

    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    rows: slice


def dispatch(ep: TensorParallelGroup, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Dispatched:
    num_tokens, top_k = ids.shape
    counts = ep.all_gather(torch.tensor([num_tokens], dtype=torch.long, device=x.device), dim=0).tolist()
    most = max(counts)
    padded = x.new_zeros(most, x.shape[1])
    padded[:num_tokens] = x
    # Padding rows route nowhere (id -1: no rank's expert), so they cost nothing and sum to zero.
    routing = torch.zeros(most, 2 * top_k, dtype=torch.float32, device=x.device)
    routing[:, top_k:] = -1
    routing[:num_tokens, :top_k] = weights
    routing[:num_tokens, top_k:] = ids.float()  # expert ids are exact in fp32 below 2**24
    routing = ep.all_gather(routing, dim=0)
    start = ep.rank * most
    return Dispatched(
        ep.all_gather(padded, dim=0),
        routing[:, :top_k],
        routing[:, top_k:].long(),
        slice(start, start + num_tokens),
    )


def local_ids(ids: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """Global expert ids as this rank's indices; -1 where another rank holds the expert."""
    local = ids - shard.first
    return torch.where((local >= 0) & (local < shard.num_local), local, torch.full_like(local, -1))


def combine(ep: TensorParallelGroup, partial: torch.Tensor, sent: Dispatched, dtype: torch.dtype) -> torch.Tensor:
    """This rank's tokens' sums over every rank's experts, from each rank's fp32 `partial` [N * M, H]."""
    return ep.all_reduce(partial.float())[sent.rows].to(dtype)
