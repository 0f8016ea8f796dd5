"""A step's LogitsAdjustments (rlserve.model.logits_adjustments), built from the requests that use penalties, logit
bias, allowed tokens or bad words; the model runner calls this only for steps that hold such a request.

A request's allowed tokens go to the device once, at its first step. Penalties need each row's token counts on the
device. They are rebuilt every step from the requests' token lists (a flat id list per kind, scattered into [rows,
vocab] counts on the device): host work proportional to those requests' lengths, none for the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlserve.engine.request import PLACEHOLDER, Request
from rlserve.model.logits_adjustments import AllowedTokens, BadWords, LogitBias, LogitsAdjustments, Penalties

Upload = Callable[[list, torch.dtype], torch.Tensor]


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
    bad_rows, bad_last, bad_prefixes = [], [], []
    bad_recent = _TokenIds(prev_sampled, prev_index)
    width = max((len(w) - 1 for i in rows for w in requests[i].sampling_params.bad_words_token_ids or ()), default=0)
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
        for word in p.bad_words_token_ids or ():
            k = len(word) - 1  # vLLM matches the word's prefix against output tokens only
            if k <= len(outputs):
                bad_rows.append(row)
                bad_last.append(word[-1])
                bad_prefixes += [-1] * (width - k) + word[:-1]
                bad_recent.extend(request, [0] * (width - k) + outputs[len(outputs) - k :])
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
        counts = [len(ids) for ids in allowed_ids]
        rows_of_ids = torch.repeat_interleave(  # output_size: no wait for the device to count
            longs(list(range(len(allowed_rows)))), longs(counts), output_size=sum(counts)
        )
        adjust.allowed = AllowedTokens(longs(allowed_rows), rows_of_ids, torch.cat(allowed_ids))
    if bias_rows:
        adjust.bias = LogitBias(longs(bias_rows), longs(bias_ids), floats(bias_values))
    if bad_rows:
        adjust.bad_words = BadWords(
            longs(bad_rows),
            longs(bad_last),
            longs(bad_prefixes).view(len(bad_rows), width),
            bad_recent.upload(upload).view(len(bad_rows), width),
        )
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
