"""What both processes of benchmarks/weight_sync.py use: the model (its shapes and random bf16 weights), the
measurement helpers, and the control channel between them (JSON bytes over a pipe, no pickle)."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

MIB = 1 << 20
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = True


MODELS = {
    "qwen3-0.6b-shape": ModelShape(151936, 1024, 3072, 28, 16, 8, 128),
    "small": ModelShape(32000, 512, 1536, 8, 8, 4, 64),
}


def param_shapes(m: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3's checkpoint tensors in checkpoint order (tied embeddings: no lm_head.weight)."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (m.vocab, m.hidden))]
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    for i in range(m.layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (m.hidden,)),
            (p + "self_attn.q_proj.weight", (q, m.hidden)),
            (p + "self_attn.k_proj.weight", (kv, m.hidden)),
            (p + "self_attn.v_proj.weight", (kv, m.hidden)),
            (p + "self_attn.o_proj.weight", (m.hidden, q)),
            (p + "self_attn.q_norm.weight", (m.head_dim,)),
            (p + "self_attn.k_norm.weight", (m.head_dim,)),
            (p + "post_attention_layernorm.weight", (m.hidden,)),
            (p + "mlp.gate_proj.weight", (m.intermediate, m.hidden)),
            (p + "mlp.up_proj.weight", (m.intermediate, m.hidden)),
            (p + "mlp.down_proj.weight", (m.hidden, m.intermediate)),
        ]
    shapes.append(("model.norm.weight", (m.hidden,)))
    if not m.tied:
        shapes.append(("lm_head.weight", (m.vocab, m.hidden)))
    return shapes


def make_weights(m: ModelShape, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights from `seed`; the same on every device of one type (the generator is device-independent)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        for name, shape in param_shapes(m)
    }


# --- measurement helpers --------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MemoryProbe:
    """Allocator readings on one side of the transfer (CUDA only; None on CPU, whose allocator keeps no stats)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cuda"
        self.resident = 0
        self.first: int | None = None
        self.last: int | None = None

    def start(self) -> None:
        if self.enabled:
            torch.cuda.ipc_collect()
            torch.cuda.synchronize(self.device)
            self.resident = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.first = self.last = None

    def after_update(self) -> None:
        if self.enabled:
            torch.cuda.ipc_collect()
            allocated = torch.cuda.memory_allocated(self.device)
            self.first = allocated if self.first is None else self.first
            self.last = allocated

    def report(self) -> dict[str, float | None]:
        if not self.enabled:
            return {"peak_extra_mib": None, "first_mib": None, "last_mib": None}
        peak = torch.cuda.max_memory_allocated(self.device) - self.resident
        return {"peak_extra_mib": peak / MIB, "first_mib": self.first / MIB, "last_mib": self.last / MIB}


def broadcast_buckets(group: Any, buffers: list[torch.Tensor], sizes: list[int]) -> None:
    """The raw bucket sequence, the same on both sides: bucket i from/into buffer i % len(buffers), as many in
    flight as there are buffers (a broadcast into a buffer is issued once the previous one in it is done)."""
    in_flight: deque[Any] = deque()
    for i, size in enumerate(sizes):
        if len(in_flight) == len(buffers):
            in_flight.popleft().wait()
        in_flight.append(group.broadcast(buffers[i % len(buffers)][:size]))
    while in_flight:
        in_flight.popleft().wait()


# --- control channel: JSON bytes over a pipe (no pickle) ----------------------------------------------------------


def send_message(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())


def receive_message(conn: Connection) -> dict[str, Any]:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError("the other side of the benchmark went silent")
    message = json.loads(conn.recv_bytes())
    if "error" in message:
        raise RuntimeError(f"trainer failed: {message['error']}")
    return message


def request_reply(conn: Connection, message: dict[str, Any]) -> dict[str, Any]:
    send_message(conn, message)
    return receive_message(conn)
