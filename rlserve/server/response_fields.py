"""Engine outputs as the fields of OpenAI responses: usage, logprobs (of the prompt, of a completion, of a chat
reply), weight versions and routed experts."""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from typing import Any

from rlserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput, npy_bytes
from rlserve.server.openai_requests import _GenerationRequest
from rlserve.server.openai_responses import (
    ChatCompletionLogProbs,
    ChatLogprobContent,
    ChatTopLogprob,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    UsageInfo,
    WeightVersionSpan,
)

# OpenAI's convention for a logprob of -inf (JSON has no infinity).
NEG_INF_LOGPROB = -9999.0


class Usage:
    """Token counts of one API request, summed over its prompts and choices."""

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def add(self, index: int, out: RequestOutput) -> None:
        self.prompt_tokens[index] = len(out.prompt_token_ids)
        self.cached_tokens[index] = out.num_cached_tokens
        self.completion_tokens += sum(len(s.token_ids) for s in out.outputs)

    def info(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())),
        )


class WeightVersions:
    """Each choice's weight-version fields as the request asks: vLLM's `weight_versions`, spans over all its tokens
    on its last chunk, and rlserve's `token_weight_versions`, the version of each token of the chunk."""

    def __init__(self, spans: bool, per_token: bool) -> None:
        self.spans = spans
        self.per_token = per_token
        self.seen: dict[int, list[str]] = {}

    @classmethod
    def of(cls, req: _GenerationRequest) -> WeightVersions:
        return cls(req.return_weight_versions, req.return_token_weight_versions)

    def __call__(self, index: int, sample: CompletionOutput) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.per_token:
            fields["token_weight_versions"] = sample.weight_versions
        if self.spans:
            versions = self.seen.setdefault(index, [])
            versions += sample.weight_versions or []
            if sample.finish_reason is not None:
                fields["weight_versions"] = weight_version_spans(versions)
        return fields


def weight_version_spans(versions: list[str]) -> list[WeightVersionSpan]:
    spans: list[WeightVersionSpan] = []
    for i, version in enumerate(versions):
        if spans and spans[-1].version == version:
            spans[-1].end = i + 1
        else:
            spans.append(WeightVersionSpan(version=version, start=i, end=i + 1))
    return spans


def routed_experts_field(sample: CompletionOutput) -> str | None:
    """A choice's `routed_experts`: the sample's routed experts, base64 of their .npy bytes; None without them."""
    if sample.routed_experts is None:
        return None
    return base64.b64encode(npy_bytes(sample.routed_experts)).decode("ascii")


def finite(logprob: float) -> float:
    return NEG_INF_LOGPROB if logprob == -math.inf else logprob


class TokenFormatter:
    """How tokens appear in logprobs: their text, or `token_id:N` with return_tokens_as_token_ids."""

    def __init__(self, as_token_ids: bool) -> None:
        self.as_token_ids = as_token_ids

    def __call__(self, token_id: int, logprob: Logprob) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        return logprob.decoded_token or ""


def prompt_logprobs(entries: list[PositionLogprobs | None] | None, fmt: TokenFormatter) -> PromptLogprobs | None:
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            tid: PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank, decoded_token=fmt(tid, lp))
            for tid, lp in entry.items()
        }
        for entry in entries
    ]


def completion_logprobs(
    token_ids: list[int],
    entries: list[PositionLogprobs | None],
    fmt: TokenFormatter,
    text_offset: int,
    decode: Callable[[int], str],
) -> tuple[CompletionLogProbs, int]:
    """OpenAI completions logprobs of `token_ids` (a sample's, or with echo the prompt's too), whose offsets count from
    `text_offset` (the text of earlier deltas); also returns the offset after the last token, where the next delta
    starts. A position without an entry (a prompt's first token) is unscored: its logprob and top logprobs are null and
    its text is `decode`d (vLLM's)."""
    out = CompletionLogProbs()
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            token = f"token_id:{token_id}" if fmt.as_token_ids else decode(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(text_offset)
            text_offset += len(decode(token_id))
            continue
        token = fmt(token_id, entry[token_id])
        out.tokens.append(token)
        out.token_logprobs.append(finite(entry[token_id].logprob))
        out.top_logprobs.append({fmt(tid, lp): finite(lp.logprob) for tid, lp in entry.items()})
        out.text_offset.append(text_offset)
        text_offset += len(entry[token_id].decoded_token or "")
    return out, text_offset


def _chat_top(token: str, logprob: float) -> ChatTopLogprob:
    return ChatTopLogprob(token=token, logprob=finite(logprob), bytes=list(token.encode("utf-8", errors="replace")))


def chat_logprobs(sample: CompletionOutput, fmt: TokenFormatter, top_k: int) -> ChatCompletionLogProbs:
    content = []
    for token_id, entry in zip(sample.token_ids, sample.logprobs or [], strict=True):
        chosen = entry[token_id]
        # The entry holds the top k plus the sampled token when it ranks lower: keep the k best, by rank.
        ranked = sorted(((lp.rank or 0, tid, lp) for tid, lp in entry.items() if lp.rank and lp.rank <= top_k))
        top = [_chat_top(fmt(tid, lp), lp.logprob) for _, tid, lp in ranked[:top_k]]
        item = _chat_top(fmt(token_id, chosen), chosen.logprob)
        content.append(ChatLogprobContent(**item.model_dump(), top_logprobs=top))
    return ChatCompletionLogProbs(content=content)
