"""The experts a MoE model's router chose for every token, kept per KV-cache slot (vLLM's routed-experts return).

Each forward writes its tokens' choices ([tokens, layers, top_k]) into one static device buffer (`device_rows`, the
`ForwardContext.routed_experts` of every forward, CUDA graphs included); the runner copies the rows back with the
step's other results and files them here by KV slot. Keyed by slot, a prompt prefix served from the prefix cache
keeps the routing of the request that computed it, as its KV is kept. A finished request's routing is read from its
slots: one row per token except the last sampled one, which was never forwarded (vLLM's shape
[num_tokens - 1 - routed_experts_prompt_start, layers, top_k]). A request whose front end may end it on a stop string
is sent its rows step by step instead (the front end then has them when it stops the request), each once.
"""

from __future__ import annotations

import numpy as np
import torch

from rlserve.config import EngineConfig
from rlserve.engine.sched.request import Request
from rlserve.model.models.llama import DecoderSpec
from rlserve.model.moe import routed_experts_dtype


class RoutedExpertsRecorder:
    def __init__(
        self, num_slots: int, num_layers: int, top_k: int, dtype: torch.dtype, max_tokens: int, device: torch.device
    ) -> None:
        self.device_rows = torch.zeros((max_tokens, num_layers, top_k), dtype=dtype, device=device)
        # One spare row at the end: slot -1 (a padding row) lands there, never in a real slot.
        self.by_slot = np.zeros((num_slots + 1, num_layers, top_k), dtype=torch.empty(0, dtype=dtype).numpy().dtype)
        self.recorded: dict[str, int] = {}  # request id -> tokens up to which its routing has been filed

    def record(self, rows: torch.Tensor, slot_mapping: list[int], ends: list[tuple[str, int]]) -> None:
        """File a step's rows (host, one per input token) by slot; `ends`: (request id, tokens computed after it)."""
        self.by_slot[np.asarray(slot_mapping, dtype=np.int64)] = rows.numpy()
        self.recorded.update(ends)

    def take(self, request: Request, block_size: int) -> np.ndarray | None:
        """The routing of `request`'s tokens not sent yet, from its routed_experts_prompt_start to its last forwarded
        one; None if none was computed. Call before its blocks are freed."""
        recorded = self.recorded.get(request.request_id, 0)
        end = min(recorded, request.num_tokens - 1, len(request.block_table) * block_size)
        if end <= 0:
            return None
        start = max(request.sampling_params.routed_experts_prompt_start, request.num_routed_experts_sent)
        positions = np.arange(start, max(start, end))
        request.num_routed_experts_sent = max(start, end)
        table = np.asarray(request.block_table, dtype=np.int64)
        return self.by_slot[table[positions // block_size] * block_size + positions % block_size]

    def forget(self, request_id: str) -> None:
        self.recorded.pop(request_id, None)


def make_routed_experts_recorder(
    config: EngineConfig, spec: DecoderSpec, num_slots: int, device: torch.device
) -> RoutedExpertsRecorder | None:
    """The recorder of a MoE engine with `enable_return_routed_experts` (None without it), one row per KV slot."""
    if not config.enable_return_routed_experts:
        return None
    moe = spec.moe
    if moe is None:
        raise ValueError(f"enable_return_routed_experts: {spec.architecture} has no routed experts (not a MoE model)")
    max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
    return RoutedExpertsRecorder(
        num_slots, spec.num_layers, moe.top_k, routed_experts_dtype(moe.num_experts), max_tokens, device
    )
