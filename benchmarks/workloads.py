"""The workloads every benchmark shares (BENCHMARKS.md's W1-W3) and the engine settings W1's tuned runs use.

Imported by throughput.py, roofline.py and the others; it imports no other benchmark, so imports go one way.
"""

from __future__ import annotations

import time

import torch

from rlserve import LLM, SamplingParams

# Engine settings that hold all of W1's 1,024 sequences in one batch; the benchmarks that run W1 share them.
W1_ENGINE = {"max_num_seqs": 1024, "max_num_batched_tokens": 16384, "max_model_len": 2048}


def workloads(name: str, vocab: int, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)

    def rand_prompt(n):
        return {"prompt_token_ids": torch.randint(0, vocab - 3, (n,), generator=g).tolist()}

    if name == "W1":
        n = max(1, int(1024 * scale))
        p_len, o_len = max(4, int(256 * scale**0.5)), max(4, int(256 * scale**0.5))
        return [rand_prompt(p_len) for _ in range(n)], [
            SamplingParams(temperature=1.0, top_p=1.0, max_tokens=o_len, ignore_eos=True, seed=None)
        ] * n
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
