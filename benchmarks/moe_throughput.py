"""W1 (rollout) on a Qwen3-30B-A3B-shaped MoE with random bf16 weights, against its roofline and Hugging Face generate.

GPU:  python benchmarks/moe_throughput.py --device cuda
CPU:  python benchmarks/moe_throughput.py --device cpu --preset small-moe --scale 0.03 --dtype float32

30B random weights are 61 GB: no checkpoint is written. The engine loads a safetensors file that is all holes (a sparse
file of zeros: no disk, no write time), then its parameters are drawn at random in place on the device (normal, std
0.02; norms 1), before any timed run. Hugging Face builds the same architecture from its config, randomly initialised
on the device. The two models have different random weights; both route about uniformly, as random routers do.

The roofline of each engine step is the larger of
  - bytes / bandwidth, bytes = the weights the step must read + the KV it reads and writes (each KV-cache block
    once per step, as in benchmarks/roofline.py): every non-expert weight, plus per MoE layer the experts its B tokens
    touch: with top-k routing spread over E experts, B tokens touch E * (1 - (1 - k/E)^B) experts on average (all 128
    from B of about 64 up, 8 for one token), and
  - 2 * active parameters per token * tokens / matmul rate, active = non-expert weights + k experts per MoE layer
    (the LM head counted for every token, attention's own FLOPs not counted, as in benchmarks/throughput.py).
Bandwidth and matmul rate are measured in the same run (benchmarks/roofline.py's measure_ceilings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch
from roofline import Step, measure_ceilings, schedule_of
from throughput import hf_generate_tok_s
from transformers import AutoConfig
from workloads import W1_ENGINE, run_engine, w1_shape, workloads

from rlserve import LLM
from rlserve.engine.frontend.args import add_engine_arguments, engine_kwargs
from rlserve.model.loader import build_model
from rlserve.model.models import SUPPORTED_ARCHITECTURES
from rlserve.model.moe import FusedExperts
from rlserve.toy import PRESETS, make_tokenizer, preset_architecture

SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def write_sparse_checkpoint(path: Path, preset: str, dtype: torch.dtype) -> AutoConfig:
    """A model directory (config, tokenizer, one safetensors file of zeros that takes no disk); returns the config."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    architecture = preset_architecture(preset)
    fields = dict(max_position_embeddings=4096, rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id)
    cfg = AutoConfig.for_model(
        SUPPORTED_ARCHITECTURES[architecture], architectures=[architecture], **(fields | PRESETS[preset])
    )
    cfg.dtype = str(dtype).removeprefix("torch.")
    cfg.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model = build_model(cfg, dtype, torch.device("meta"))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, tensor in model.checkpoint_weights():
        nbytes = tensor.numel() * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # the data: a hole, read back as zeros
    return cfg


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02)


@dataclasses.dataclass(frozen=True)
class ActiveWeights:
    """The model's weight bytes split as a step reads them."""

    dense_params: int  # every parameter outside the experts (attention, router, norms, embeddings, LM head)
    expert_params: int  # one expert's gate, up and down projections
    num_moe_layers: int
    num_experts: int
    top_k: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ActiveWeights:
        experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
        total = sum(p.numel() for p in model.parameters())
        expert_total = sum(p.numel() for m in experts for p in m.parameters())
        moe = model.spec.moe
        return cls(total - expert_total, expert_total // (len(experts) * moe.num_experts), len(experts),
                   moe.num_experts, moe.top_k)  # fmt: skip

    def experts_touched(self, tokens: int) -> float:
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)

    def params_read(self, tokens: int) -> float:
        return self.dense_params + self.num_moe_layers * self.experts_touched(tokens) * self.expert_params

    @property
    def active_per_token(self) -> int:
        return self.dense_params + self.num_moe_layers * self.top_k * self.expert_params


def moe_roofline_seconds(
    steps: list[Step], weights: ActiveWeights, itemsize: int, kv_bytes_per_token: int, bw: float, flops: float
) -> float:
    total = 0.0
    for step in steps:
        moved = weights.params_read(step.new_tokens) * itemsize + step.kv_tokens * kv_bytes_per_token
        total += max(moved / bw, 2 * weights.active_per_token * step.new_tokens / flops)
    return total


def run_hf_random(cfg: AutoConfig, device: torch.device, dtype: torch.dtype, batch: int, in_len: int, out_len: int):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return hf_generate_tok_s(model, device, "dynamic", batch, in_len, out_len)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b-shape", choices=["qwen3-30b-a3b-shape", "small-moe", "tiny-moe"])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of W1's prompts (CPU runs)")
    ap.add_argument("--hf-batch", type=int, default=64, help="Hugging Face's batch (0: no HF baseline)")
    ap.add_argument("--hf-tokens", type=int, default=64, help="tokens Hugging Face generates per sequence")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    add_engine_arguments(ap, defaults={"device": "cuda" if torch.cuda.is_available() else "cpu", **W1_ENGINE})
    args = ap.parse_args()
    if "dtype" not in vars(args):
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    return args


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    workdir = Path(tempfile.mkdtemp(prefix="rlserve-moe-bench-"))
    cfg = write_sparse_checkpoint(workdir / "model", args.preset, dtype)
    ceilings = measure_ceilings(device)
    bw, flops = ceilings.bandwidth, ceilings.matmul_flops
    print(f"ceilings: copy {bw / 1e12:.3f} TB/s, matmul {flops / 1e12:.1f} TFLOP/s", flush=True)
    hf_tok_s = None
    if args.hf_batch:  # first, while the GPU is empty
        t0 = time.perf_counter()
        hf_tok_s = run_hf_random(cfg, device, dtype, args.hf_batch, w1_shape(args.scale).prompt_len, args.hf_tokens)
        print(json.dumps(dict(baseline="hf-dynamic", batch=args.hf_batch, tok_s=hf_tok_s,
                              seconds_with_init=time.perf_counter() - t0)), flush=True)  # fmt: skip
    os.environ["RLSERVE_ENABLE_MULTIPROCESSING"] = "0"  # the runner's model and steps are read in this process
    t0 = time.perf_counter()
    llm = LLM(str(workdir / "model"), **engine_kwargs(args))
    runner = llm.engine_core.runner
    randomize(runner.model, seed=0)
    (workdir / "model" / "model.safetensors").unlink()
    startup = time.perf_counter() - t0
    weights = ActiveWeights.of(runner.model)
    spec = runner.spec
    kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype.itemsize
    total = weights.dense_params + weights.num_moe_layers * weights.num_experts * weights.expert_params
    print(
        f"engine start {startup:.1f}s (load of a sparse checkpoint + random init); {total / 1e9:.2f} B parameters, "
        f"{weights.active_per_token / 1e9:.2f} B active per token; KV cache {runner.num_blocks} blocks",
        flush=True,
    )
    prompts, params = workloads("W1", spec.vocab_size, args.scale, seed=0)
    run_engine(llm, prompts, params)  # first run: Triton compiles, allocators grow
    llm.reset_prefix_cache()
    steps0 = llm.engine_core.num_steps
    seconds, out_tokens = run_engine(llm, prompts, params)
    timed_steps = llm.engine_core.num_steps - steps0
    # The roofline's schedule from an untimed run: recording inside the timed one would slow it (roofline.recording).
    steps, _ = schedule_of(llm, prompts, params)
    if timed_steps != len(steps):
        print(f"the timed run took {timed_steps} steps, the roofline's schedule {len(steps)}", flush=True)
    roof = moe_roofline_seconds(steps, weights, dtype.itemsize, kv_bytes_per_token, bw, flops)
    row = dict(
        workload="W1",
        preset=args.preset,
        seconds=seconds,
        output_tokens=out_tokens,
        tok_s=out_tokens / seconds,
        roofline_s=roof,
        roofline_tok_s=out_tokens / roof,
        fraction=roof / seconds,
        steps=timed_steps,
        max_batch=max(step.batch for step in steps),
        hf_tok_s=hf_tok_s,
        hf_batch=args.hf_batch,
        speedup_vs_hf=None if not hf_tok_s else out_tokens / seconds / hf_tok_s,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    )
    print(json.dumps(row), flush=True)
    print(
        f"\nW1 {args.preset}: {row['tok_s']:,.0f} out tok/s, roofline {row['roofline_tok_s']:,.0f} tok/s "
        f"({row['fraction']:.1%} of it), {row['steps']} steps"
        + (
            f"; HF generate (batch {args.hf_batch}) {hf_tok_s:,.0f} tok/s, rlserve {row['speedup_vs_hf']:.1f}x"
            if hf_tok_s
            else ""
        )
    )
    if args.out:
        Path(args.out).write_text(json.dumps(dict(row=row, copy_bw=bw, matmul_flops=flops), indent=1))
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
