"""Fused Triton sampling for the common RL batch: temperature only, and at most the chosen token's logprob.

One program per row streams the row's logits in their own dtype (fp32 math). In the same pass it keeps a running
argmax and, when logprobs are wanted, an online max and sum of exponentials for the log-sum-exp. Random rows take the
Gumbel-max argmax, argmax_v(logit_v / T - log E_v) with E_v ~ Exp(1): the same exact sample from softmax(logit / T)
as the PyTorch path's exponential race, in the log domain so nothing needs normalising first. Greedy rows take the raw
argmax (lowest index on ties, as torch.argmax). With logprobs, a second loop over the row counts the entries whose
value is at least the chosen token's: its rank, as gather_logprobs computes it.

Uniforms come from Philox keyed by one seed per call. Counter row * ceil(V / 4) + v // 4 yields four numbers, one for
each of four neighbouring v, so every (row, v) gets its own number at a quarter of the Philox work of one call per v.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlserve.config import LogprobsMode

# Large enough that the per-block reductions are amortised, small enough to keep the per-lane argmax in registers.
_BLOCK = 4096
_NUM_WARPS = 8


@triton.jit
def _mode_values(x, temperature, is_greedy, row_max, log_sum, PROCESSED: tl.constexpr, LOG_SOFTMAX: tl.constexpr):
    """The logprobs mode's values of raw logits x (greedy rows' processed values are their raw ones)."""
    values = x
    if PROCESSED:
        values = tl.where(is_greedy, x, x / temperature)
    if LOG_SOFTMAX:
        values = (values - row_max) - log_sum  # log_softmax's own order of operations, for matching ranks
    return values


# The seed changes every call: specialising on its value (== 1, divisible by 16) would only add compiled variants.
@triton.jit(do_not_specialize=["seed"])
def _sample_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    greedy_ptr,
    token_ptr,
    value_ptr,
    rank_ptr,
    seed,
    vocab_size,
    SAMPLE: tl.constexpr,  # some row is random
    LOGPROBS: tl.constexpr,  # write the chosen token's value and rank
    PROCESSED: tl.constexpr,  # values are of logit / T rather than the raw logit
    LOG_SOFTMAX: tl.constexpr,  # values are log-probabilities rather than logits
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    temperature = tl.load(temperature_ptr + row)
    is_greedy = tl.load(greedy_ptr + row) != 0
    offs = tl.arange(0, BLOCK)
    counters = row * tl.cdiv(vocab_size, 4) + tl.arange(0, BLOCK // 4)

    # Per lane: lanes see increasing v, so a strict > keeps the lowest index among equal keys.
    best_key = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    row_max = float("-inf")  # finite after the first block: every block holds at least one real logit
    sum_exp = 0.0
    for start in range(0, vocab_size, BLOCK):
        idx = start + offs
        x = tl.load(row_ptr + idx, mask=idx < vocab_size, other=float("-inf")).to(tl.float32)
        key = x
        if SAMPLE:
            u0, u1, u2, u3 = tl.rand4x(seed, counters + start // 4)
            # Which of the four lands on which v is immaterial; this puts them on neighbouring v.
            u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [BLOCK])
            # tl.rand is in [0, 1): u = 0 gives gumbel -inf (never chosen), and u < 1 keeps -log(u) > 0, finite gumbel.
            key = tl.where(is_greedy, x, x / temperature - tl.log(-tl.log(u)))
        better = key > best_key
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, idx, best_idx)
        if LOGPROBS and LOG_SOFTMAX:
            values = _mode_values(x, temperature, is_greedy, 0.0, 0.0, PROCESSED, False)  # before log_softmax
            new_max = tl.maximum(row_max, tl.max(values, 0))
            sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(values - new_max), 0)
            row_max = new_max
    top = tl.max(best_key, 0)
    token = tl.min(tl.where(best_key == top, best_idx, vocab_size), 0)
    tl.store(token_ptr + row, token.to(tl.int64))

    if LOGPROBS:
        log_sum = 0.0
        if LOG_SOFTMAX:
            log_sum = tl.log(sum_exp)
        x_token = tl.load(row_ptr + token).to(tl.float32)
        token_value = _mode_values(x_token, temperature, is_greedy, row_max, log_sum, PROCESSED, LOG_SOFTMAX)
        at_least = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab_size, BLOCK):
            idx = start + offs
            x = tl.load(row_ptr + idx, mask=idx < vocab_size, other=float("-inf")).to(tl.float32)
            values = _mode_values(x, temperature, is_greedy, row_max, log_sum, PROCESSED, LOG_SOFTMAX)
            at_least += ((values >= token_value) & (idx < vocab_size)).to(tl.int32)
        tl.store(value_ptr + row, token_value)
        tl.store(rank_ptr + row, tl.sum(at_least, 0).to(tl.int64))


def fused_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    seed: int,
    all_greedy: bool,
    logprobs_mode: LogprobsMode | None,
    block: int = _BLOCK,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sample one token per row of logits [N, V] with temperature only; greedy rows take the argmax.

    temperature [N] float32 and greedy [N] bool are SamplingMetadata's; seed keys this call's random numbers. With a
    logprobs_mode, also returns the chosen tokens' values in that mode [N] float32 and their ranks [N] int64;
    otherwise those are None. Nothing here reads device memory on the host.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    device = logits.device
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    values = ranks = None
    if logprobs_mode is not None:
        values = torch.empty(num_rows, dtype=torch.float32, device=device)
        ranks = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return token_ids, values, ranks
    _sample_kernel[(num_rows,)](
        logits, logits.stride(0), temperature, greedy, token_ids,
        token_ids if values is None else values, token_ids if ranks is None else ranks,  # unused without LOGPROBS
        seed, vocab_size,
        SAMPLE=not all_greedy,
        LOGPROBS=logprobs_mode is not None,
        PROCESSED=logprobs_mode is not None and logprobs_mode.startswith("processed"),
        LOG_SOFTMAX=logprobs_mode is not None and logprobs_mode.endswith("logprobs"),
        BLOCK=block,
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    return token_ids, values, ranks
