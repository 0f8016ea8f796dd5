"""The offline entry point: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rlserve.engine.frontend.args import make_engine_config
from rlserve.engine.frontend.clients import make_client
from rlserve.engine.frontend.core_client import EngineDeadError, collective_rpc_args, load_weights_args
from rlserve.engine.frontend.output_processor import OutputProcessor
from rlserve.engine.frontend.validation import EngineLimits, PromptType, RequestValidator, ValidatedPrompt
from rlserve.engine.wire.messages import AddRequest
from rlserve.engine.wire.profiling import check_session, require_profiling
from rlserve.lora.request import LoRARequest
from rlserve.outputs import RequestOutput
from rlserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from rlserve.config import EngineConfig
    from rlserve.engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """A conversation as the prompt text the chat template makes (vLLM's rules, shared by `LLM.chat` and the server).

    `continue_final_message`: the last message stays open for the model to continue (a prefilled assistant turn), so
    no generation prompt follows it. `chat_template_kwargs` reach the template as variables; they may not re-set the
    arguments above. A ValueError names the offending argument."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be used with add_generation_prompt=True")
    kwargs = dict(chat_template_kwargs or {})
    named = {"chat_template", "add_generation_prompt", "continue_final_message", "tools", "documents", "tokenize"}
    clash = sorted(named & kwargs.keys())
    if clash:
        raise ValueError(f"chat_template_kwargs: {clash} are arguments of their own, not template kwargs")
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except Exception as e:  # jinja errors, a tokenizer without a chat template, a final message to continue missing
        raise ValueError(f"messages: the chat template failed: {e}") from e


class EngineFrontEnd:
    """What LLM and AsyncLLM share: configuration, tokenizer, output processing, and the facts and checks that
    their callers (the server, the CLI) read through them. The engine core itself runs behind a client (in its own
    process by default); these read only what is fixed at start-up, so any thread may call them."""

    def __init__(self, model: str, make_client: Callable[[EngineConfig], Any], **kwargs: Any) -> None:
        self.config = make_engine_config(model, **kwargs)
        self.client = make_client(self.config)  # a core process starts in the background
        try:
            try:
                loading = time.monotonic()
                self.tokenizer = load_tokenizer(self.config.model)  # meanwhile
                logger.info("start-up: tokenizer loaded in %.1f s while the core starts", time.monotonic() - loading)
            except Exception:
                self.client.connect()  # the core's error says what is wrong with the model directory, if anything
                raise
            self.output_processor = OutputProcessor(self.tokenizer)
            engine_info = self.client.connect()
        except BaseException:
            self.client.shutdown()
            raise
        # Garbage collection or interpreter exit stops the core too: no process outlives its front end.
        self._finalizer = weakref.finalize(self, self.client.shutdown)
        limits = EngineLimits(engine_info["max_model_len"], engine_info["vocab_size"], engine_info["max_logprobs"])
        self.validator = RequestValidator(self.tokenizer, limits, self.config.enable_lora)
        self._extension_methods = set(engine_info["worker_extension_methods"])
        self._loaded_loras: dict[int, str] = {}  # adapters this front end loaded: lora_int_id -> lora_name

    @property
    def limits(self) -> EngineLimits:
        """The engine's limits, reported by the core; the validator checks every request against them."""
        return self.validator.limits

    @limits.setter
    def limits(self, limits: EngineLimits) -> None:
        self.validator.limits = limits

    @property
    def max_model_len(self) -> int:
        """The longest sequence, prompt and output, the engine serves."""
        return self.limits.max_model_len

    def validate_prompt(
        self, prompt: PromptType, params: SamplingParams, lora_request: LoRARequest | None = None
    ) -> ValidatedPrompt:
        """Tokenize `prompt` and check it with `params` (and the adapter it runs with) against the engine's limits
        (length, vocabulary, logprobs): the one check of a request before it is queued (`validation.py`). A
        ValueError names the offending field."""
        return self.validator.validate_prompt(prompt, params, lora_request)

    def validate_prompts(
        self,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        *,
        api_limits: bool = False,
    ) -> list[ValidatedPrompt]:
        """The prompts of one request sharing `params` (see RequestValidator.validate_prompts)."""
        return self.validator.validate_prompts(prompts, params, lora_request, api_limits=api_limits)

    def check_lora_request(self, lora_request: LoRARequest | None) -> None:
        self.validator.check_lora_request(lora_request)

    def loras_to_add(self, lora_requests: Iterable[LoRARequest | None]) -> list[LoRARequest]:
        """The adapters of a generate call to load (add_lora) before its requests are queued, so that a bad one is a
        ValueError of the call, not a refusal of each request: those this front end has not loaded, and those
        that ask for an in-place reload (once per call). The core loads any other it lacks itself."""
        wanted = {r: None for r in lora_requests if r is not None}
        return [r for r in wanted if r.load_inplace or self._loaded_loras.get(r.lora_int_id) != r.lora_name]

    @property
    def engine_core(self) -> EngineCore:
        """The core object itself, for tests and tools of its internals; only when it runs in this process
        (for AsyncLLM it steps on a thread of its own: change it only before the first request)."""
        service = getattr(self.client, "service", None)
        if service is None:
            raise AttributeError(
                "engine_core: the engine core runs in its own process; set RLSERVE_ENABLE_MULTIPROCESSING=0 to "
                "keep it in this one"
            )
        return service.core

    def worker_extension_methods(self) -> set[str]:
        """The methods of `worker_extension_cls` that collective_rpc may call by name."""
        return set(self._extension_methods)

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the workers of one data-parallel rank (TP x PP, PP being 1 here), times the ranks with
        `include_dp`: what a trainer sizes its weight-transfer group by (world_size = trainer ranks + this)."""
        return self.config.tensor_parallel_size * (self.config.data_parallel_size if include_dp else 1)

    def profile_args(
        self,
        profile_prefix: str | None,
        delay_iterations: int | None,
        max_iterations: int | None,
        profiler_kwargs: dict[str, Any] | None,
    ) -> list[Any]:
        """start_profile's arguments for the core, checked here first (the core checks them again): vLLM's
        RuntimeError when profiling is not configured, a ValueError naming a bad argument."""
        check_session(require_profiling(self.config), profile_prefix, delay_iterations, max_iterations, profiler_kwargs)
        return [profile_prefix, delay_iterations, max_iterations, profiler_kwargs]

    @staticmethod
    def no_draft_model() -> RuntimeError:
        """vLLM 0.33's start_draft_weight_update retargets an update at the speculative draft model; rlserve runs no
        speculative decoding, so there is never one."""
        return RuntimeError(
            "start_draft_weight_update: this engine has no speculative draft model (rlserve runs no speculative "
            "decoding); update the model's weights with start_weight_update"
        )

    @staticmethod
    def check_weight_update_format(is_checkpoint_format: bool) -> None:
        """vLLM's start_weight_update(is_checkpoint_format=False) sends the model's own (fused) parameter names;
        rlserve's loader takes the checkpoint's names only, so it refuses rather than misreading them."""
        if is_checkpoint_format is not True:
            raise ValueError(
                f"is_checkpoint_format: rlserve loads checkpoint-format names only (those of the model's safetensors "
                f"files), got {is_checkpoint_format!r}"
            )


class LLM(EngineFrontEnd):
    def __init__(self, model: str, **kwargs: Any) -> None:
        super().__init__(model, make_client, **kwargs)
        self._ids = itertools.count()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: the adapter of every prompt, or one per prompt (None: the base model), as vLLM's."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = _final_only(sampling_params, len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        # Validate everything before queueing anything, so a bad prompt leaves the engine untouched.
        validated = self.validator.validate_each(prompts, params_list, loras)
        if self.client.call("is_sleeping"):
            raise RuntimeError("generate: the engine is asleep; call wake_up() first")
        for lora in self.loras_to_add(loras):
            self.add_lora(lora)
        order: dict[str, int] = {}
        try:
            requests = []
            for prompt in validated:
                request_id = str(next(self._ids))
                order[request_id] = len(order)
                children = self.output_processor.add_request(request_id, prompt.text, prompt.token_ids, prompt.params)
                child_ids = [c for c, _ in children]
                requests.append(
                    AddRequest.of(
                        child_ids,
                        prompt.token_ids,
                        [p for _, p in children],
                        prompt.cache_salt,
                        prompt.lora_request,
                    )
                )
            self.client.add(requests)
            return self._run_to_completion(order, use_tqdm)
        except BaseException:
            # Whatever failed (or Ctrl-C), leave no request of this call behind in the engine.
            for request_id in order:
                child_ids = self.output_processor.child_ids(request_id)
                if child_ids:
                    with contextlib.suppress(EngineDeadError):
                        self.client.abort(child_ids)
                self.output_processor.abort(request_id)
            raise

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's: one conversation (a list of messages) or a list of them, rendered by the tokenizer's chat template
        (or `chat_template`) and generated as `generate` does; one output per conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = render_chat(
                self.tokenizer,
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            # The template already placed any special tokens (BOS, role markers): none are added a second time.
            token_ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run_to_completion(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        remaining = len(order)
        num_tokens = 0
        with tqdm(total=len(order), desc="generate", disable=not use_tqdm, unit="req", dynamic_ncols=True) as bar:
            while remaining:
                outputs, to_abort = self.output_processor.process(self.client.get_outputs())
                if to_abort:
                    self.client.abort(to_abort)
                for out in outputs:
                    error = self.output_processor.take_error(out.request_id)
                    index = order.get(out.request_id)
                    if index is None:  # a late output of an earlier call's aborted request
                        continue
                    if error is not None:
                        raise error
                    results[index] = out
                    remaining -= 1
                    num_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                bar.set_postfix(tokens=num_tokens, refresh=False)
        return results

    # ---- LoRA adapters, vLLM's names ----

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter; a no-op if loaded under the same id, unless `load_inplace` (then reloaded from its
        path). More than max_loras at once is refused (ValueError naming max_loras)."""
        self.check_lora_request(lora_request)
        added = self.client.call("add_lora", lora_request)
        self._loaded_loras[lora_request.lora_int_id] = lora_request.lora_name
        return added

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False if it is not loaded. Requests already running with it finish with it."""
        removed = self.client.call("remove_lora", lora_id)
        self._loaded_loras.pop(lora_id, None)
        return removed

    def list_loras(self) -> set[int]:
        return set(self.client.call("list_loras"))

    # ---- sleep / wake, vLLM's names ----

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free device memory for a colocated trainer: level 1 moves the weights to host memory and drops the KV
        cache, level 2 drops both (update every weight after waking), level 0 only stops scheduling. mode is vLLM's
        (AsyncLLM.sleep); `generate` returns only when its requests are done, so none is in flight here."""
        self.client.call("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back "weights", "kv_cache" and "scheduling" (default: all); whether the engine is awake (as soon as
        weights and KV cache are both back)."""
        return self.client.call("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.client.call("is_sleeping")

    # ---- weights, vLLM's names ----

    def init_weight_transfer_engine(self, request) -> None:
        self.client.call("init_weight_transfer_engine", _field(request, "init_info"))

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.check_weight_update_format(is_checkpoint_format)
        self.client.call("start_weight_update")

    def start_draft_weight_update(self) -> None:
        raise self.no_draft_model()

    def update_weights(self, request) -> None:
        self.client.call("update_weights", _field(request, "update_info"))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.call("finish_weight_update", weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        """vLLM's: close the trainer's transfer group (a later init_weight_transfer_engine opens a new one)."""
        self.client.call("shutdown_weight_transfer_engine")

    def abandon_weight_update(self) -> str:
        """Give up the weight update in progress (its trainer is gone): "restored" (weight_update_snapshot put the
        previous weights back), "incomplete" (generation is refused until a full update) or "unchanged"."""
        return self.client.call("abandon_weight_update")

    @property
    def not_serving(self) -> str | None:
        """Why generation is refused (the weights are incomplete: sleep level 2, an abandoned update), or None. As of
        the last call: the core sends its status before any call's result, and only calls change it."""
        return self.client.not_serving

    def update_weight_version(self, new_version: str) -> None:
        self.client.call("update_weight_version", str(new_version))

    def get_weight_version(self) -> str:
        return self.client.call("get_weight_version")

    def load_weights(self, weights, reset_prefix_cache: bool = True) -> int:
        """Write (checkpoint name, tensor) pairs into the engine's model; the prefix cache is emptied unless asked
        not to (KV computed under the old weights would otherwise be served)."""
        return self.client.call("load_weights", *load_weights_args(self.client, weights, reset_prefix_cache))

    def collective_rpc(
        self, method: str | Callable, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        """vLLM's: a worker method's name (see `worker_extension_cls`), or, with the core in this process, a
        function called with the worker first; one result per worker. `timeout` is accepted for vLLM's signature."""
        return self.client.call("collective_rpc", *collective_rpc_args(self.client, method, args, kwargs))

    def weight_checksums(self) -> dict[str, str]:
        return self.client.call("checksums")

    def reset_prefix_cache(self) -> None:
        self.client.call("reset_prefix_cache")

    # ---- profiling, vLLM's names (rlserve.engine.worker.tracing) ----

    def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
        profiler_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """vLLM's: trace every engine-core process (each data-parallel and tensor-parallel rank) with torch.profiler
        until `stop_profile`, one Chrome trace per rank in profiler_config's torch_profiler_dir, named
        `[<profile_prefix>_]dp<D>_pp0_tp<T>_...`. `delay_iterations` steps pass before tracing starts and it stops by
        itself after `max_iterations` (defaults: profiler_config's); `profiler_kwargs` overrides torch.profiler's
        switches (record_shapes, profile_memory, with_stack, with_flops, with_modules). RuntimeError when the engine
        has no profiler_config or a session is already active."""
        args = self.profile_args(profile_prefix, delay_iterations, max_iterations, profiler_kwargs)
        self.client.call("start_profile", *args)

    def stop_profile(self) -> None:
        """vLLM's: end the session and write the traces (a no-op, logged by the core, when none is active)."""
        require_profiling(self.config)
        self.client.call("stop_profile")

    def stats(self) -> dict[str, Any]:
        return self.client.call("stats")

    def shutdown(self) -> None:
        self._finalizer()


def _field(request, name: str) -> dict:
    """Accept vLLM's request envelopes, a {name: {...}} dict, or the inner dict itself."""
    if hasattr(request, name):
        return getattr(request, name)
    if isinstance(request, dict):
        return request[name] if name in request and isinstance(request[name], dict) else request
    raise ValueError(f"{name}: expected a request object or a dict")


def _final_only(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """Each prompt's params as `generate` runs them (one output per request, at its end): copied once per distinct
    params object, not once per prompt (the caller's own are left as they are)."""
    if sampling_params is None:
        return [SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * num_prompts
    copies: dict[int, SamplingParams] = {}
    for params in sampling_params:
        if id(params) not in copies:
            copies[id(params)] = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    return [copies[id(params)] for params in sampling_params]
