"""The workloads every benchmark shares (BENCHMARKS.md's W1-W3, and W7's prompts: W1 through the server) and the
engine settings W1's tuned runs use.

Imported by throughput.py, roofline.py and the others; it imports no other benchmark, so imports go one way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlserve import LLM, SamplingParams

# Engine settings that hold all of W1's 1,024 sequences in one batch; the benchmarks that run W1 share them.
W1_ENGINE = {"max_num_seqs": 1024, "max_num_batched_tokens": 16384, "max_model_len": 2048}


@dataclass(frozen=True)
class W1Shape:
    """W1 at a scale: `num_prompts` prompts of `prompt_len` random tokens, each sampling `output_len` tokens (the
    Hugging Face baselines generate at its lengths too)."""

    num_prompts: int
    prompt_len: int
    output_len: int


def w1_shape(scale: float) -> W1Shape:
    length = max(4, int(256 * scale**0.5))
    return W1Shape(num_prompts=max(1, int(1024 * scale)), prompt_len=length, output_len=length)


def w1_sampling(max_tokens: int) -> SamplingParams:
    """W1's sampling (and W7's): temperature 1.0, top-p 1.0, a fixed length (EOS ignored)."""
    return SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True)


def w7_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """W7's prompts, W1's through the server at any size: `num` prompts of `length` random token ids from `seed`."""
    g = torch.Generator().manual_seed(seed)
    # Leave the top ids out: the toy tokenizer's special tokens sit there.
    return torch.randint(0, vocab - 3, (num, length), generator=g).tolist()


def workloads(name: str, vocab: int, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)

    def rand_prompt(n):
        return {"prompt_token_ids": torch.randint(0, vocab - 3, (n,), generator=g).tolist()}

    if name == "W1":
        shape = w1_shape(scale)
        prompts = [rand_prompt(shape.prompt_len) for _ in range(shape.num_prompts)]
        return prompts, [w1_sampling(shape.output_len)] * shape.num_prompts
    if name == "W2":
        n = max(1, int(128 * scale))
        p_len, o_len = max(4, int(512 * scale**0.5)), max(4, int(256 * scale**0.5))
        return [rand_prompt(p_len) for _ in range(n)], [
            SamplingParams(n=8, temperature=1.0, max_tokens=o_len, ignore_eos=True)
        ] * n
    if name == "W3":
        n = max(1, int(256 * scale))
        lo, hi = max(4, int(100 * scale**0.5)), max(8, int(1024 * scale**0.5))
        ins = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
        outs = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
        return [rand_prompt(i) for i in ins], [
            SamplingParams(temperature=1.0, max_tokens=o, ignore_eos=True) for o in outs
        ]
    raise ValueError(name)


def run_engine(llm: LLM, prompts, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, sum(len(c.token_ids) for o in outs for c in o.outputs)
