"""The roofline of a generation run: the least time a GPU can take for the schedule the engine ran, so that no run
reaches more than 100% of it. Every benchmark that reports a fraction of the roofline computes it here.

Each step is bound by memory traffic or by arithmetic, whichever takes longer, and the run's floor is the sum over
its steps:

    step_s = max(bytes / bandwidth, flops / matmul_rate)
    bytes  = weight_bytes + kv_bytes_per_token x kv_tokens
    flops  = 2 x body_params x new_tokens + 2 x head_params x sampled_rows

- weight_bytes: every weight read once per step. An untied input embedding counts only the rows of the step's
  tokens (a gather, not a read of the table); tied to the LM head, the head's product reads it all anyway.
- kv_tokens: the KV the step reads or writes, each KV-cache block counted once per step however many sequences
  attend to it. A prompt's blocks shared by its n samples (W2's GRPO groups) or by prefix-cache hits are read once:
  an attention kernel could read them once (cascade attention does), so a bound may not charge them n times. The
  step's new KV is written once. kv_bytes_per_token = 2 x layers x kv_heads x head_dim x dtype bytes.
- flops: the projections and MLP of every computed token (body_params: every weight but the embedding and the LM
  head), and the LM head only for the rows that sample (a prefill chunk computes logits for its sequence's last
  position at most). Attention's own FLOPs are left out, which keeps the bound a bound.
- bandwidth: the larger of a device-to-device copy's rate (bytes read + written) and a reduction's (bytes read);
  matmul_rate: a large bf16 (fp32 on CPU) product's. Both are measured in the same run: rates a kernel attains, not
  datasheet peaks, so a kernel faster than both could still show above 100%; none does at these shapes.

Before 2026-12-01 the benchmarks charged every sequence its whole context (a shared prompt n times, and the new KV
twice) and every computed token the FLOPs of all parameters, embedding and LM head included. On the H200 W2 then read
112% (61,302 tok/s against 54,750). `python benchmarks/roofline.py` replays W1-W3's schedules on the CPU (the
scheduler's decisions do not depend on the model's size when the KV cache is as large as the GPU's) and restates the
recorded figures under both models.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from workloads import W1_ENGINE, run_engine, workloads


@dataclass(frozen=True)
class Step:
    new_tokens: int  # tokens computed (prompt chunks and decoded tokens)
    kv_tokens: int  # distinct KV tokens read or written: each cache block once
    sampled_rows: int  # sequences that sample a token (their LM-head row is computed)
    batch: int  # sequences in the step
    context_tokens: int  # sum of every sequence's context, shared blocks counted per sequence (the old model)


@dataclass
class StepLog:
    steps: list[Step] = field(default_factory=list)


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # read every step (see embedding_row_bytes)
    embedding_row_bytes: int  # an untied input embedding's row, read per token; 0 when tied (inside weight_bytes)
    body_params: int  # weights multiplied by every computed token
    head_params: int  # the LM head's, multiplied by each sampled row
    kv_bytes_per_token: int
    all_params: int  # the old model's weights and FLOPs per token
    param_bytes: int


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s
    matmul_flops: float  # FLOP/s


def model_cost(
    model: torch.nn.Module, spec, dtype: torch.dtype, num_kv_heads: int | None = None, tp_size: int = 1
) -> ModelCost:
    """The cost figures of rlserve's decoder (DecoderForCausalLM and its DecoderSpec) in `dtype`. Under tensor
    parallelism `model` is rank 0's part (its `num_kv_heads`, a 1/`tp_size` slice of the vocabulary): every rank
    reads and multiplies its own part at once, so a step's floor is one rank's (the all-reduces are not in it)."""
    size = dtype.itemsize
    all_params = sum(p.numel() for p in model.parameters())  # a tied head is one parameter
    embedding = spec.vocab_size * spec.hidden_size // tp_size
    head = embedding
    num_kv_heads = spec.num_kv_heads if num_kv_heads is None else num_kv_heads
    untied_embedding = 0 if spec.tie_word_embeddings else embedding
    return ModelCost(
        weight_bytes=(all_params - untied_embedding) * size,
        embedding_row_bytes=0 if spec.tie_word_embeddings else spec.hidden_size * size,
        body_params=all_params - head - untied_embedding,
        head_params=head,
        kv_bytes_per_token=2 * spec.num_layers * num_kv_heads * spec.head_dim * size,
        all_params=all_params,
        param_bytes=size,
    )


def step_seconds(step: Step, cost: ModelCost, ceilings: Ceilings) -> float:
    moved = cost.weight_bytes + cost.embedding_row_bytes * step.new_tokens + cost.kv_bytes_per_token * step.kv_tokens
    flops = 2 * cost.body_params * step.new_tokens + 2 * cost.head_params * step.sampled_rows
    return max(moved / ceilings.bandwidth, flops / ceilings.matmul_flops)


def roofline_seconds(steps: Sequence[Step], cost: ModelCost, ceilings: Ceilings) -> float:
    return sum(step_seconds(s, cost, ceilings) for s in steps)


def previous_roofline_seconds(steps: Sequence[Step], cost: ModelCost, ceilings: Ceilings) -> float:
    """The model the benchmarks used before 2026-12-01, for restating recorded figures (see the module doc)."""
    total = 0.0
    for s in steps:
        moved = cost.all_params * cost.param_bytes + cost.kv_bytes_per_token * (s.context_tokens + s.new_tokens)
        total += max(moved / ceilings.bandwidth, 2 * cost.all_params * s.new_tokens / ceilings.matmul_flops)
    return total


def record_step(scheduled, block_size: int) -> Step:
    """A step's figures from the scheduler's list (rlserve.engine.sched.batch.ScheduledRequest), read at launch, when
    each request's num_computed_tokens is still the step's start."""
    kv_per_block: dict[int, int] = {}
    sampled = context = 0
    for item in scheduled:
        request = item.request
        end = request.num_computed_tokens + item.num_new_tokens
        context += end
        sampled += end >= request.num_prompt_tokens
        for i, block in enumerate(request.block_table[: -(-end // block_size)]):
            kv_per_block[block] = max(kv_per_block.get(block, 0), min(block_size, end - i * block_size))
    return Step(
        new_tokens=sum(item.num_new_tokens for item in scheduled),
        kv_tokens=sum(kv_per_block.values()),
        sampled_rows=sampled,
        batch=len(scheduled),
        context_tokens=context,
    )


@contextmanager
def recording(llm) -> Iterator[StepLog]:
    """Record every step the engine launches while inside (a benchmark-only wrapper around the runner's launch; the
    core in process). Its Python walk of every request's block table runs inside the step and costs up to half of
    W1's throughput on the 0.6B shape: time runs outside it, and take their schedule from `schedule_of`."""
    log = StepLog()
    runner = llm.engine_core.runner
    launch = runner.launch

    def logged(scheduled, prev):
        log.steps.append(record_step(scheduled, runner.block_size))
        return launch(scheduled, prev)

    runner.launch = logged
    try:
        yield log
    finally:
        runner.launch = launch


def schedule_of(llm, prompts, params) -> tuple[list[Step], int]:
    """The steps the engine runs for these requests and their output tokens, recorded in a run of their own (untimed;
    prefix cache reset first). The scheduler's decisions depend on the requests and the KV cache alone (EOS ignored:
    fixed lengths), so this is the schedule of a timed run of the same requests; callers compare the step counts."""
    llm.reset_prefix_cache()
    with recording(llm) as log:
        _, out_tokens = run_engine(llm, prompts, params)
    llm.reset_prefix_cache()
    return log.steps, out_tokens


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure_ceilings(device: torch.device) -> Ceilings:
    """Bandwidth: the larger of a copy's (read + written bytes) and a sum's (read bytes); matmul: bf16 on CUDA, fp32
    on CPU. Medians of 10."""
    cuda = device.type == "cuda"
    nbytes, dim = (1 << 30, 8192) if cuda else (1 << 26, 512)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16 if cuda else torch.float16, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_s = statistics.median(timed(lambda: dst.copy_(src), device) for _ in range(10))
    read_s = statistics.median(timed(lambda: src.sum(dtype=torch.float32), device) for _ in range(10))
    mat = torch.randn(dim, dim, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    matmul_s = statistics.median(timed(lambda: mat @ mat, device) for _ in range(10))
    if cuda:
        src = dst = mat = None
        torch.cuda.empty_cache()
    return Ceilings(bandwidth=max(2 * nbytes / copy_s, nbytes / read_s), matmul_flops=2 * dim**3 / matmul_s)


# ---- restating recorded figures: W1-W3's schedules replayed on the CPU ----

# Recorded H200 runs: (label, workload, output tok/s, old roofline tok/s, copy bandwidth B/s or None). Where a run
# did not record its bandwidth, it is the one at which the old model gives the recorded roofline on the replayed
# schedule. Matmul rate 779.5 TFLOP/s (000f9a9's, the one recorded): prefill is a small part of these runs. 000f9a9's
# W2 ran before the sibling deferral (288 steps, 2.9% prefix hits): today's scheduler no longer makes that schedule.
RECORDED = (
    ("000f9a9 W1 (steady state)", "W1", 54_627, 81_539, 4.133e12),
    ("000f9a9 W3", "W3", 21_630, 35_668, 4.133e12),
    ("a36bd69 W1", "W1", 57_458, 80_317, None),
    ("a36bd69 W2", "W2", 45_618, 53_769, None),
    ("2026-12-01 W2 (issue 21)", "W2", 61_302, 54_750, None),
    ("d183c47 W1 batch-invariant", "W1", 40_036, 79_437, None),  # recorded as 50.4% of the roofline
)
RECORDED_MATMUL_FLOPS = 779.5e12
H200_KV_BLOCKS = 72_239  # the engine's KV cache on the H200 (gpu_memory_utilization 0.9), block size 16


def replay_schedules(names: Sequence[str], scale: float = 1.0) -> dict[str, tuple[list[Step], int]]:
    """Run each workload once on the CPU with a tiny model, its forward stubbed, and the H200's engine settings and
    KV-cache size: the scheduler makes the decisions it makes there (lengths are fixed: EOS ignored; its decisions
    never read the model's outputs)."""
    import os

    from rlserve import LLM
    from rlserve.toy import make_model_dir

    os.environ["RLSERVE_ENABLE_MULTIPROCESSING"] = "0"
    model_dir = make_model_dir(tempfile.mkdtemp(), preset="tiny", max_position_embeddings=4096)
    llm = LLM(str(model_dir), device="cpu", dtype="bfloat16", num_kv_blocks=H200_KV_BLOCKS, block_size=16, **W1_ENGINE)
    runner = llm.engine_core.runner
    # Only the schedule counts: the decoder's forward is replaced by hidden states of zeros (the runner's own host
    # work and the sampler are real), as benchmarks/host_overhead.py --with-runner does.
    hidden_size = runner.spec.hidden_size
    runner.model.forward = lambda ids, positions, ctx: torch.zeros(ids.shape[0], hidden_size, dtype=torch.bfloat16)
    vocab = runner.spec.vocab_size
    schedules = {}
    for name in names:
        prompts, params = workloads(name, vocab, scale, seed=0)
        schedules[name] = schedule_of(llm, prompts, params)
    llm.shutdown()
    return schedules


def fitted_bandwidth(steps: Sequence[Step], cost: ModelCost, out_tokens: int, old_roofline_tok_s: float) -> float:
    """The bandwidth at which the old model gives `old_roofline_tok_s` on these steps (bisection; it is monotone)."""
    low, high = 1e11, 1e14
    for _ in range(60):
        mid = (low * high) ** 0.5
        seconds = previous_roofline_seconds(steps, cost, Ceilings(mid, RECORDED_MATMUL_FLOPS))
        low, high = (mid, high) if out_tokens / seconds < old_roofline_tok_s else (low, mid)
    return (low * high) ** 0.5


def restate(schedules: dict[str, tuple[list[Step], int]], cost: ModelCost) -> list[dict]:
    rows = []
    for label, name, tok_s, old_roofline_tok_s, bandwidth in RECORDED:
        if name not in schedules:
            continue
        steps, out_tokens = schedules[name]
        bandwidth = bandwidth or fitted_bandwidth(steps, cost, out_tokens, old_roofline_tok_s)
        ceilings = Ceilings(bandwidth, RECORDED_MATMUL_FLOPS)
        rows.append(
            dict(
                run=label,
                steps=len(steps),
                tok_s=tok_s,
                bandwidth=bandwidth,
                recorded_roofline_tok_s=old_roofline_tok_s,
                replayed_old_roofline_tok_s=out_tokens / previous_roofline_seconds(steps, cost, ceilings),
                roofline_tok_s=out_tokens / roofline_seconds(steps, cost, ceilings),
            )
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="fraction of each workload's prompts (a quick check); below 1 the recorded figures, of full-size runs, "
        "are not restated",
    )
    args = ap.parse_args()
    from transformers import AutoConfig

    from rlserve.model.loader import build_model
    from rlserve.toy import PRESETS

    # The benchmarks' model, allocated without weights: its shapes are all the costs need.
    config = AutoConfig.for_model("qwen3", architectures=["Qwen3ForCausalLM"], **PRESETS["qwen3-0.6b-shape"])
    model = build_model(config, torch.bfloat16, torch.device("cpu"))
    cost = model_cost(model, model.spec, torch.bfloat16)
    del model
    schedules = replay_schedules(args.workloads.split(","), args.scale)
    for name, (steps, _) in schedules.items():
        print(
            f"{name}: {len(steps)} steps, {sum(s.new_tokens for s in steps):,} tokens computed, "
            f"KV tokens per step {sum(s.kv_tokens for s in steps) / len(steps):,.0f} distinct vs "
            f"{sum(s.context_tokens for s in steps) / len(steps):,.0f} summed over sequences"
        )
    if args.scale != 1.0:
        return 0
    print(
        f"\n{'run':<26} {'steps':>6} {'TB/s':>6} {'tok/s':>8} {'old roof':>9} {'replayed':>9} {'of old':>7} "
        f"{'roofline':>9} {'of it':>6}"
    )
    for r in restate(schedules, cost):
        print(
            f"{r['run']:<26} {r['steps']:>6} {r['bandwidth'] / 1e12:>6.3f} {r['tok_s']:>8,} "
            f"{r['recorded_roofline_tok_s']:>9,} "
            f"{r['replayed_old_roofline_tok_s']:>9,.0f} {r['tok_s'] / r['recorded_roofline_tok_s']:>7.1%} "
            f"{r['roofline_tok_s']:>9,.0f} {r['tok_s'] / r['roofline_tok_s']:>6.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
