"""`OpenAIServing`, what every generating route shares between an API request and the engine: the served names and
LoRA adapters, request ids and the requests in flight, prompt validation, and the engine outputs of every prompt of a
request. A client that goes away, streaming or not, aborts its request so the engine stops spending steps on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request

from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.engine.frontend.core_client import RequestIdInUseError, RetryableRequestError
from rlserve.engine.frontend.llm import PromptType, ValidatedPrompt
from rlserve.engine.wire.messages import PAUSED_REFUSAL
from rlserve.lora import LoRARequest
from rlserve.outputs import RequestOutput
from rlserve.sampling_params import SamplingParams
from rlserve.server.defaults import ServingDefaults
from rlserve.server.errors import APIError
from rlserve.server.lora_routes import LoRAAdapters
from rlserve.server.openai_requests import _GenerationRequest
from rlserve.server.openai_responses import new_id

T = TypeVar("T")

SESSION_HEADER = "X-Session-ID"  # vLLM's (and vllm-router's) session affinity
# Names a ValueError from SamplingParams or the engine may start with (see APIError.from_value_error).
SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__) | {"prompt", "prompt_token_ids"}


def _id_conflict(error: RequestIdInUseError) -> APIError:
    return APIError(409, f"{error} (the engine still ends an earlier request of that id)", "request_id")


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine requests) and return None."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Cancellation completes only when the task next runs; wait for it so its result is readable.
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


class OpenAIServing:
    """What the completions, chat and token-in/token-out routes share on their way to the engine (each turns
    requests and outputs into its own shapes: serving_completions.py, serving_chat.py, serving_generate.py)."""

    def __init__(self, engine: AsyncLLM, model_names: Sequence[str], defaults: ServingDefaults) -> None:
        self.engine = engine
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]  # responses name the first, as vLLM's (or the adapter asked for)
        self.adapters = LoRAAdapters(engine, self.model_names)
        self.defaults = defaults
        # In-flight API requests: response id -> engine request ids (POST /abort_requests reads it).
        self.active: dict[str, list[str]] = {}
        # Tokenizing and chat templates run here, not on the event loop, which every stream and /health share: a
        # long prompt takes the tokenizer seconds. One thread: HF tokenizers are not safe to call from several.
        self._prompt_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlserve-prompts")

    async def off_loop(self, work: Callable[[], T]) -> T:
        """`work()` (prompt preparation: tokenizing, rendering, validating) on the prompt thread."""
        return await asyncio.get_running_loop().run_in_executor(self._prompt_thread, work)

    def model_for(self, lora: LoRARequest | None) -> str:
        """The model a response names: the adapter the request asked for, else the first served name."""
        return self.model_name if lora is None else lora.lora_name

    def claim(self, key: str) -> None:
        # The engine holds an id a little past its stream's end: until the core has ended an aborted request, whose
        # late outputs would otherwise reach a new request of the same id.
        if key in self.active or self.engine.request_in_use(key):
            raise APIError(409, f"request_id: {key!r} is already in flight", "request_id")

    def request_ids(self, req: _GenerationRequest, prefix: str) -> tuple[str, str]:
        """(the response's id, the request's key): the client's request_id when it sends one (the response id is
        vLLM's `{prefix}-{request_id}`), which /abort_requests takes and the engine's request ids derive from."""
        if req.request_id is None:
            response_id = new_id(prefix)
            return response_id, response_id
        self.claim(req.request_id)
        return f"{prefix}-{req.request_id}", req.request_id

    def tokenized(self, req: _GenerationRequest, text: str | None, token_ids: list[int]) -> dict[str, Any]:
        """An engine prompt of `token_ids` (tokenized from `text`, if any), truncated as the request asks, with its
        cache salt."""
        truncated = req.truncate(token_ids, self.engine.max_model_len)
        prompt: dict[str, Any] = {"prompt_token_ids": truncated, "cache_salt": req.cache_salt}
        if text is not None and truncated is token_ids:  # a cut prompt's text is no longer the request's
            prompt["prompt"] = text
        return prompt

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a name not served."""
        return self.adapters.resolve(model)

    def validate(
        self,
        prompts: list[PromptType],
        params: SamplingParams,
        rename: Mapping[str, str],
        lora_request: LoRARequest | None = None,
    ) -> list[ValidatedPrompt]:
        """Refuse a bad request before any of its prompts reaches the engine (and before a stream starts): the front
        end's checks (engine/frontend/validation.py) with the served bounds, each ValueError a 400 naming the field
        (`rename`: this route's name for it). Each validated prompt carries the adapter it runs with to the engine."""
        try:
            return self.engine.validate_prompts(prompts, params, lora_request, api_limits=True)
        except ValueError as e:
            raise APIError.from_value_error(e, SAMPLING_FIELDS, None, rename) from e

    def check_serving(self) -> None:
        """A 503 before a stream starts when the core is known to refuse generation (it refuses each request too:
        this is what lets a streaming client get the status rather than an error event)."""
        not_serving = self.engine.not_serving
        if not_serving is not None:
            raise APIError(503, f"generation refused: {not_serving}")
        if self.engine.rejecting_new_requests:
            raise APIError(503, PAUSED_REFUSAL)

    async def generate(
        self, request_id: str, prompts: list[ValidatedPrompt], raw: Request, streaming: bool = False
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The engine outputs of every prompt of one API request, tagged with the prompt's index. `X-Session-ID`
        (vLLM's routing affinity) sends a session's requests to one data-parallel rank, whose prefix cache holds
        the earlier turns. `streaming`: the response has begun, so a prompt that an abort pause refused on its way
        to the core (it was accepted before the pause) ends as the pause ended the others, with finish_reason
        "abort", rather than with a retryable error that a begun stream can only carry as an error event."""
        session_id = raw.headers.get(SESSION_HEADER)
        self.claim(request_id)  # again: another request may have taken the id since this one was checked
        if len(prompts) == 1:
            self.active[request_id] = [request_id]
            try:
                async with aclosing(
                    self.engine.generate(prompts[0], request_id=request_id, session_id=session_id)
                ) as outputs:
                    async for out in outputs:
                        yield 0, out
            except RetryableRequestError as e:
                if not streaming or e.final_output is None:
                    raise
                yield 0, e.final_output
            except RequestIdInUseError as e:  # one of its n samples' ids, which the core still holds
                raise _id_conflict(e) from e
            finally:
                self.active.pop(request_id, None)
            return
        engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.active[request_id] = engine_ids
        queue: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async with aclosing(
                    self.engine.generate(prompts[i], request_id=engine_ids[i], session_id=session_id)
                ) as outputs:
                    async for out in outputs:
                        queue.put_nowait((i, out, None))
            except RetryableRequestError as e:
                ended = streaming and e.final_output is not None
                queue.put_nowait((i, e.final_output, None) if ended else (i, None, e))
            except Exception as e:
                queue.put_nowait((i, None, e))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
        try:
            remaining = len(prompts)
            while remaining:
                i, out, error = await queue.get()
                if isinstance(error, RequestIdInUseError):
                    raise _id_conflict(error) from error
                if error is not None:
                    raise error
                yield i, out
                remaining -= out.finished
        finally:
            # Cancelling a pump closes its engine stream, which aborts what is left of that prompt.
            for task in tasks:
                task.cancel()
            self.active.pop(request_id, None)

    async def final_outputs(self, request_id: str, prompts: list[ValidatedPrompt], raw: Request) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async with aclosing(self.generate(request_id, prompts, raw)) as outputs:
            async for i, out in outputs:
                finals[i] = out
        return finals
