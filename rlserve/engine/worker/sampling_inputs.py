"""A step's SamplingMetadata (rlserve.model.sampler) from its sampling requests: temperatures, top-k/p, min-p, seeds,
min-tokens masks and logprobs, and the logits adjustments of the requests that have any (logits_inputs.py)."""

from __future__ import annotations

import torch

from rlserve.engine.sched.request import Request
from rlserve.engine.worker.logits_inputs import Upload, build_logits_adjustments
from rlserve.model.sampler import SamplingMetadata


def sampling_metadata(
    requests: list[Request],
    adjusting_logits: set[str],
    vocab: int,
    upload: Upload,
    prev_sampled: torch.Tensor | None,
    prev_index: dict[str, int],
) -> SamplingMetadata:
    """The sampler's view of the step's sampling `requests` (in row order). `adjusting_logits`: the ids of the
    unfinished requests with penalties, logit bias or token masks; `prev_sampled`, `prev_index`: the previous step's
    sampled ids on the device and each request's row in them (for placeholders)."""
    params = [r.sampling_params for r in requests]
    greedy = [p.greedy for p in params]

    column = upload

    any_top_k = any(p.top_k > 0 and not g for p, g in zip(params, greedy, strict=True))
    any_top_p = any(p.top_p < 1.0 and not g for p, g in zip(params, greedy, strict=True))
    any_min_p = any(p.min_p > 0.0 and not g for p, g in zip(params, greedy, strict=True))
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    adjustments = None
    if adjusting_logits:  # empty on the common path, which then pays nothing for these
        rows = [i for i, r in enumerate(requests) if r.request_id in adjusting_logits]
        if rows:
            adjustments = build_logits_adjustments(requests, rows, upload, prev_sampled, prev_index)
    return SamplingMetadata(
        temperature=column([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], torch.float32),
        greedy=column(greedy, torch.bool),
        top_k=column([p.top_k if p.top_k > 0 else vocab for p in params], torch.long) if any_top_k else None,
        top_p=column([p.top_p for p in params], torch.float32) if any_top_p else None,
        min_p=column([p.min_p for p in params], torch.float32) if any_min_p else None,
        generators=[r.generator for r in requests],
        min_tokens_mask=[(i, sorted(r.stop_ids)) for i, r in enumerate(requests) if r.below_min_tokens and r.stop_ids],
        max_num_logprobs=max(wanted) if wanted else -1,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        adjustments=adjustments,
    )
