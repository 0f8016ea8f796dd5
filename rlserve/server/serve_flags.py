"""`rlserve serve`'s flags: its own, the engine's (derived from EngineConfig), and vLLM's spellings of them, so that
a framework's `vllm serve ...` command line runs with only the command changed.

Every flag of `vllm serve` 0.22-0.33 is implemented, accepted as a documented no-op, or refused by name with the
reason (the table in vllm_flag_decisions.py;
--quantization is an engine flag, rlserve.config.QUANTIZATIONS), never dropped. The checks run as
the command line is parsed, so a bad combination is a usage error (exit 2) before anything starts.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from collections.abc import Sequence
from typing import Any

from rlserve.engine.frontend.args import FlagParser, add_engine_arguments
from rlserve.hub import resolve_model
from rlserve.server.defaults import (
    GENERATION_CONFIG_CHOICES,
    GENERATION_CONFIG_FIELDS,
    ServingDefaults,
    generation_defaults,
    load_chat_template,
)
from rlserve.server.guards import DEFAULT_MAX_REQUEST_BODY_BYTES
from rlserve.server.http_protocol import DEFAULT_HEADER_TIMEOUT_S
from rlserve.server.lora_routes import RUNTIME_LORA_UPDATING_ENV, runtime_lora_updating_env
from rlserve.server.pipelinerl_group import add_pipelinerl_arguments, check_pipelinerl_arguments
from rlserve.server.reasoning_parsers import REASONING_PARSERS, check_reasoning_parser
from rlserve.server.tool_parsers import TOOL_CALL_PARSERS
from rlserve.server.vllm_flags import UNKNOWN_FLAG_HINT, add_vllm_flags

API_KEY_ENV = "RLSERVE_API_KEY"
RL_API_KEY_ENV = "RLSERVE_RL_API_KEY"
# vLLM serves its RL routes only in dev mode, and then without a key: clients written for it send none.
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"  # vLLM's: seconds an idle kept-alive connection stays open
# Longer than the idle expiry of the usual clients (httpx 5 s, aiohttp 15 s): a client then closes an idle connection
# before the server does, never sending a request on one the server is closing at that moment (a request lost in
# transport; vLLM's 5 s equals httpx's and lets that race happen under load).
DEFAULT_KEEP_ALIVE_S = 60.0
DEFAULT_HOST = "127.0.0.1"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
RL_API_AUTH = ("key", "none")
EXECUTOR_BACKENDS = ("mp", "uni", "ray", "external_launcher")  # vLLM's --distributed-executor-backend values


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name: it may resolve to anything
        return False


def api_keys(args: argparse.Namespace) -> list[str]:
    return _given_keys(args.api_key, API_KEY_ENV)


def rl_api_keys(args: argparse.Namespace) -> list[str]:
    """The RL routes' own keys (--rl-api-key, else $RLSERVE_RL_API_KEY); none: they take the /v1 keys."""
    return _given_keys(args.rl_api_key, RL_API_KEY_ENV)


def _given_keys(flag_values: Sequence[str] | None, env_name: str) -> list[str]:
    if flag_values is not None:
        return list(flag_values)
    value = os.environ.get(env_name)
    return [value] if value else []  # an empty variable is unset (the shell's `VAR=`)


def _check_api_keys(args: argparse.Namespace) -> None:
    """An empty or blank key would let `Authorization: Bearer ` (no token) through, i.e. no key at all: refused,
    as a missing one is."""
    for flag, env_name, keys in (
        ("--api-key", API_KEY_ENV, api_keys(args)),
        ("--rl-api-key", RL_API_KEY_ENV, rl_api_keys(args)),
    ):
        if any(not key.strip() for key in keys):
            raise ValueError(f"{flag} (or ${env_name}): a key must not be empty or only whitespace")


def _check_model(args: argparse.Namespace) -> None:
    positional, flag = args.model, args.model_flag
    del args.model_flag
    if positional is None and flag is None:
        raise ValueError("a model is required: rlserve serve MODEL (or --model MODEL)")
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"two models given: MODEL {positional} and --model {flag}; give one")
    given = positional if positional is not None else flag
    # Clients name the model as it was given (a hub id, not the cache directory it resolves to), as in vLLM.
    args.served_model_name = args.served_model_name or [given]
    args.model = resolve_model(given, getattr(args, "revision", None))  # a failure is a usage error: one line


def _json_object(flag: str, text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: {text!r} is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object, got {text!r}")
    return value


def _check_additional_config(args: argparse.Namespace) -> None:
    """vLLM's --additional-config, a free-form object its plugins read: rlserve implements prime-rl's fp32_lm_head
    (the LM head, and so the logprobs, in fp32: --lm-head-dtype float32) and refuses every other key by name."""
    config = _json_object("--additional-config", args.additional_config)
    unknown = sorted(set(config) - {"fp32_lm_head", "fp32_router_logits"})
    if unknown:
        raise ValueError(f"--additional-config: unknown key(s) {unknown} (rlserve implements: fp32_lm_head)")
    if config.get("fp32_router_logits"):
        raise ValueError(
            "--additional-config fp32_router_logits: not implemented (rlserve's MoE router GEMM writes the model "
            "dtype; only its softmax runs in fp32)"
        )
    if config.get("fp32_lm_head"):
        given = getattr(args, "lm_head_dtype", "float32")  # engine flags not given are absent from the namespace
        if given != "float32":
            raise ValueError(
                f"--additional-config fp32_lm_head sets lm_head_dtype float32, but --lm-head-dtype {given}"
            )
        args.lm_head_dtype = "float32"


def _check_executor_backend(args: argparse.Namespace) -> None:
    """vLLM's executor: rlserve's is processes of this host (mp; uni with one rank). Ray is accepted for one rank,
    whose worker runs in the engine core's own process wherever the caller (SkyRL's Ray actor) placed it."""
    backend = args.distributed_executor_backend
    tensor_parallel = getattr(args, "tensor_parallel_size", 1)
    if backend == "external_launcher" or (backend == "ray" and tensor_parallel > 1):
        raise ValueError(
            f"--distributed-executor-backend {backend}: rlserve starts its tensor-parallel ranks as processes of this "
            "host (mp); for Ray placement use --data-parallel-backend ray"
        )


def _check_rl_api_auth(args: argparse.Namespace) -> None:
    """The RL routes' key: required unless --rl-api-auth none or vLLM's dev mode, which serve them without one (as
    vLLM does) only on a loopback address or on a --host the command line names."""
    dev_mode = os.environ.get(DEV_MODE_ENV) == "1"
    args.enable_rl_api = args.enable_rl_api or dev_mode
    if args.rl_api_auth is None:
        args.rl_api_auth = "none" if dev_mode else "key"
    host_given = args.host is not None
    if not host_given:
        args.host = DEFAULT_HOST
    if args.rl_api_auth == "none":
        if not args.enable_rl_api:
            raise ValueError(f"--rl-api-auth none: the RL routes are off; add --enable-rl-api (or {DEV_MODE_ENV}=1)")
        if not host_given and not is_loopback(args.host):
            raise ValueError(
                f"the RL routes are served without a key and {args.host} is not a loopback address: name the "
                "address with --host to serve them there, or use --rl-api-auth key with --api-key"
            )
        if rl_api_keys(args):
            raise ValueError("--rl-api-key: the RL routes are served without a key (--rl-api-auth none)")
    elif args.enable_rl_api and not (rl_api_keys(args) or api_keys(args)):
        raise ValueError(
            f"--enable-rl-api needs an API key (--rl-api-key KEY, --api-key KEY or ${API_KEY_ENV}): the RL routes "
            "pause generation and overwrite weights; --rl-api-auth none serves them without one, for vLLM dev-mode "
            "clients"
        )


def _check_profiler_routes(args: argparse.Namespace) -> None:
    """--profiler-config serves vLLM's /start_profile and /stop_profile, which are control routes here (rl_routes.py
    says why): without the RL API nothing could start a profile, so the flag alone is refused rather than ignored."""
    profiler = getattr(args, "profiler_config", None)  # engine flags not given are absent from the namespace
    if profiler is not None and profiler.enabled and not args.enable_rl_api:
        raise ValueError(
            "--profiler-config: /start_profile and /stop_profile are served with the RL routes and their key; add "
            f"--enable-rl-api --api-key KEY (or {DEV_MODE_ENV}=1, vLLM's dev mode, to serve them without one)"
        )


def _check_tool_calls(args: argparse.Namespace) -> None:
    """vLLM's pair: --enable-auto-tool-choice needs a --tool-call-parser; a parser alone would parse nothing."""
    parser = args.tool_call_parser
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        implemented = ", ".join(TOOL_CALL_PARSERS)
        raise ValueError(f"--tool-call-parser {parser}: not implemented (rlserve implements: {implemented})")
    if args.enable_auto_tool_choice and parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format of the model's tool calls)")
    if parser is not None and not args.enable_auto_tool_choice:
        raise ValueError(
            f"--tool-call-parser {parser}: output is parsed for tool calls only with --enable-auto-tool-choice; add it"
        )


def _check_reasoning_parser(args: argparse.Namespace) -> None:
    if args.reasoning_parser is not None:
        check_reasoning_parser(args.reasoning_parser)


def _check_defaults(args: argparse.Namespace) -> None:
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    args.serving_defaults = ServingDefaults(
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        chat_template=load_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        sampling=generation_defaults(args.model, args.generation_config) | _generation_overrides(args),
        trust_request_chat_template=args.trust_request_chat_template,
        max_request_body_bytes=args.max_request_body_bytes,
    )


def _generation_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """--override-generation-config: generation-config fields over --generation-config's, as vLLM applies them (its
    keys, e.g. max_new_tokens); a key vLLM would not apply is refused by name, not dropped."""
    overrides = _json_object("--override-generation-config", args.override_generation_config)
    unknown = sorted(set(overrides) - set(GENERATION_CONFIG_FIELDS))
    if unknown:
        raise ValueError(
            f"--override-generation-config: unknown key(s) {unknown} (known: {', '.join(GENERATION_CONFIG_FIELDS)})"
        )
    return {GENERATION_CONFIG_FIELDS[key]: value for key, value in overrides.items() if value is not None}


def parse_lora_module(text: str) -> dict[str, str | None]:
    """One --lora-modules item, either of vLLM's forms: NAME=PATH, or a JSON object with "name", "path" and
    optionally "base_model_name"."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({e})") from e
        if not isinstance(item, dict) or set(item) - {"name", "path", "base_model_name"}:
            raise ValueError(f'--lora-modules: {text!r}: expected an object of "name", "path", "base_model_name"')
        name, path, base = item.get("name"), item.get("path"), item.get("base_model_name")
    else:
        name, _, path = text.partition("=")
        base = None
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules: {text!r}: needs a name and a path (NAME=PATH)")
    return {"name": name, "path": path, "base_model_name": base}


def _check_lora(args: argparse.Namespace) -> None:
    args.lora_modules = [parse_lora_module(text) for text in args.lora_modules or []]
    enable_lora = getattr(args, "enable_lora", False)  # engine flags not given stay out of the namespace
    if args.lora_modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.enable_runtime_lora_updating and not enable_lora:
        raise ValueError("--enable-runtime-lora-updating needs --enable-lora")
    # vLLM's variable alone is accepted without --enable-lora: frameworks set it for every launch.
    args.runtime_lora_updating = args.enable_runtime_lora_updating or runtime_lora_updating_env()
    if enable_lora and args.api_server_count > 1:
        # The names clients send live in the API server that loaded them; several would each hold their own.
        raise ValueError("--enable-lora: not with --api-server-count > 1 yet (adapter names are per API server)")


def _check_header_timeout(args: argparse.Namespace) -> None:
    if not args.header_timeout_s > 0:  # NaN too
        raise ValueError(f"--header-timeout-s must be a positive number of seconds, got {args.header_timeout_s}")


def _check_keep_alive(args: argparse.Namespace) -> None:
    """How long the API server keeps an idle connection open: $VLLM_HTTP_TIMEOUT_KEEP_ALIVE s, else the default."""
    raw = os.environ.get(KEEP_ALIVE_ENV)
    try:
        value = DEFAULT_KEEP_ALIVE_S if raw is None else float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{KEEP_ALIVE_ENV}: expected a positive number of seconds, got {raw!r}")
    args.keep_alive_timeout_s = value


SERVE_CHECKS = (
    _check_model,
    _check_api_keys,
    _check_additional_config,
    _check_executor_backend,
    _check_rl_api_auth,
    check_pipelinerl_arguments,
    _check_profiler_routes,
    _check_tool_calls,
    _check_reasoning_parser,
    _check_defaults,
    _check_lora,
    _check_keep_alive,
    _check_header_timeout,
)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """Every flag of `rlserve serve`, in the order --help lists them."""
    _add_model_and_address_flags(serve)
    _add_key_flags(serve)
    _add_allowed_names_flags(serve)
    _add_process_flags(serve)
    _add_request_flags(serve)
    _add_output_parser_flags(serve)
    _add_generation_default_flags(serve)
    _add_vllm_config_flags(serve)
    _add_lora_flags(serve)
    _add_accepted_vllm_switches(serve)
    add_pipelinerl_arguments(serve)
    add_engine_arguments(serve)
    add_vllm_flags(serve)


def _add_model_and_address_flags(serve: argparse.ArgumentParser) -> None:
    """The model, and where the server listens."""
    serve.add_argument("model", nargs="?", default=None, help="Hugging Face model directory or hub id (or --model)")
    serve.add_argument("--model", dest="model_flag", default=None, help="the model (vLLM's spelling; default: MODEL)")
    serve.add_argument("--host", default=None, help=f"address to listen on (default: {DEFAULT_HOST})")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")


def _add_key_flags(serve: argparse.ArgumentParser) -> None:
    """The API keys, and whether (and how) the RL control routes are served."""
    serve.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help=f"keys accepted on /v1, tokenization and /server_info, any one (default: ${API_KEY_ENV}); also on the "
        "RL routes unless --rl-api-key is given",
    )
    serve.add_argument(
        "--rl-api-key",
        nargs="+",
        default=None,
        help=f"keys accepted on the RL control routes (pause, weight updates, ...), any one (default: "
        f"${RL_API_KEY_ENV}, else the --api-key keys, with a warning: then any /v1 client controls the engine)",
    )
    serve.add_argument("--enable-rl-api", action="store_true", help="serve /pause, /resume, weight updates...")
    serve.add_argument(
        "--rl-api-auth",
        choices=RL_API_AUTH,
        default=None,
        help=f"key: the RL routes need --api-key; none: served without a key, for vLLM dev-mode clients (only on "
        f"loopback or an explicit --host; /v1 keeps its key). Default: key, or none when {DEV_MODE_ENV}=1 (which "
        "also turns the RL routes on, as vLLM serves them only in dev mode)",
    )


def _add_allowed_names_flags(serve: argparse.ArgumentParser) -> None:
    """What requests may name: the model's names, weight directories, rendezvous hosts."""
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients may send, any of them; responses name the first (default: MODEL)",
    )
    serve.add_argument(
        "--allowed-weight-dirs",
        nargs="+",
        default=[],
        metavar="DIR",
        help='directories under which /update_weights {"weight_dir"} may load checkpoints (prime-rl\'s update) and '
        "/v1/load_lora_adapter adapters",
    )
    serve.add_argument(
        "--allowed-rendezvous-hosts",
        nargs="+",
        default=None,
        metavar="HOST",
        help="hosts /init_weight_transfer_engine and prime-rl's /init_broadcaster may connect to (the trainer's group "
        "at init_info.master_address, or host), '*' for any (default: this machine: loopback, its host names and the "
        "--host address; a trainer on another node needs its address here)",
    )


def _add_process_flags(serve: argparse.ArgumentParser) -> None:
    """Logs, and the API server processes."""
    serve.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="rlserve's logs (info: start-up facts and phases)"
    )
    serve.add_argument(
        "--uvicorn-log-level", default=None, choices=(*LOG_LEVELS, "trace"), help="uvicorn's (default: --log-level)"
    )
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes sharing the port, each a client of the one engine core (vLLM's option)",
    )


def _add_request_flags(serve: argparse.ArgumentParser) -> None:
    """How requests are read: token names, chat templates, and the bounds of a request."""
    serve.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name tokens as 'token_id:N', for requests that do not set return_tokens_as_token_ids",
    )
    serve.add_argument(
        "--chat-template", default=None, help="a Jinja file, or an inline template, for chat (default: the tokenizer's)"
    )
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let chat requests send their own chat_template (vLLM's flag); without it such requests are refused, "
        "as a template is code the server runs",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        metavar="BYTES",
        help=f"larger request bodies are refused with 413 as they arrive (default: {DEFAULT_MAX_REQUEST_BODY_BYTES})",
    )
    serve.add_argument(
        "--header-timeout-s",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="a connection whose request line and headers have not all arrived this long after it opened (or the "
        f"request began) is closed (default: {DEFAULT_HEADER_TIMEOUT_S:g}; idle connections between requests: "
        f"${KEEP_ALIVE_ENV})",
    )


def _add_output_parser_flags(serve: argparse.ArgumentParser) -> None:
    """How chat output is parsed: tool calls and reasoning."""
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse chat output for tool calls when a request offers tools with tool_choice "auto" (its default)',
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        help=f"the format of the model's tool calls: {', '.join(TOOL_CALL_PARSERS)} (<tool_call>{{json}}</tool_call>)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        help=f"the format of the model's thinking: {', '.join(REASONING_PARSERS)} (vLLM's parsers of these names): "
        "chat output up to </think> is message.reasoning (delta.reasoning when streaming), the rest message.content",
    )


def _add_generation_default_flags(serve: argparse.ArgumentParser) -> None:
    """Defaults for the sampling fields a request leaves unset."""
    serve.add_argument(
        "--generation-config",
        default="auto",
        metavar="{auto,vllm,DIR}",
        help="defaults for requests that leave them unset (temperature, top_p, top_k, min_p, skip_special_tokens; "
        "max_new_tokens bounds max_tokens): auto from MODEL's generation_config.json, DIR from that directory's, "
        f"vllm none (default: auto, as vLLM). Choices: {', '.join(GENERATION_CONFIG_CHOICES)} or a directory",
    )
    serve.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help='generation-config fields over --generation-config\'s, e.g. \'{"temperature": 0.6, "max_new_tokens": '
        "512}' (vLLM's option): the same request defaults",
    )


def _add_vllm_config_flags(serve: argparse.ArgumentParser) -> None:
    """vLLM's configuration flags that rlserve reads in part."""
    serve.add_argument(
        "--additional-config",
        default=None,
        metavar="JSON",
        help="vLLM's free-form plugin config; rlserve implements {\"fp32_lm_head\": true} (prime-rl's: the LM head in "
        "fp32, as --lm-head-dtype float32) and refuses other keys",
    )
    serve.add_argument(
        "--distributed-executor-backend",
        choices=EXECUTOR_BACKENDS,
        default=None,
        help="vLLM's executor: rlserve's tensor-parallel ranks are processes of this host, as mp (uni: one rank); ray "
        "is accepted with one rank (its worker runs in the engine core process), external_launcher is refused",
    )


def _add_lora_flags(serve: argparse.ArgumentParser) -> None:
    """LoRA adapters served from the start, and loaded while serving."""
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='LoRA adapters to serve from the start, as NAME=PATH or a JSON object {"name", "path", '
        '"base_model_name"}; requests name one as their model (needs --enable-lora)',
    )
    serve.add_argument(
        "--enable-runtime-lora-updating",
        action="store_true",
        help=f"let /v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters served, from directories "
        f"under --allowed-weight-dirs (as {RUNTIME_LORA_UPDATING_ENV}=true does; needs --enable-lora)",
    )


def _add_accepted_vllm_switches(serve: argparse.ArgumentParser) -> None:
    """vLLM's switches that change nothing here, accepted so its command lines run."""
    serve.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="accepted for vLLM's command lines: rlserve's /sleep and /wake_up always work",
    )
    serve.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's command lines: rlserve runs no code from the model directory (its own model "
        "classes only), so there is nothing to trust",
    )
    serve.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted for vLLM's command lines: rlserve logs no periodic stats (read /metrics)",
    )


def add_serve_parser(subparsers: argparse._SubParsersAction) -> FlagParser:
    serve = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server, with optional RL control routes",
        usage="rlserve serve [MODEL] [--model MODEL] [options] (rlserve serve --help lists them)",
        checks=SERVE_CHECKS,
        unknown_flag_hint=UNKNOWN_FLAG_HINT,
    )
    add_serve_arguments(serve)
    return serve
