"""CPU checks of the fused sampling kernel (rlserve.model.kernels.fused_sampling) under TRITON_INTERPRET=1.

Greedy tokens, logprob values and ranks are held to the PyTorch path's; random tokens to the distribution itself
(chi-square over many rows of identical logits). Block sizes below the vocabulary make the loops run several blocks.
The interpreter runs programs one after another (tens of ms each), so the sample counts stay in the hundreds.

interpret_helpers.py sets the interpreter up (or re-runs these checks in a fresh process where triton was imported
before it could).
"""

from __future__ import annotations

import interpret_helpers  # first: sets TRITON_INTERPRET before anything imports triton
import pytest
import torch

interpret_helpers.require_triton()

from rlserve.model.kernels.fused_sampling import fused_sample  # noqa: E402
from rlserve.model.sampler import Sampler, SamplingMetadata, gather_logprobs  # noqa: E402

interpreted = interpret_helpers.interpreted

if not interpret_helpers.IN_PROCESS:

    def test_in_fresh_process():
        interpret_helpers.run_in_fresh_process(__file__)


MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
NUM_ROWS, VOCAB, BLOCK = 6, 300, 128  # three blocks, the last one partial
TEMPERATURE = torch.tensor([0.7, 1.0, 1.3, 1.0, 0.5, 2.0])  # 1.0 on greedy rows, as SamplingMetadata has it
GREEDY = torch.tensor([False, True, False, True, False, False])


def make_logits(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(NUM_ROWS, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def reference_values(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """The values Sampler's PyTorch path takes logprobs of, with temperature as its only processing."""
    raw = logits.float()
    processed = torch.where(GREEDY.unsqueeze(-1), raw, raw / TEMPERATURE.unsqueeze(-1))
    values = raw if mode.startswith("raw") else processed
    return values.log_softmax(-1) if mode.endswith("logprobs") else values


def greedy_metadata(num_rows: int, max_num_logprobs: int) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.ones(num_rows), greedy=torch.ones(num_rows, dtype=torch.bool), top_k=None, top_p=None,
        min_p=None, generators=[None] * num_rows, min_tokens_mask=[], max_num_logprobs=max_num_logprobs,
        all_greedy=True, all_random=False,
    )  # fmt: skip


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_logprobs_match_pytorch_path(mode, dtype):
    logits = make_logits(dtype)
    tokens, values, ranks = fused_sample(logits, TEMPERATURE, GREEDY, 123, False, mode, block=BLOCK)
    assert torch.equal(tokens[GREEDY], logits.float().argmax(-1)[GREEDY])
    expected = gather_logprobs(reference_values(logits, mode), 0, tokens)
    torch.testing.assert_close(values, expected.token_values, atol=1e-5, rtol=0)
    assert torch.equal(ranks, expected.token_ranks)  # bf16 logits have ties, which count as at least as high


@interpreted
def test_greedy_ties_take_lowest_index():
    logits = make_logits(torch.float32, seed=1)
    logits[1, [10, 129, 260]] = 50.0  # lanes 10, 1 and 4: the lowest index is not in the lowest lane
    logits[3, [172, 44]] = 50.0  # one lane, two blocks
    for all_greedy in (True, False):  # greedy rows without and with random ones in the batch
        greedy = torch.ones_like(GREEDY) if all_greedy else GREEDY
        tokens, values, ranks = fused_sample(logits, TEMPERATURE, greedy, 7, all_greedy, None, block=BLOCK)
        assert values is None and ranks is None
        assert tokens[[1, 3]].tolist() == [10, 44]
        assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])


@interpreted
def test_seed_decides_the_samples():
    logits = make_logits(torch.float32) / 10  # flat enough that two draws rarely agree
    first = fused_sample(logits, TEMPERATURE, GREEDY, 11, False, None, block=BLOCK)[0]
    assert torch.equal(first, fused_sample(logits, TEMPERATURE, GREEDY, 11, False, None, block=BLOCK)[0])
    other = fused_sample(logits, TEMPERATURE, GREEDY, 12, False, None, block=BLOCK)[0]
    assert torch.equal(other[GREEDY], first[GREEDY])
    assert not torch.equal(other[~GREEDY], first[~GREEDY])


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * len(tokens)
    return float(((torch.bincount(tokens, minlength=len(probs)) - expected) ** 2 / expected).sum())


@interpreted
def test_samples_follow_softmax_with_temperature():
    logits = torch.tensor([1.0, 0.5, 0.1, 2.2, 0.3, 0.0, 1.6, 0.2])
    rows, temperature = 256, 0.7  # every class expects at least 5 draws
    tokens, _, _ = fused_sample(
        logits.repeat(rows, 1), torch.full((rows,), temperature), torch.zeros(rows, dtype=torch.bool), 2024, False,
        None, block=8,
    )  # fmt: skip
    critical = 24.32  # chi-square, 7 degrees of freedom, p = 0.001
    assert chi_square(tokens, (logits / temperature).softmax(-1)) < critical
    # The test can tell temperatures apart: these draws do not fit T = 1 (expected statistic ~39).
    assert chi_square(tokens, logits.softmax(-1)) > critical


@interpreted
@pytest.mark.parametrize("max_num_logprobs", [-1, 0])
def test_sampler_output_matches_pytorch_path(max_num_logprobs):
    """Sampler's fused branch returns what its PyTorch path does, down to the empty top-k tensors' shapes and dtypes."""
    logits = make_logits(torch.bfloat16)
    meta = greedy_metadata(NUM_ROWS, max_num_logprobs)
    sampler = Sampler("processed_logprobs")
    fused, reference = sampler._sample_fused(logits, meta), sampler(logits, meta)
    assert torch.equal(fused.token_ids, reference.token_ids)
    if max_num_logprobs < 0:
        assert fused.logprobs is None and reference.logprobs is None
        return
    for name in ("topk_ids", "topk_values", "token_values", "token_ranks"):
        got, want = getattr(fused.logprobs, name), getattr(reference.logprobs, name)
        assert got.shape == want.shape and got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def random_metadata(max_num_logprobs: int) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=TEMPERATURE, greedy=GREEDY, top_k=None, top_p=None, min_p=None, generators=[None] * NUM_ROWS,
        min_tokens_mask=[], max_num_logprobs=max_num_logprobs, all_greedy=False, all_random=False,
    )  # fmt: skip


@interpreted
@pytest.mark.parametrize("mode", MODES)
def test_batch_invariant_fused_path_takes_the_kernels_tokens_and_the_pytorch_values(mode):
    """Batch-invariant mode: the tokens the kernel draws for the seed, and logprob values bit for bit the PyTorch
    passes' at those tokens (what the trainer-side forward computes), not the kernel's online log-sum-exp."""
    logits = make_logits(torch.bfloat16)
    sampler = Sampler(mode, batch_invariant=True)
    torch.manual_seed(5)
    out = sampler._sample_fused_tokens(logits, random_metadata(0))
    torch.manual_seed(5)
    seed = int(torch.randint(2**31 - 1, ()))
    tokens = fused_sample(logits, TEMPERATURE, GREEDY, seed, False, None)[0]
    assert torch.equal(out.token_ids, tokens)
    expected = gather_logprobs(reference_values(logits, mode), 0, tokens)
    assert torch.equal(out.logprobs.token_values, expected.token_values)
    assert torch.equal(out.logprobs.token_ranks, expected.token_ranks)
    assert out.logprobs.topk_ids.shape == (NUM_ROWS, 0)
    assert sampler._sample_fused_tokens(logits, random_metadata(-1)).logprobs is None
