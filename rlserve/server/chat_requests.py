"""The body of /v1/chat/completions: its messages (text content, tool calls and reasoning sent back), the tools it
offers, and chat's own options beside the sampling fields it shares with completions (openai_requests.py)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, model_validator

from rlserve.server.errors import APIError
from rlserve.server.openai_requests import _GenerationRequest
from rlserve.server.request_base import OpenAIBaseModel


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's)


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls, sent back in a multi-turn conversation
    tool_call_id: str | None = None  # a tool message's answer to that call
    # An assistant turn's reasoning, sent back (vLLM's name; `reasoning_content` its older one): templates that
    # render earlier thinking (Qwen3's) read it.
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The message's text: text content only."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise APIError(400, "messages: only text content parts are supported", "messages")
            content = "".join(part.text for part in content)
        return content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: its text, and its tool fields when it has them. A call's
        arguments reach the template as an object, as vLLM passes them (templates write them with `tojson`)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            if self.role != "assistant":
                raise APIError(400, f"messages: reasoning is for assistant turns, not {self.role!r} ones", "messages")
            # Under both names, as vLLM passes it: templates read one or the other.
            message["reasoning"] = message["reasoning_content"] = reasoning
        if self.tool_calls is not None:
            calls = []
            for call in self.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError as e:
                    raise APIError(400, f"messages: tool call arguments are not JSON: {e}", "messages") from e
                calls.append({**call.model_dump(), "function": {"name": call.function.name, "arguments": arguments}})
            message["tool_calls"] = calls
        return message


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: dict[str, Any]


# A chat's messages, at most this many: counted before any is validated (validating 200,000 held the event loop,
# which /health shares, for seconds). The context bounds them further before rendering (guards.py).
MAX_CHAT_MESSAGES = 16384


def _at_most_max_chat_messages(value: Any) -> Any:
    if isinstance(value, list) and len(value) > MAX_CHAT_MESSAGES:
        raise ValueError(f"at most {MAX_CHAT_MESSAGES} messages, got {len(value)}")
    return value


ChatMessages = Annotated[list[ChatMessage], BeforeValidator(_at_most_max_chat_messages)]


class ChatCompletionRequest(_GenerationRequest):
    messages: ChatMessages
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last message is left open for the model to continue (a prefilled turn); no generation prompt.
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's default for chat: the template places the special tokens
    chat_template: str | None = None  # this request's Jinja template, in place of the server's
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # for templates that render retrieved documents
    tools: list[Tool] | None = None
    # vLLM's default: "auto" when tools are sent, else "none".
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # vLLM's: the reply starts with the last message's content, when that message has the reply's role.
    echo: bool = False
    # vLLM's, with --reasoning-parser: false leaves the reasoning out of the reply (and the logprobs and token ids,
    # which would show it).
    include_reasoning: bool = True
    # vLLM's: passed to the chat template, which also gets enable_thinking (false for "none") unless the request's
    # chat_template_kwargs set it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        explicit_prompt = self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set
        if self.continue_final_message and explicit_prompt:
            raise APIError(
                400, "continue_final_message: cannot be used with add_generation_prompt=true", "continue_final_message"
            )
        if self.tools is not None and not self.tools:
            raise APIError(400, "tools: must not be empty; omit the field for no tools", "tools")
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        elif self.tool_choice != "none" and not self.tools:
            raise APIError(400, "tool_choice: needs tools", "tool_choice")
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            raise APIError(
                400,
                f"tool_choice: only 'auto' and 'none' are implemented: forcing a call needs guided decoding, which "
                f"rlserve has not (got {self.tool_choice!r})",
                "tool_choice",
            )
        return self

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and what reasoning_effort adds to them (vLLM's
        rules). The reasoning parser reads enable_thinking from them too."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        kwargs = {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}
        kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    @property
    def generation_prompt(self) -> bool:
        """Whether the template adds the assistant's header: not when continuing the final message."""
        return self.add_generation_prompt and not self.continue_final_message

    def echoed(self) -> str:
        """What echo prepends to each reply: the last message's text, when its role is the reply's (vLLM's rule)."""
        if not self.echo or not self.messages:
            return ""
        last = self.messages[-1]
        role = "assistant" if self.generation_prompt else last.role
        return last.text() if last.role == role else ""

    def sampling_kwargs(self) -> dict[str, Any]:
        self.check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_kwargs(max_tokens, logprobs)
