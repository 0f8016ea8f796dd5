"""The trainer process of benchmarks/weight_sync.py (started with multiprocessing's spawn): it holds the model's
weights as separate tensors with HF names and sends them to the engine side as that process asks, full or, for
--sparse, as patches of one Adam step."""

from __future__ import annotations

import json
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
from weight_sync_shared import (
    MODELS,
    TIMEOUT_S,
    MemoryProbe,
    ModelShape,
    broadcast_buckets,
    make_weights,
    receive_message,
    request_reply,
    send_message,
    synchronize,
)

from rlserve.weight_transfer import (
    IPCStagingBuffer,
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    tensor_sha256,
)
from rlserve.weight_transfer.packed import slot_buffers
from rlserve.weight_transfer.sparse_nccl import SparseDelta


def trainer_main(conn: Connection, spec: str) -> None:
    try:
        _trainer(conn, json.loads(spec))
    except Exception as e:
        send_message(conn, {"error": repr(e)})
        raise


def _trainer(conn: Connection, spec: dict[str, Any]) -> None:
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["trainer_device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    weights = make_weights(MODELS[spec["model"]], device)
    memory = MemoryProbe(device)
    group = None
    if spec["backend"] != "ipc":
        group = NCCLWeightTransferEngine.trainer_init(
            {"master_address": "127.0.0.1", "master_port": spec["port"], "world_size": 2, "timeout_s": TIMEOUT_S}
        )
    while True:
        cmd = receive_message(conn)
        if cmd["cmd"] == "exit":
            break
        if cmd["cmd"] == "raw":  # the ceilings: one broadcast of the model's size, or the bucket sequence
            buffers = slot_buffers(cmd["sizes"], cmd["num_buffers"], device)
            for _ in range(cmd["reps"]):
                receive_message(conn)  # go
                broadcast_buckets(group, buffers, cmd["sizes"])
                synchronize(device)
            del buffers
            continue
        if cmd["cmd"] == "sparse":
            _trainer_sparse(conn, weights, cmd, MODELS[spec["model"]])
            continue
        memory.start()
        times: list[float] = []
        round_trips: list[float] = []  # per update, its chunks sent until the engine answered: the rest is packing

        def send(info: dict[str, Any], round_trips: list[float] = round_trips) -> None:
            sent = time.perf_counter()
            request_reply(conn, {"update_info": info})
            round_trips[-1] += time.perf_counter() - sent

        # `keep`: one staging buffer for all of the configuration's updates, exported (and mapped) once.
        staging = IPCStagingBuffer(cmd["buffer"]) if cmd["keep"] else None
        for _ in range(cmd["updates"]):
            if spec["backend"] == "ipc":
                round_trips.append(0.0)
                args = IPCTrainerSendWeightsArgs(
                    send_mode=send, packed=cmd["packed"], packed_buffer_size_bytes=cmd["buffer"], staging=staging
                )
                t0 = time.perf_counter()
                IPCWeightTransferEngine.trainer_send_weights(iter(weights.items()), args)
            else:
                receive_message(conn)  # go
                args = NCCLTrainerSendWeightsArgs(
                    group=group,
                    packed=cmd["packed"],
                    packed_buffer_size_bytes=cmd["buffer"],
                    packed_num_buffers=cmd["num_buffers"],
                )
                t0 = time.perf_counter()
                NCCLWeightTransferEngine.trainer_send_weights(iter(weights.items()), args)
            synchronize(device)
            times.append(time.perf_counter() - t0)
            memory.after_update()
        report = memory.report()  # with a kept buffer, after its last update, in use as in every update before
        del staging
        send_message(conn, {"done": True, "times": times, "round_trips": round_trips, "memory": report})
    if group is not None:
        group.shutdown()


def adam_step_version(
    weights: dict[str, torch.Tensor], shape: ModelShape, lr: float = 1e-6, batch: int = 4, seq: int = 512
) -> dict[str, torch.Tensor]:
    """The bf16 weights after one Adam step at `lr` on fp32 master weights equal to `weights`: a Qwen3 model of the
    shape, a forward and backward of random tokens (embedding rows of tokens not in the batch get no gradient, as
    in training)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, tie_word_embeddings=shape.tied,
    )  # fmt: skip
    device = next(iter(weights.values())).device
    with torch.device(device):
        model = Qwen3ForCausalLM(config).float()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    tokens = torch.randint(
        0, shape.vocab, (batch, seq), device=device, generator=torch.Generator(device).manual_seed(0)
    )
    model(input_ids=tokens, labels=tokens).loss.backward()
    torch.optim.Adam(model.parameters(), lr=lr).step()
    return {name: params[name].detach().to(torch.bfloat16) for name in weights}


def _trainer_sparse(conn: Connection, weights: dict[str, torch.Tensor], cmd: dict[str, Any], shape: ModelShape) -> None:
    device = next(iter(weights.values())).device
    versions = [weights, adam_step_version(weights, shape)]
    delta = SparseDelta(weights.items())

    def send(items: list[tuple[str, torch.Tensor]], buffer: int) -> None:
        args = IPCTrainerSendWeightsArgs(
            send_mode=lambda info: request_reply(conn, {"update_info": info}),
            packed=True,
            packed_buffer_size_bytes=buffer,
        )
        IPCWeightTransferEngine.trainer_send_weights(iter(items), args)

    send(list(weights.items()), max(t.nbytes for t in weights.values()))  # the engine starts from v0
    times, changed, patch_bytes = [], 0, 0
    phases: dict[str, list[float]] = {"diff": [], "send and apply": [], "commit": []}
    for i in range(cmd["updates"]):
        synchronize(device)
        t0 = time.perf_counter()
        patches = delta.patches(versions[(i + 1) % 2].items())
        synchronize(device)
        t1 = time.perf_counter()
        items = [
            (f"{p.name}.{part}", t)
            for p in patches
            if p.indices.numel()
            for part, t in (("indices", p.indices), ("values", p.values))
        ]
        if not items:
            raise RuntimeError("the Adam step changed no bf16 value: nothing to send")
        patch_bytes = sum(t.nbytes for _, t in items)
        send(items, patch_bytes)  # one chunk: the engine pairs indices with values within it
        t2 = time.perf_counter()
        delta.commit(patches)
        synchronize(device)
        t3 = time.perf_counter()
        times.append(t3 - t0)
        for phase, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            phases[phase].append(seconds)
        changed = sum(p.indices.numel() for p in patches)
    digest = {name: tensor_sha256(t) for name, t in versions[cmd["updates"] % 2].items()}
    medians = {phase: statistics.median(seconds[1:]) for phase, seconds in phases.items()}
    done = {"done": True, "times": times, "phases": medians, "changed": changed, "patch_bytes": patch_bytes}
    send_message(conn, done | {"digest": digest})
