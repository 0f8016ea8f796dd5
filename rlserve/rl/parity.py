"""Train/inference parity: how far the engine's logprobs of sampled tokens are from a trainer's forward on them.

The trainer-side API (`compare_logprobs`, `trainer_logprobs`) is `rlserve.rl.trainer_logprobs`. `run_parity` and
`rlserve parity` sample rollouts with rlserve, score them with it and measure three known sources of mismatch:

- raw_vs_processed: at temperature != 1 the engine's `raw_logprobs` (the model's distribution) are not the
  distribution it sampled from; `processed_logprobs` are. The trainer side is the processed (sampled) distribution.
- lm_head: a 16-bit engine with its LM head in the model dtype vs in fp32 (`lm_head_dtype="float32"`).
- prefix_cache: a weight update between two rounds of prompts that share a long prefix. rlserve resets the prefix
  cache on every update ("reset"); "off" runs without prefix caching; "stale" shows the bug the reset prevents by
  writing the new weights with `load_weights(..., reset_prefix_cache=False)`, as a custom weight-sync extension that
  forgets the reset would, which leaves KV computed under the old weights in the cache.
- batch_invariant: the engine in batch-invariant mode against its reference, rlserve's batch-invariant trainer-side
  forward in the engine's dtype (not `trainer`): zero difference, bit for bit.
- fp8: a 16-bit engine with FP8 projections (`quantization`, rlserve.model.fp8), as loaded ("load") and after ten
  weight updates of bf16 weights that it quantizes itself, the last of them back to the trainer's weights
  ("10_updates"): requantizing each update from what was sent leaves no drift, so the two rows are equal.
- moe_replay (a MoE model): a 16-bit engine's rollouts with their routed experts, scored by rlserve's forward routing
  each token itself ("off") and replaying the engine's routing ("on", R3). A token whose top-k the two sides' roundings
  flip goes through other experts, the main train/inference mismatch of MoE models; replay removes it.

The trainer side always scores the processed distribution: the behaviour policy of the importance ratio is the
distribution that was sampled from.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from rlserve.dtypes import TORCH_DTYPES
from rlserve.engine.frontend.llm import LLM, load_tokenizer
from rlserve.hub import resolve_model
from rlserve.model.fp8 import FP8_METHODS
from rlserve.model.loader import checkpoint_files, iterate_checkpoint
from rlserve.model.models.llama import DecoderForCausalLM
from rlserve.rl.train_forward import load_training_model
from rlserve.rl.trainer_logprobs import ParityStats, TokenIds, compare_logprobs, trainer_logprobs
from rlserve.sampling_params import SamplingParams
from rlserve.toy import make_model_dir

SCENARIOS = ("raw_vs_processed", "lm_head", "prefix_cache", "batch_invariant", "moe_replay", "fp8")
# What runs unless asked otherwise: the dense model's scenarios (moe_replay needs a MoE model, fp8 one whose
# projections are whole 128x128 blocks).
DEFAULT_SCENARIOS = SCENARIOS[:4]
# The fp8 scenario's weight updates; and the preset `rlserve parity` builds for it (the small one's k/v projections
# have 64 rows, not a whole block).
FP8_UPDATES = 10
FP8_PRESET = "tiny-fp8"
# Random models give near-uniform next-token distributions, where every logprob is about -log(vocab) and mismatches
# look smaller than on a trained model. Scaling the logits by these factors (powers of two) brings the mean entropy of
# the toys' next-token distributions to 2-3 nats (uniform: 5.6 for the toy vocabulary, 11.9 for Qwen3's), with top-1
# probabilities of 0.3-0.5: about as peaked as a trained model's.
HEAD_SCALES = {
    "tiny": 16.0,
    "small": 16.0,
    "tiny-fp8": 16.0,
    "qwen3-0.6b-shape": 8.0,
    "tiny-moe": 16.0,
    "small-moe": 16.0,
}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

T = TypeVar("T")


# ---- the trainer model ----


def load_trainer(model_dir: str | Path, trainer: str, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """trainer="hf": Hugging Face transformers; "rlserve": rlserve's decoder in training mode."""
    if trainer == "hf":
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    if trainer == "rlserve":
        return load_training_model(model_dir, dtype, device)
    raise ValueError(f"trainer must be 'hf' or 'rlserve', got {trainer!r}")


@torch.no_grad()
def _write_trainer_weights(model: nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(model, DecoderForCausalLM):
        model.load_weights(weights)
        return
    for name, tensor in weights:
        model.get_parameter(name).copy_(tensor)


# ---- models and prompts ----


def make_peaked_model_dir(
    path: str | Path,
    preset: str = "small",
    head_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """A random Qwen3 (or, for a MoE preset, Qwen3-MoE) toy (rlserve.toy) whose logits are multiplied by head_scale
    (default: HEAD_SCALES[preset]).

    The scale goes into the final RMSNorm weight, which feeds only the LM head: the logits are exactly those of an LM
    head scaled by head_scale (exactly in any dtype for a power of two), and a tied input embedding stays unchanged.
    """
    head_scale = HEAD_SCALES[preset] if head_scale is None else head_scale
    path = make_model_dir(path, preset=preset, seed=seed, dtype=dtype)
    for file in checkpoint_files(str(path)):
        tensors = load_file(file)
        if "model.norm.weight" in tensors:
            tensors["model.norm.weight"] = tensors["model.norm.weight"] * head_scale
            save_file(tensors, file, metadata={"format": "pt"})
    return path


def random_prompts(model_dir: str | Path, num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids below the vocabulary size of both the model and its tokenizer."""
    vocab = min(AutoConfig.from_pretrained(str(model_dir)).vocab_size, len(load_tokenizer(str(model_dir))))
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]


@dataclass(frozen=True)
class Peakedness:
    """Of a model's next-token distributions (temperature 1): how far from flat a parity test's model is."""

    entropy: float  # mean entropy, nats
    top1: float  # mean probability of the most likely token
    uniform_entropy: float  # log(vocab): the entropy of a flat distribution


@torch.inference_mode()
def peakedness(model_dir: str | Path, prompts: TokenIds, device: str = "cpu") -> Peakedness:
    """Measured with transformers in fp32 at every prompt position."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    entropies, top1s = [], []
    for p in prompts:
        logprobs = model(input_ids=torch.tensor([list(p)], device=device), use_cache=False).logits[0].log_softmax(-1)
        entropies.append(-(logprobs.exp() * logprobs).sum(-1).cpu())
        top1s.append(logprobs.max(-1).values.exp().cpu())
    return Peakedness(
        entropy=float(torch.cat(entropies).mean()),
        top1=float(torch.cat(top1s).mean()),
        uniform_entropy=math.log(model.config.vocab_size),
    )


def perturbed_weights(model_dir: str | Path, scale: float, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's weights plus Gaussian noise of `scale` times each tensor's RMS: a stand-in optimizer step."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for name, tensor in iterate_checkpoint(str(model_dir)):
        t = tensor.float()
        noise = torch.randn(t.shape, generator=generator) * (scale * float(t.pow(2).mean().sqrt()))
        out.append((name, (t + noise).to(tensor.dtype)))
    return out


# ---- engine rollouts ----


@dataclass(frozen=True)
class Rollouts:
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]  # the engine's logprob of each completion token
    num_cached_tokens: list[int]  # prefix-cache hits of each request
    routed_experts: list[np.ndarray] | None = None  # with enable_return_routed_experts: each sequence's routing


@dataclass(frozen=True)
class SamplingSetup:
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float

    def params(self, seed: int) -> SamplingParams:
        """Seeded per request, so a run is reproducible; fixed lengths (EOS ignored); only the sampled token's
        logprob; no detokenization (random-token prompts need not be text)."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_tokens=self.max_tokens,
            seed=seed,
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
        )


def sample_rollouts(llm: LLM, prompts: TokenIds, sampling: SamplingSetup, seed: int) -> Rollouts:
    """One round; request i samples with seed + i."""
    outputs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in prompts],
        [sampling.params(seed + i) for i in range(len(prompts))],
        use_tqdm=False,
    )
    samples = [o.outputs[0] for o in outputs]
    return Rollouts(
        prompt_ids=[list(p) for p in prompts],
        completion_ids=[list(s.token_ids) for s in samples],
        logprobs=[[lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids, strict=True)] for s in samples],
        num_cached_tokens=[o.num_cached_tokens for o in outputs],
        routed_experts=None if samples[0].routed_experts is None else [s.routed_experts for s in samples],
    )


@dataclass(frozen=True)
class EngineSetup:
    model_dir: str
    device: str
    num_kv_blocks: int
    max_num_seqs: int
    max_model_len: int
    extra: dict[str, Any] = field(default_factory=dict)

    def run(self, work: Callable[[LLM], T], **kwargs: Any) -> T:
        """Start an engine, run `work` on it, and free it before returning, so that engines (each with its KV cache
        and CUDA graphs) never coexist on the device. `extra` overrides the sizes, `kwargs` override `extra`."""
        sizes = dict(num_kv_blocks=self.num_kv_blocks, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len)
        llm = LLM(self.model_dir, device=self.device, **(sizes | self.extra | kwargs))
        try:
            return work(llm)
        finally:
            llm.shutdown()
            del llm
            gc.collect()
            if torch.device(self.device).type == "cuda":
                torch.cuda.empty_cache()


# ---- the scenarios ----


def lm_head_scenario_dtype(dtype: str) -> str:
    """The engine dtype of the lm_head scenario, which is about a 16-bit engine: `dtype`, or bfloat16 for fp32."""
    return dtype if dtype != "float32" else "bfloat16"


def run_parity(
    model_dir: str | Path,
    prompts: TokenIds,
    *,
    scenarios: Iterable[str] = DEFAULT_SCENARIOS,
    max_tokens: int = 32,
    temperature: float = 0.7,
    top_k: int = -1,
    top_p: float = 1.0,
    device: str = "cpu",
    dtype: str = "float32",
    trainer: str = "hf",
    trainer_dtype: str = "float32",
    seed: int = 0,
    shared_prefix_len: int = 64,
    update_scale: float = 0.05,
    fp8_method: str = "fp8",
    **engine_kwargs: Any,
) -> dict[str, ParityStats]:
    """Sample rollouts with rlserve per scenario and compare their logprobs with the trainer's; rows by name.

    The engine runs in `dtype`, except the lm_head scenario, which is about a 16-bit engine: it uses `dtype` if that is
    16-bit and bfloat16 otherwise. The trainer (`trainer` = "hf" or "rlserve", in `trainer_dtype`) is the reference and
    always scores the processed distribution. Rows:
      raw_vs_processed/raw, raw_vs_processed/processed      engine logprobs_mode raw_logprobs / processed_logprobs
      lm_head/<bf16|fp16>, lm_head/fp32                     engine LM head in the model dtype / in fp32
      prefix_cache/reset, prefix_cache/off, prefix_cache/stale
      batch_invariant                                       engine batch_invariant=True vs rlserve's forward of it
      moe_replay/off, moe_replay/on                         16-bit MoE engine vs rlserve's forward in trainer_dtype,
                                                            routing itself / replaying the engine's routed experts
      fp8/load, fp8/10_updates                              16-bit engine with `fp8_method` projections, as loaded /
                                                            after FP8_UPDATES updates ending at the same weights
    For prefix_cache the prompts get a shared prefix of `shared_prefix_len` random tokens, and the weight update adds
    noise of `update_scale` x RMS to every tensor (trainer and engine get the same new weights). `engine_kwargs` go to
    every `LLM` (e.g. attention_backend, enforce_eager).
    """
    scenarios = set(scenarios)
    unknown = scenarios - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenario(s) {sorted(unknown)}; known: {list(SCENARIOS)}")
    if dtype not in TORCH_DTYPES or trainer_dtype not in TORCH_DTYPES:
        raise ValueError(
            f"dtype and trainer_dtype must be one of {list(TORCH_DTYPES)}, got {dtype!r}, {trainer_dtype!r}"
        )
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("prompts: expected at least one prompt")
    model_dir = str(model_dir)
    sampling = SamplingSetup(max_tokens, temperature, top_k, top_p)
    prefix = random_prompts(model_dir, 1, shared_prefix_len, seed=seed + 1)[0]
    shared = [prefix + p for p in prompts]
    # A KV cache with room for every sequence twice over: the second round's new blocks then come from never-used
    # ones, so the first round's cached prefix is not evicted before the stale-cache round can hit it. Sized here
    # rather than from free memory, so a GPU run needs no profiling pass and engines start quickly one after another.
    block_size = engine_kwargs.get("block_size", 16)
    blocks = sum(-(-(len(p) + max_tokens) // block_size) for p in shared)
    max_len = max(len(p) for p in shared) + max_tokens
    engines = EngineSetup(model_dir, device, 2 * blocks, min(len(prompts), 256), max_len, engine_kwargs)
    reference = load_trainer(model_dir, trainer, TORCH_DTYPES[trainer_dtype], device)

    def score(rollouts: Rollouts, trainer_model: nn.Module | None = None, replay: bool = False) -> ParityStats:
        with torch.inference_mode():
            mine = trainer_logprobs(
                trainer_model or reference, rollouts.prompt_ids, rollouts.completion_ids, temperature, top_k, top_p,
                processed=True, routed_experts=rollouts.routed_experts if replay else None,
            )  # fmt: skip
        return compare_logprobs(rollouts.logprobs, mine)

    def sample_once(llm: LLM) -> Rollouts:
        return sample_rollouts(llm, prompts, sampling, seed)

    results: dict[str, ParityStats] = {}
    if "raw_vs_processed" in scenarios:
        for mode in ("raw", "processed"):
            rollouts = engines.run(sample_once, dtype=dtype, logprobs_mode=f"{mode}_logprobs")
            results[f"raw_vs_processed/{mode}"] = score(rollouts)
    if "lm_head" in scenarios:
        half = lm_head_scenario_dtype(dtype)
        for head, lm_head_dtype in ((half, None), ("float32", "float32")):
            rollouts = engines.run(
                sample_once, dtype=half, logprobs_mode="processed_logprobs", lm_head_dtype=lm_head_dtype
            )
            results[f"lm_head/{_SHORT[head]}"] = score(rollouts)
    if "prefix_cache" in scenarios:
        old = list(iterate_checkpoint(model_dir))
        new = perturbed_weights(model_dir, update_scale, seed)

        def across_update(llm: LLM) -> dict[str, Rollouts]:
            sample_rollouts(llm, shared, sampling, seed)  # fills the prefix cache under the old weights
            # The write a weight-sync extension that forgets the reset makes: the prefix cache is left alone.
            llm.load_weights(new, reset_prefix_cache=False)
            stale = sample_rollouts(llm, shared, sampling, seed + len(shared))
            if not any(stale.num_cached_tokens):
                raise RuntimeError("prefix_cache: the stale round hit no cached prefix; the scenario proves nothing")
            llm.load_weights(old)
            sample_rollouts(llm, shared, sampling, seed)
            llm.load_weights(new)  # rlserve's path: the prefix cache is reset with the write
            reset = sample_rollouts(llm, shared, sampling, seed + len(shared))
            return {"reset": reset, "stale": stale}

        def without_cache(llm: LLM) -> dict[str, Rollouts]:
            sample_rollouts(llm, shared, sampling, seed)
            llm.load_weights(new)
            return {"off": sample_rollouts(llm, shared, sampling, seed + len(shared))}

        common = dict(dtype=dtype, logprobs_mode="processed_logprobs")
        rounds = engines.run(across_update, enable_prefix_caching=True, **common)
        rounds |= engines.run(without_cache, enable_prefix_caching=False, **common)
        _write_trainer_weights(reference, new)
        for name in ("reset", "off", "stale"):
            results[f"prefix_cache/{name}"] = score(rounds[name])
    if "batch_invariant" in scenarios:
        rollouts = engines.run(sample_once, dtype=dtype, logprobs_mode="processed_logprobs", batch_invariant=True)
        own = load_training_model(model_dir, TORCH_DTYPES[dtype], device, batch_invariant=True)
        results["batch_invariant"] = score(rollouts, own)
    if "fp8" in scenarios:
        checkpoint = list(iterate_checkpoint(model_dir))

        def across_updates(llm: LLM) -> dict[str, Rollouts]:
            loaded = sample_once(llm)
            for k in range(FP8_UPDATES - 1):  # bf16 (the checkpoint's dtype) weights the engine quantizes
                llm.load_weights(perturbed_weights(model_dir, update_scale, seed + k))
            llm.load_weights(checkpoint)
            return {"load": loaded, "10_updates": sample_once(llm)}

        half = lm_head_scenario_dtype(dtype)
        rounds = engines.run(across_updates, dtype=half, logprobs_mode="processed_logprobs", quantization=fp8_method)
        for name, rollouts in rounds.items():
            results[f"fp8/{name}"] = score(rollouts)
    if "moe_replay" in scenarios:
        if AutoConfig.from_pretrained(model_dir).architectures[0] != "Qwen3MoeForCausalLM":
            raise ValueError(f"scenarios: moe_replay needs a MoE model (Qwen3MoeForCausalLM), {model_dir!r} is not one")
        rollouts = engines.run(
            sample_once,
            dtype=lm_head_scenario_dtype(dtype),
            logprobs_mode="processed_logprobs",
            enable_return_routed_experts=True,
        )
        replayer = load_training_model(model_dir, TORCH_DTYPES[trainer_dtype], device)
        results["moe_replay/off"] = score(rollouts, replayer)
        results["moe_replay/on"] = score(rollouts, replayer, replay=True)
    return results


# ---- output ----

COLUMNS = (
    "scenario", "engine", "reference", "mean|Δ|", "max|Δ|", "k3 KL", "mean ratio", "outside [0.9,1.1]", "ESS",
    "tokens", "expected", "as expected",
)  # fmt: skip
# max|Δ| below which an engine and a reference in fp32 agree to float noise, and above which a row shows a real gap.
FP32_NOISE = 1e-3


@dataclass(frozen=True)
class RowSetup:
    """What one row compares, and what it should show."""

    engine: str  # the engine's dtype (and its LM head's, where it differs)
    reference: str  # what scored the same tokens
    expected: str  # "=0" bit for bit, "~0" float noise, ">0" a real gap, "?" none


def row_setups(dtype: str, trainer: str, trainer_dtype: str, temperature: float) -> dict[str, RowSetup]:
    """Each row's dtypes as run_parity runs it, and its expectation: only an fp32 engine against an fp32 reference can
    be held to ~0 (16-bit rounding is a gap of its own)."""
    engine, half = _SHORT[dtype], _SHORT[lm_head_scenario_dtype(dtype)]
    reference = f"{trainer}-{_SHORT[trainer_dtype]}"
    same = "~0" if dtype == trainer_dtype == "float32" else "?"
    return {
        "raw_vs_processed/raw": RowSetup(engine, reference, ">0" if temperature != 1.0 else same),
        "raw_vs_processed/processed": RowSetup(engine, reference, same),
        f"lm_head/{half}": RowSetup(half, reference, "?"),
        "lm_head/fp32": RowSetup(f"{half}+fp32-head", reference, "?"),
        "prefix_cache/reset": RowSetup(engine, reference, same),
        "prefix_cache/off": RowSetup(engine, reference, same),
        "prefix_cache/stale": RowSetup(engine, reference, ">0"),
        "batch_invariant": RowSetup(engine, f"rlserve-bi-{engine}", "=0"),
        "moe_replay/off": RowSetup(half, f"rlserve-{_SHORT[trainer_dtype]}", "?"),
        "moe_replay/on": RowSetup(half, f"rlserve-{_SHORT[trainer_dtype]}+replay", "?"),
        "fp8/load": RowSetup(f"{half}+fp8", reference, "?"),
        "fp8/10_updates": RowSetup(f"{half}+fp8", reference, "?"),
    }


def as_expected(expected: str, stats: ParityStats) -> str:
    """yes / NO for a row with an expectation, - for one without."""
    if expected == "=0":
        holds = stats.max_abs_diff == 0.0
    elif expected == "~0":
        holds = stats.max_abs_diff < FP32_NOISE
    elif expected == ">0":
        holds = stats.max_abs_diff > FP32_NOISE
    else:
        return "-"
    return "yes" if holds else "NO"


def format_table(results: dict[str, ParityStats], setups: dict[str, RowSetup]) -> str:
    """One row per result, with the dtypes each side really used and whether the row shows what it should."""
    rows = [COLUMNS] + [
        (
            name,
            setups[name].engine,
            setups[name].reference,
            f"{s.mean_abs_diff:.3e}",
            f"{s.max_abs_diff:.3e}",
            f"{s.k3_kl:.3e}",
            f"{s.mean_ratio:.6f}",
            f"{s.frac_outside:.4f}",
            f"{s.ess:.6f}",
            str(s.num_tokens),
            setups[name].expected,
            as_expected(setups[name].expected, s),
        )
        for name, s in results.items()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    return "\n".join(lines)


LEGEND = (
    "Δ = trainer - engine logprob of each sampled token; k3 KL estimates KL(engine || reference); mean ratio, outside "
    "and ESS are of the importance ratios exp(Δ). expected: =0 bit for bit, ~0 float noise (max|Δ| < {noise:g}), >0 a "
    "real gap the row demonstrates, ? none (16-bit rounding: the size is the finding). NO marks a row that is not "
    "as expected, and makes the exit status 1."
)

SCENARIO_WHAT = {
    "raw_vs_processed": "raw vs processed logprobs (2 engines)",
    "lm_head": "16-bit LM head vs fp32 LM head (2 engines)",
    "prefix_cache": "prefix cache across a weight update: reset, off, stale (2 engines)",
    "batch_invariant": "batch-invariant engine vs its trainer-side forward (1 engine)",
    "moe_replay": "16-bit MoE engine vs rlserve's forward routing itself / replaying the engine's routing (1 engine)",
    "fp8": f"16-bit engine with FP8 projections, as loaded and after {FP8_UPDATES} weight updates (1 engine)",
}


def cmd_parity(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the trainer's loading bars would interleave with the progress lines
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        print(f"rlserve parity: unknown scenario(s) {unknown}; known: {list(SCENARIOS)}", file=sys.stderr)
        return 2
    if args.model is not None:
        print(f"model: {args.model} (used as is)")
        model = resolve_model(args.model)
        return _parity(args, scenarios, dict.fromkeys(scenarios, model))
    with tempfile.TemporaryDirectory(prefix="rlserve-parity-") as workdir:  # removed on the way out
        # A model per kind of scenario: moe_replay's has experts, fp8's whole 128x128 blocks, the others' neither.
        kinds = {"moe_replay": ("moe-model", "small-moe", "Qwen3-MoE (moe_replay)"), "fp8": ("fp8-model", FP8_PRESET)}
        built: dict[str, tuple[str, str]] = {}  # preset -> (directory, description)
        models = {}
        for scenario in scenarios:
            folder, preset, *what = kinds.get(scenario, ("model", "small", "Qwen3"))
            if preset not in built:
                path = str(make_peaked_model_dir(Path(workdir) / folder, preset, args.head_scale))
                built[preset] = path, what[0] if what else f"Qwen3 {preset} ({scenario})"
            models[scenario] = built[preset][0]
        shapes = " and ".join(what for _, what in built.values())
        print(
            f"model: a random small {shapes} (removed at exit), logits x{args.head_scale:g} (final RMSNorm weight, "
            "i.e. an LM head scaled by that factor) so that the distribution is peaked"
        )
        return _parity(args, scenarios, models)


def _parity(args: argparse.Namespace, scenarios: list[str], models: dict[str, str]) -> int:
    """`models`: the model directory of each scenario."""
    model = models[scenarios[0]]
    prompts = random_prompts(model, args.num_prompts, args.prompt_len, seed=args.seed)
    peak = peakedness(model, prompts, args.device)
    print(
        f"next-token distributions: mean entropy {peak.entropy:.2f} nats (flat: {peak.uniform_entropy:.2f}), "
        f"mean top-1 probability {peak.top1:.2f}"
    )
    print(
        f"{args.num_prompts} prompts x {args.prompt_len} random tokens, {args.max_tokens} sampled tokens each, "
        f"temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}; engine {args.dtype} on "
        f"{args.device} (the lm_head rows: {lm_head_scenario_dtype(args.dtype)}); reference: trainer {args.trainer} "
        f"in {args.trainer_dtype} scoring the sampled (processed) distribution, and for batch_invariant rlserve's "
        f"batch-invariant forward in {args.dtype}"
    )
    results: dict[str, ParityStats] = {}
    for i, scenario in enumerate(scenarios, 1):
        print(f"[{i}/{len(scenarios)}] {scenario}: {SCENARIO_WHAT[scenario]} ...", end=" ", flush=True)
        t0 = time.perf_counter()
        # One scenario a call: each starts from the checkpoint's weights (prefix_cache updates its reference's).
        results |= run_parity(
            models[scenario],
            prompts,
            scenarios=[scenario],
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            device=args.device,
            dtype=args.dtype,
            trainer=args.trainer,
            trainer_dtype=args.trainer_dtype,
            seed=args.seed,
            fp8_method=args.fp8_method,
        )
        print(f"{time.perf_counter() - t0:.1f} s", flush=True)
    setups = row_setups(args.dtype, args.trainer, args.trainer_dtype, args.temperature)
    print(format_table(results, setups))
    print(LEGEND.format(noise=FP32_NOISE))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "func"} | {"model": model}
        results_json = {
            name: asdict(s) | asdict(setups[name]) | {"as_expected": as_expected(setups[name].expected, s)}
            for name, s in results.items()
        }
        record = dict(config=config, peakedness=asdict(peak), results=results_json)
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(as_expected(setups[n].expected, s) != "NO" for n, s in results.items()) else 1


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "parity", help="engine vs trainer logprobs: raw/processed, LM head dtype, prefix cache across an update"
    )
    p.add_argument(
        "--model", default=None, help="model directory or hub id (default: build a small peaked random model)"
    )
    p.add_argument(
        "--head-scale", type=float, default=HEAD_SCALES["small"], help="logit scale of the model built without --model"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", choices=list(TORCH_DTYPES), help="engine dtype")
    p.add_argument("--trainer", default="hf", choices=["hf", "rlserve"], help="transformers or rlserve's model")
    p.add_argument("--trainer-dtype", default="float32", choices=list(TORCH_DTYPES), help="trainer dtype")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per scenario")
    p.add_argument("--prompt-len", type=int, default=32, help="random tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens sampled per prompt")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (not 1: raw != processed)")
    p.add_argument("--top-k", type=int, default=-1, help="top-k of the sampling (-1: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of the sampling")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, the sampling and the weight update")
    p.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)} (without --model, moe_replay runs on a small Qwen3-MoE "
        f"and fp8 on the {FP8_PRESET} preset)",
    )
    p.add_argument(
        "--fp8-method",
        default="fp8",
        choices=list(FP8_METHODS),
        help="the fp8 scenario's quantization: fp8 (128x128 blocks) or fbgemm_fp8 (per-channel)",
    )
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON (default: none)")
    p.set_defaults(func=cmd_parity)
