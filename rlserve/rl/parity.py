"""Train/inference parity: how far the engine's logprobs of sampled tokens are from a trainer's forward on them.

The trainer-side API (`compare_logprobs`, `trainer_logprobs`) is `rlserve.rl.trainer_logprobs`. `run_parity` samples
rollouts with rlserve, scores them with it and measures known sources of mismatch (`rlserve parity`, in
rlserve.rl.parity_report, prints them as a table):

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

import gc
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from rlserve.dtypes import TORCH_DTYPES
from rlserve.engine.frontend.llm import LLM, load_tokenizer
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
    "tiny-moe-fp8": 16.0,
    "qwen3-0.6b-shape": 8.0,
    "tiny-moe": 16.0,
    "small-moe": 16.0,
}
# How rows and their labels name a dtype.
SHORT_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

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


@dataclass(frozen=True)
class ParityRun:
    """What the scenarios of one `run_parity` call share: the prompts (and, for prefix_cache, the same prompts after a
    shared prefix), the sampling, the engines' sizes and the trainer-side reference model."""

    model_dir: str
    prompts: list[list[int]]
    shared: list[list[int]]
    sampling: SamplingSetup
    engines: EngineSetup
    reference: nn.Module
    device: str
    dtype: str
    trainer_dtype: str
    seed: int
    update_scale: float
    fp8_method: str

    def score(self, rollouts: Rollouts, trainer_model: nn.Module | None = None, replay: bool = False) -> ParityStats:
        """The rollouts' engine logprobs against `trainer_model`'s (default: the reference's) of the same tokens."""
        sampling = self.sampling
        with torch.inference_mode():
            mine = trainer_logprobs(
                trainer_model or self.reference, rollouts.prompt_ids, rollouts.completion_ids, sampling.temperature,
                sampling.top_k, sampling.top_p, processed=True,
                routed_experts=rollouts.routed_experts if replay else None,
            )  # fmt: skip
        return compare_logprobs(rollouts.logprobs, mine)

    def sample_once(self, llm: LLM) -> Rollouts:
        return sample_rollouts(llm, self.prompts, self.sampling, self.seed)


def _raw_vs_processed(run: ParityRun) -> dict[str, ParityStats]:
    results = {}
    for mode in ("raw", "processed"):
        rollouts = run.engines.run(run.sample_once, dtype=run.dtype, logprobs_mode=f"{mode}_logprobs")
        results[f"raw_vs_processed/{mode}"] = run.score(rollouts)
    return results


def _lm_head(run: ParityRun) -> dict[str, ParityStats]:
    results = {}
    half = lm_head_scenario_dtype(run.dtype)
    for head, lm_head_dtype in ((half, None), ("float32", "float32")):
        rollouts = run.engines.run(
            run.sample_once, dtype=half, logprobs_mode="processed_logprobs", lm_head_dtype=lm_head_dtype
        )
        results[f"lm_head/{SHORT_DTYPE_NAMES[head]}"] = run.score(rollouts)
    return results


def _prefix_cache(run: ParityRun) -> dict[str, ParityStats]:
    old = list(iterate_checkpoint(run.model_dir))
    new = perturbed_weights(run.model_dir, run.update_scale, run.seed)
    shared, sampling, seed = run.shared, run.sampling, run.seed

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

    common = dict(dtype=run.dtype, logprobs_mode="processed_logprobs")
    rounds = run.engines.run(across_update, enable_prefix_caching=True, **common)
    rounds |= run.engines.run(without_cache, enable_prefix_caching=False, **common)
    _write_trainer_weights(run.reference, new)
    return {f"prefix_cache/{name}": run.score(rounds[name]) for name in ("reset", "off", "stale")}


def _batch_invariant(run: ParityRun) -> dict[str, ParityStats]:
    rollouts = run.engines.run(
        run.sample_once, dtype=run.dtype, logprobs_mode="processed_logprobs", batch_invariant=True
    )
    own = load_training_model(run.model_dir, TORCH_DTYPES[run.dtype], run.device, batch_invariant=True)
    return {"batch_invariant": run.score(rollouts, own)}


def _fp8(run: ParityRun) -> dict[str, ParityStats]:
    checkpoint = list(iterate_checkpoint(run.model_dir))

    def across_updates(llm: LLM) -> dict[str, Rollouts]:
        loaded = run.sample_once(llm)
        for k in range(FP8_UPDATES - 1):  # bf16 (the checkpoint's dtype) weights the engine quantizes
            llm.load_weights(perturbed_weights(run.model_dir, run.update_scale, run.seed + k))
        llm.load_weights(checkpoint)
        return {"load": loaded, "10_updates": run.sample_once(llm)}

    half = lm_head_scenario_dtype(run.dtype)
    rounds = run.engines.run(
        across_updates, dtype=half, logprobs_mode="processed_logprobs", quantization=run.fp8_method
    )
    return {f"fp8/{name}": run.score(rollouts) for name, rollouts in rounds.items()}


def _moe_replay(run: ParityRun) -> dict[str, ParityStats]:
    if AutoConfig.from_pretrained(run.model_dir).architectures[0] != "Qwen3MoeForCausalLM":
        raise ValueError(f"scenarios: moe_replay needs a MoE model (Qwen3MoeForCausalLM), {run.model_dir!r} is not one")
    rollouts = run.engines.run(
        run.sample_once,
        dtype=lm_head_scenario_dtype(run.dtype),
        logprobs_mode="processed_logprobs",
        enable_return_routed_experts=True,
    )
    replayer = load_training_model(run.model_dir, TORCH_DTYPES[run.trainer_dtype], run.device)
    return {
        "moe_replay/off": run.score(rollouts, replayer),
        "moe_replay/on": run.score(rollouts, replayer, replay=True),
    }


# Each scenario's measurement, in the order run_parity runs them (and its rows come out).
MEASUREMENTS: dict[str, Callable[[ParityRun], dict[str, ParityStats]]] = {
    "raw_vs_processed": _raw_vs_processed,
    "lm_head": _lm_head,
    "prefix_cache": _prefix_cache,
    "batch_invariant": _batch_invariant,
    "fp8": _fp8,
    "moe_replay": _moe_replay,
}


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
    prefix = random_prompts(model_dir, 1, shared_prefix_len, seed=seed + 1)[0]
    shared = [prefix + p for p in prompts]
    # A KV cache with room for every sequence twice over: the second round's new blocks then come from never-used
    # ones, so the first round's cached prefix is not evicted before the stale-cache round can hit it. Sized here
    # rather than from free memory, so a GPU run needs no profiling pass and engines start quickly one after another.
    block_size = engine_kwargs.get("block_size", 16)
    blocks = sum(-(-(len(p) + max_tokens) // block_size) for p in shared)
    max_len = max(len(p) for p in shared) + max_tokens
    run = ParityRun(
        model_dir=model_dir,
        prompts=prompts,
        shared=shared,
        sampling=SamplingSetup(max_tokens, temperature, top_k, top_p),
        engines=EngineSetup(model_dir, device, 2 * blocks, min(len(prompts), 256), max_len, engine_kwargs),
        reference=load_trainer(model_dir, trainer, TORCH_DTYPES[trainer_dtype], device),
        device=device,
        dtype=dtype,
        trainer_dtype=trainer_dtype,
        seed=seed,
        update_scale=update_scale,
        fp8_method=fp8_method,
    )
    results: dict[str, ParityStats] = {}
    for scenario, measure in MEASUREMENTS.items():
        if scenario in scenarios:
            results |= measure(run)
    return results
