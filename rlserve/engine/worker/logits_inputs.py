"""A step's LogitsAdjustments (rlserve.model.logits_adjustments), built from the requests that use penalties, logit
bias, allowed tokens or bad words; the model runner calls this only for steps that hold such a request.

A request's allowed tokens go to the device once, at its first step. Penalties need each row's token counts on the
device. They are rebuilt every step from the requests' token lists (a flat id list per kind, scattered into [rows,
vocab] counts on the device): host work proportional to those requests' lengths, none for the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlserve.engine.sched.request import PLACEHOLDER, BadWordsOnDevice, Request
from rlserve.model.logits_adjustments import AllowedTokens, BadWords, LogitBias, LogitsAdjustments, Penalties

Upload = Callable[[list, torch.dtype], torch.Tensor]
NO_TOKEN = -2  # in a row's window of recent tokens, before its first output token: no bad word's prefix matches it


class _TokenIds:
    """Token ids bound for the device. A request's newest output token can still be a placeholder (async scheduling:
    the previous step sampled it and has not been read back); its value is taken from that step's samples on the
    device. Only the newest can be: the core reads a step back before it launches the one after next."""

    def __init__(self, prev_sampled: torch.Tensor | None, prev_index: dict[str, int]) -> None:
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.sources: list[int] = []
        self.prev_sampled = prev_sampled
        self.prev_index = prev_index

    def extend(self, request: Request, token_ids: list[int]) -> None:
        """Add `token_ids`, which end with the request's newest tokens when they hold a placeholder."""
        self.ids.extend(token_ids)
        if token_ids and token_ids[-1] == PLACEHOLDER:
            self.positions.append(len(self.ids) - 1)
            self.sources.append(self.prev_index[request.request_id])

    def upload(self, upload: Upload) -> torch.Tensor:
        ids = upload(self.ids, torch.long)
        if self.positions:
            ids[upload(self.positions, torch.long)] = self.prev_sampled[upload(self.sources, torch.long)]
        return ids


def _allowed_token_ids(request: Request, upload: Upload) -> torch.Tensor:
    """The request's allowed ids on the device, each once: built at its first step only (its list can hold as many
    ids as the vocabulary, which every step would otherwise walk and upload again)."""
    if request.allowed_token_ids_on_device is None:
        ids = sorted(set(request.sampling_params.allowed_token_ids))
        request.allowed_token_ids_on_device = upload(ids, torch.long)
    return request.allowed_token_ids_on_device


def _has_bad_words(request: Request) -> bool:
    return bool(request.sampling_params.bad_words_token_ids)


def _bad_words(request: Request, upload: Upload) -> BadWordsOnDevice:
    """The request's bad words on the device, built at its first step only: each step then builds one window of
    recent tokens per row, not one per word (128 long words had made a request 7.5x slower)."""
    if request.bad_words_on_device is None:
        words = request.sampling_params.bad_words_token_ids
        width = max(len(w) - 1 for w in words)
        prefixes = [t for w in words for t in [-1] * (width - len(w) + 1) + w[:-1]]  # right-aligned; -1: any
        request.bad_words_on_device = BadWordsOnDevice(
            upload([w[-1] for w in words], torch.long), upload(prefixes, torch.long).view(len(words), width), width
        )
    return request.bad_words_on_device


def build_logits_adjustments(
    requests: list[Request],
    rows: list[int],
    upload: Upload,
    prev_sampled: torch.Tensor | None,
    prev_index: dict[str, int],
) -> LogitsAdjustments:
    """The adjustments of `rows` (indices into `requests`, the step's sampling rows); `prev_sampled` and `prev_index`
    are the previous step's sampled ids on the device and each request's row in them."""
    allowed_rows, allowed_ids = [], []
    bias_rows, bias_ids, bias_values = [], [], []
    bad_rows, bad_words = [], []
    bad_recent = _TokenIds(prev_sampled, prev_index)
    width = max((_bad_words(requests[i], upload).width for i in rows if _has_bad_words(requests[i])), default=0)
    penalty_rows, repetition, frequency, presence = [], [], [], []
    prompt_index, prompt_ids, output_index = [], [], []
    output_ids = _TokenIds(prev_sampled, prev_index)
    for row in rows:
        request = requests[row]
        p = request.sampling_params
        if p.allowed_token_ids is not None:
            allowed_ids.append(_allowed_token_ids(request, upload))
            allowed_rows.append(row)
        if p.logit_bias:
            bias_rows += [row] * len(p.logit_bias)
            bias_ids += p.logit_bias.keys()
            bias_values += p.logit_bias.values()
        outputs = request.output_token_ids
        if _has_bad_words(request):
            bad_rows.append(row)
            bad_words.append(_bad_words(request, upload))
            # vLLM matches a word's prefix against output tokens only: positions before the first face NO_TOKEN.
            recent = outputs[max(len(outputs) - width, 0) :]
            bad_recent.extend(request, [NO_TOKEN] * (width - len(recent)) + recent)
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            index = len(penalty_rows)
            penalty_rows.append(row)
            repetition.append(p.repetition_penalty)
            frequency.append(p.frequency_penalty)
            presence.append(p.presence_penalty)
            if p.repetition_penalty != 1.0:  # the only one that reads the prompt
                prompt_index += [index] * request.num_prompt_tokens
                prompt_ids += request.prompt_token_ids
            output_index += [index] * len(outputs)
            output_ids.extend(request, outputs)

    def longs(values: list[int]) -> torch.Tensor:
        return upload(values, torch.long)

    def floats(values: list[float]) -> torch.Tensor:
        return upload(values, torch.float32)

    adjust = LogitsAdjustments()
    if allowed_rows:
        adjust.allowed = _allowed_tokens(allowed_rows, allowed_ids, longs)
    if bias_rows:
        adjust.bias = LogitBias(longs(bias_rows), longs(bias_ids), floats(bias_values))
    if bad_rows:
        adjust.bad_words = _bad_words_batch(bad_rows, bad_words, bad_recent, width, upload)
    if penalty_rows:
        adjust.penalties = Penalties(
            longs(penalty_rows),
            floats(repetition),
            floats(frequency),
            floats(presence),
            longs(prompt_index),
            longs(prompt_ids),
            longs(output_index),
            output_ids.upload(upload),
        )
    return adjust


def _allowed_tokens(
    rows: list[int], ids: list[torch.Tensor], longs: Callable[[list[int]], torch.Tensor]
) -> AllowedTokens:
    counts = [len(row_ids) for row_ids in ids]
    rows_of_ids = torch.repeat_interleave(  # output_size: no wait for the device to count
        longs(list(range(len(rows)))), longs(counts), output_size=sum(counts)
    )
    return AllowedTokens(longs(rows), rows_of_ids, torch.cat(ids))


def _bad_words_batch(
    rows: list[int], words: list[BadWordsOnDevice], recent: _TokenIds, width: int, upload: Upload
) -> BadWords:
    """One entry per (row, bad word): each word's prefix padded to `width`, against its row's recent tokens."""
    counts = [len(row_words.last_token_ids) for row_words in words]
    word_row = torch.repeat_interleave(
        upload(list(range(len(rows))), torch.long), upload(counts, torch.long), output_size=sum(counts)
    )
    prefixes = [F.pad(row_words.prefixes, (width - row_words.width, 0), value=-1) for row_words in words]
    return BadWords(
        upload(rows, torch.long)[word_row],
        torch.cat([row_words.last_token_ids for row_words in words]),
        torch.cat(prefixes),
        recent.upload(upload).view(len(rows), width)[word_row],
    )
