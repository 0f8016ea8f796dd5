"""Per-request changes to the logits before temperature, in vLLM's order: allowed-token masks and bad words (to -inf),
logit bias (added), then repetition, frequency and presence penalties.

Only the rows of requests that use one of them are touched, and only in steps that hold such a request: the model
runner builds a LogitsAdjustments for those steps and leaves it None otherwise. Every operation here is row-wise and
exact (integer token counts, elementwise arithmetic, gathers and scatters at distinct indices), so a request's result
does not depend on which other requests share its batch: batch-invariant mode needs nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AllowedTokens:
    rows: torch.Tensor  # [A] batch rows that sample only among their allowed tokens
    row_index: torch.Tensor  # [M] index into `rows` of each allowed (row, token) pair ...
    token_ids: torch.Tensor  # [M] ... and its token


@dataclass
class LogitBias:
    rows: torch.Tensor  # [M] batch row of each (row, token, bias): distinct (row, token) pairs
    token_ids: torch.Tensor  # [M]
    values: torch.Tensor  # [M] float32


@dataclass
class BadWords:
    """One entry per (row, bad word) whose prefix fits in the row's output: the word's last token is banned when the
    row's last output tokens equal the word's other tokens (always, for a one-token word)."""

    rows: torch.Tensor  # [P] batch row
    last_token_ids: torch.Tensor  # [P] the word's last token
    prefixes: torch.Tensor  # [P, W] the word's other tokens, right-aligned; -1 pads (match anything)
    recent: torch.Tensor  # [P, W] the row's last W output tokens, right-aligned like `prefixes`


@dataclass
class Penalties:
    rows: torch.Tensor  # [R] batch rows with a penalty
    repetition: torch.Tensor  # [R] float32
    frequency: torch.Tensor  # [R] float32
    presence: torch.Tensor  # [R] float32
    prompt_row_index: torch.Tensor  # [Lp] index into `rows` of each prompt token below ...
    prompt_token_ids: torch.Tensor  # [Lp] every prompt token of the rows (only repetition reads the prompt)
    output_row_index: torch.Tensor  # [Lo] index into `rows` of each output token below ...
    output_token_ids: torch.Tensor  # [Lo] every output token of the rows


@dataclass
class LogitsAdjustments:
    """What the step's rows change; each part None when no row of the step uses it."""

    allowed: AllowedTokens | None = None
    bad_words: BadWords | None = None
    bias: LogitBias | None = None
    penalties: Penalties | None = None


def apply_logits_adjustments(logits: torch.Tensor, adjust: LogitsAdjustments) -> torch.Tensor:
    """Apply `adjust` to float32 logits [N, V] in place and return them."""
    if adjust.allowed is not None:
        a = adjust.allowed
        banned = torch.ones(a.rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
        banned[a.row_index, a.token_ids] = False
        logits[a.rows] = logits[a.rows].masked_fill_(banned, float("-inf"))
    if adjust.bad_words is not None:
        b = adjust.bad_words
        matched = ((b.recent == b.prefixes) | (b.prefixes < 0)).all(-1)
        # Adding 0 or -inf: a word banned twice (its plain and spaced forms can share a last token) stays banned.
        bans = torch.where(matched, float("-inf"), 0.0)
        logits.index_put_((b.rows, b.last_token_ids), bans, accumulate=True)
    if adjust.bias is not None:
        c = adjust.bias
        logits[c.rows, c.token_ids] += c.values
    if adjust.penalties is not None:
        logits[adjust.penalties.rows] = apply_penalties(logits[adjust.penalties.rows], adjust.penalties)
    return logits


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """logits [R, V] of the penalised rows, penalised: repetition over prompt and output tokens (a seen token's
    positive logit divided by the penalty, a negative one multiplied, as Hugging Face's RepetitionPenaltyLogitsProcessor
    and vLLM), then frequency (per occurrence) and presence (once) over output tokens, as OpenAI defines them."""
    num_rows, vocab = logits.shape
    # Integer counts: exact, and the same whatever the order of the scatter's atomic adds.
    counts = torch.zeros(num_rows * vocab, dtype=torch.int32, device=logits.device)
    ones = torch.ones_like(p.output_token_ids, dtype=torch.int32)
    counts.scatter_add_(0, p.output_row_index * vocab + p.output_token_ids, ones)
    counts = counts.view(num_rows, vocab)
    in_output = counts > 0
    seen = torch.zeros(num_rows * vocab, dtype=torch.bool, device=logits.device)
    seen[p.prompt_row_index * vocab + p.prompt_token_ids] = True
    seen = seen.view(num_rows, vocab) | in_output
    repetition = p.repetition.unsqueeze(-1)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - p.frequency.unsqueeze(-1) * counts - p.presence.unsqueeze(-1) * in_output
