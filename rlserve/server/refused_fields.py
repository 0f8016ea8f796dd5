"""The request fields of vLLM that rlserve does not implement: each is accepted with its "off" value and otherwise
refused with a 400 naming it and the reason, never dropped unread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from rlserve.server.errors import APIError


@dataclass(frozen=True)
class Refused:
    reason: str
    off: tuple[Any, ...] = (None,)  # the values that ask for nothing: accepted, as no request for the feature


_TEXT_ONLY = "rlserve serves text-only models"
_NO_DISAGG = "rlserve has no disaggregated serving"
_NO_GUIDED = "rlserve has no guided (structured) decoding"
# vLLM 0.33's request fields that rlserve does not implement, on /v1/completions and /v1/chat/completions (a request
# model that declares one of these names implements it: chat's include_reasoning and reasoning_effort). Sent
# with an "off" value, a field is accepted; with any other, refused by name with the reason: a client must not get
# output that silently ignored its request.
REFUSED_FIELDS: dict[str, Refused] = {
    "user": Refused("rlserve keeps no per-user records (OpenAI's abuse-monitoring id); omit it"),
    "use_beam_search": Refused("beam search is not implemented", (None, False)),
    "length_penalty": Refused("beam search is not implemented", (None, 1.0)),
    "watermarking": Refused("watermarking is not implemented", (None, False)),
    "spaces_between_special_tokens": Refused("detokenization is not configurable in rlserve", (None, True)),
    "logprob_token_ids": Refused("logprobs of chosen token ids are not implemented; use logprobs / top_logprobs"),
    "prompt_embeds": Refused("prompt embeddings are not supported: send text or token ids"),
    "response_format": Refused(f"{_NO_GUIDED}: only {{'type': 'text'}}", (None, {"type": "text"})),
    "structured_outputs": Refused(_NO_GUIDED),
    "priority": Refused("rlserve has no priority scheduling (first come, first served): only 0", (None, 0)),
    "session_id": Refused("one engine per server: there is no session routing"),
    "return_token_offsets": Refused("token offsets are not returned", (None, False)),
    "return_prompt_text": Refused("not implemented: /v1/chat/completions/render returns the prompt", (None, False)),
    "mm_payload": Refused(_TEXT_ONLY, (None, "tensors")),
    "return_mm_kwargs": Refused(_TEXT_ONLY),
    "media_io_kwargs": Refused(_TEXT_ONLY),
    "mm_processor_kwargs": Refused(_TEXT_ONLY),
    "kv_transfer_params": Refused(_NO_DISAGG),
    "ec_transfer_params": Refused(_NO_DISAGG),
    "vllm_xargs": Refused("rlserve has no extensions that read request arguments"),
    "repetition_detection": Refused("repetition detection is not implemented"),
    "thinking_token_budget": Refused("thinking budgets are not implemented", (None, -1)),
    "reasoning_effort": Refused("it reaches the chat template: /v1/chat/completions only"),
    "include_reasoning": Refused("reasoning is parsed on /v1/chat/completions only", (None, True)),
    "parallel_tool_calls": Refused("every tool call the model makes is returned: only true", (None, True)),
    "stream_interval": Refused("rlserve streams every token: only 1", (None, 1)),
    # SGLang's fields, which vllm-router (0.1.17) adds to every completion and chat body it forwards, at these values
    "no_stop_trim": Refused("stop strings are trimmed unless include_stop_str_in_output: only false", (None, False)),
    "return_hidden_states": Refused("hidden states are not returned: only false", (None, False)),
    "separate_reasoning": Refused("reasoning is separated whenever --reasoning-parser is set: only true", (None, True)),
    "stream_reasoning": Refused("reasoning is streamed as it is generated: only true", (None, True)),
}


def _is_off(value: Any, off: Any) -> bool:
    if off is None or value is None:
        return value is off
    if isinstance(value, bool) or isinstance(off, bool):  # JSON's true is not 1
        return type(value) is type(off) and value == off
    return value == off


def refuse_fields(model: type[BaseModel], data: Any) -> Any:
    """`data` without the fields of `REFUSED_FIELDS` that `model` lacks and that ask for nothing; 400 for the others."""
    if not isinstance(data, dict):
        return data
    refused = [name for name in data if name in REFUSED_FIELDS and name not in model.model_fields]
    for name in refused:
        entry, value = REFUSED_FIELDS[name], data[name]
        if not any(_is_off(value, off) for off in entry.off):
            raise APIError(400, f"{name}: {entry.reason} (got {value!r})", name)
    return {k: v for k, v in data.items() if k not in refused}


# Options rlserve does not implement, with the values that mean "off": any other value is refused rather than
# silently ignored (a client asking for penalties must not get unpenalized samples without knowing).
_ONLY_OFF: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}
