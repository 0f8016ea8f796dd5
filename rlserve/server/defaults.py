"""Server-wide request defaults: what `--generation-config`, `--chat-template`, `--return-tokens-as-token-ids`,
`--enable-auto-tool-choice` and `--reasoning-parser` set, applied to every request that does not set the field itself
(vLLM's semantics for each); and what every request is held to (`--trust-request-chat-template`,
`--max-request-body-bytes`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rlserve.sampling_params import SamplingParams
from rlserve.server.guards import DEFAULT_MAX_REQUEST_BODY_BYTES

# The generation_config.json fields vLLM applies as request defaults (its ModelConfig.get_diff_sampling_param), each
# to the SamplingParams field it sets.
GENERATION_CONFIG_FIELDS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "skip_special_tokens": "skip_special_tokens",
    "max_new_tokens": "max_tokens",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
GENERATION_CONFIG_CHOICES = ("auto", "vllm")  # or a directory
JINJA_CHARS = "{}\n"  # vLLM's test: a --chat-template value holding one of these is a template, not a path


@dataclass(frozen=True)
class ServingDefaults:
    return_tokens_as_token_ids: bool = False
    chat_template: str | None = None  # None: the tokenizer's
    # --enable-auto-tool-choice: chat output is parsed for tool calls (with --tool-call-parser's format, hermes) when a
    # request offers tools with tool_choice "auto".
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None  # --reasoning-parser: chat output's thinking as message.reasoning
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> default; max_tokens is a bound
    # --trust-request-chat-template: a chat request's `chat_template` replaces the server's (vLLM's flag; off, such a
    # request is refused: the template is code the server runs).
    trust_request_chat_template: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies are refused with 413

    def tokens_as_token_ids(self, req: BaseModel) -> bool:
        """The request's return_tokens_as_token_ids when it sends one (true or false), else the server's."""
        if "return_tokens_as_token_ids" in req.model_fields_set:
            return bool(req.return_tokens_as_token_ids)
        return self.return_tokens_as_token_ids

    def apply(self, req: BaseModel, params: SamplingParams) -> SamplingParams:
        """`params` (built from `req`) with the generation-config defaults of the fields `req` left unset."""
        updates = self._updates(req, params.max_tokens)
        return dataclasses.replace(params, **updates) if updates else params

    def sampling_params(self, req: Any, **overrides: Any) -> SamplingParams:
        """A generation request's params with these defaults (as `apply`) and `overrides`, built (and validated)
        once: a ValueError names a bad field."""
        kwargs = req.sampling_kwargs()
        kwargs.update(self._updates(req, kwargs["max_tokens"]), **overrides)
        return SamplingParams(**kwargs)

    def _updates(self, req: BaseModel, max_tokens: int | None) -> dict[str, Any]:
        """The generation-config defaults of the fields `req` left unset (max_tokens: a bound on every request)."""
        updates: dict[str, Any] = {}
        for name, value in self.sampling.items():
            if name == "max_tokens":
                # vLLM: the config's max_new_tokens bounds every request, also those that ask for more.
                updates[name] = value if max_tokens is None else min(max_tokens, value)
            elif name not in req.model_fields_set or getattr(req, name) is None:
                updates[name] = value
        return updates


def generation_defaults(model: str, source: str) -> dict[str, Any]:
    """SamplingParams defaults from `--generation-config`: `vllm` none, `auto` the model directory's
    generation_config.json (none when it has none, as vLLM), else that directory's."""
    from transformers import GenerationConfig

    if source == "vllm":
        return {}
    try:
        config = GenerationConfig.from_pretrained(model if source == "auto" else source, local_files_only=True)
    except OSError as e:
        if source == "auto":
            return {}
        raise ValueError(f"--generation-config {source}: no readable generation_config.json there ({e})") from e
    # What differs from transformers' GenerationConfig defaults (to_diff_dict), as vLLM reads the file.
    diff = config.to_diff_dict()
    return {GENERATION_CONFIG_FIELDS[k]: v for k, v in diff.items() if k in GENERATION_CONFIG_FIELDS and v is not None}


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the value itself when it is a Jinja template (vLLM's rule)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if any(c in value for c in JINJA_CHARS):
        return value
    raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template")
