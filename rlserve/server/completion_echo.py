"""vLLM's `echo` on /v1/completions: each choice starts with its prompt.

As vLLM 0.33 does it (vllm/entrypoints/openai/completion/serving.py): the choice's text is the prompt's text followed
by the sample's; with `logprobs`, its logprobs cover the prompt's tokens (scored by the prompt logprobs, which `echo`
asks for at the `logprobs` depth unless `prompt_logprobs` says otherwise; the first token is unscored: null) and then
the sample's. `max_tokens: 0` with `echo` scores the prompt alone: the engine samples one token, which the choice
leaves out of its text and logprobs (vLLM counts it in the usage and `token_ids`, as rlserve does). With
`return_token_ids` vLLM echoes no prompt text (the prompt's ids are in `prompt_token_ids`); rlserve keeps that.
A token-id prompt is echoed as its decoded text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput

PositionEntries = list[PositionLogprobs | None] | None


@dataclass(frozen=True)
class ChoiceContent:
    """What one choice (or stream chunk) reports: its text, and the tokens its logprobs cover with their entries."""

    text: str
    token_ids: list[int]
    logprobs: PositionEntries


@dataclass(frozen=True)
class CompletionEcho:
    echo: bool
    only_prompt: bool  # max_tokens 0
    with_text: bool  # not with return_token_ids
    decode: Callable[[list[int]], str]

    def content(
        self, out: RequestOutput, sample: CompletionOutput, first: bool, prompt_lps: PositionEntries
    ) -> ChoiceContent:
        """The choice's content; the prompt is echoed in its first chunk (the whole choice when not streamed)."""
        if not (self.echo and first):
            return ChoiceContent(sample.text, sample.token_ids, sample.logprobs)
        prompt_ids = out.prompt_token_ids
        prompt_text = "" if not self.with_text else out.prompt if out.prompt is not None else self.decode(prompt_ids)
        logprobs = None
        if sample.logprobs is not None:
            logprobs = list(prompt_lps) if prompt_lps is not None else [None] * len(prompt_ids)
        if self.only_prompt:
            return ChoiceContent(prompt_text, prompt_ids, logprobs)
        if logprobs is not None:
            logprobs += sample.logprobs or []
        return ChoiceContent(prompt_text + sample.text, [*prompt_ids, *sample.token_ids], logprobs)
