"""vLLM's API-server entry points as frameworks that host the server in a process of their own call them (verl's
`vLLMHttpServer`, inside a Ray actor): the `serve` subcommand of `cmd_init()` parses `vllm serve`'s command line
(`rlserve serve`'s flags, which take vLLM's), and `build_app` / `init_app_state` make the app `rlserve serve` serves,
over the caller's `AsyncLLM`. The vllm surface gives them at vLLM's paths (`vllm.entrypoints.cli.serve`,
`vllm.entrypoints.openai.api_server`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from starlette.datastructures import State
from starlette.types import ASGIApp, Receive, Scope, Send

from rlserve.engine.frontend.args import FlagParser
from rlserve.engine.frontend.async_llm import SUPPORTED_TASKS, AsyncLLM
from rlserve.server.errors import APIError, error_response
from rlserve.server.serve import cmd_serve, compose_app
from rlserve.server.serve_flags import add_serve_parser

__all__ = ["ServeSubcommand", "build_app", "cmd_init", "init_app_state", "run_headless"]

NOT_COMPOSED = "init_app_state has not run: the server has no engine yet"


def _name_model_tag(args: argparse.Namespace) -> None:
    """vLLM's namespace calls the positional model `model_tag` (its callers read it)."""
    args.model_tag = args.model


class ServeSubcommand:
    """`vllm serve` as vLLM's CLI registers it: `rlserve serve`, with its parser and checks."""

    name = "serve"

    @staticmethod
    def cmd(args: argparse.Namespace) -> int:
        return cmd_serve(args)

    def validate(self, args: argparse.Namespace) -> None:
        """vLLM's hook after parsing: the parser's own checks have already run."""

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> FlagParser:
        parser = add_serve_parser(subparsers)
        parser.checks.append(_name_model_tag)
        return parser


def cmd_init() -> list[ServeSubcommand]:
    return [ServeSubcommand()]


def run_headless(args: argparse.Namespace) -> None:
    raise NotImplementedError(
        "run_headless: engine ranks without an API server (vLLM's multi-node data parallel) are not provided by "
        "rlserve; one front end starts every data-parallel rank (--data-parallel-size), Ray places them on nodes"
    )


class _ComposedLater:
    """The app `build_app` returns: vLLM builds its app before `init_app_state` gives it the engine, rlserve builds
    its routes over the engine, so this serves the app `init_app_state` composed (503 before)."""

    def __init__(self) -> None:
        self.state = State()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app: ASGIApp | None = getattr(self.state, "rlserve_app", None)
        if app is not None:
            await app(scope, receive, send)
        elif scope["type"] == "http":
            await error_response(APIError(503, NOT_COMPOSED))(scope, receive, send)
        elif scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})


def _check_tasks(supported_tasks: Sequence[str] | None) -> None:
    if supported_tasks is not None and tuple(supported_tasks) != SUPPORTED_TASKS:
        raise ValueError(f"supported_tasks: rlserve serves {SUPPORTED_TASKS}, got {tuple(supported_tasks)}")


def build_app(args: argparse.Namespace, supported_tasks: Sequence[str] | None = None, model_config: Any = None) -> Any:
    """vLLM's: the server's ASGI app for a parsed `vllm serve` command line (`model_config`, which vLLM reads for
    its pooling routes, is not read: rlserve serves generation only)."""
    _check_tasks(supported_tasks)
    return _ComposedLater()


async def init_app_state(
    engine_client: AsyncLLM, state: State, args: argparse.Namespace, supported_tasks: Sequence[str] | None = None
) -> None:
    """vLLM's: give the app of `build_app` (whose `state` this is) its routes over `engine_client`, as `rlserve
    serve` composes them for `args`."""
    _check_tasks(supported_tasks)
    if not isinstance(engine_client, AsyncLLM):
        raise ValueError(f"engine_client: expected rlserve's AsyncLLM, got {type(engine_client).__name__}")
    state.rlserve_app = await compose_app(engine_client, args)
