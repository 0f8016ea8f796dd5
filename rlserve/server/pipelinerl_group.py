"""PipelineRL's weight-update group (PipelineRL 58d39345, `pipelinerl/vllm1.py`): its `rlserve serve` flags, their
checks, and the join as the server starts; its updates then come through `/receive_weight_update`
(framework_routes.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.server.engine_calls import engine_call
from rlserve.server.errors import APIError
from rlserve.server.framework_routes import FrameworkState

logger = logging.getLogger(__name__)


def add_pipelinerl_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("PipelineRL", "PipelineRL's weight-update group (pipelinerl/vllm1.py)")
    group.add_argument(
        "--weight-update-group-init-method",
        default=None,
        help="tcp://HOST:PORT of the PipelineRL trainer's group, joined as the server starts",
    )
    group.add_argument("--weight-update-group-world-size", type=int, default=None, help="the group's size")
    group.add_argument("--actor-llm-idx", type=int, default=0, help="this server's index among PipelineRL's actors")
    group.add_argument(
        "--disable-weight-updates", action="store_true", help="PipelineRL's: join no weight-update group"
    )


def check_pipelinerl_arguments(args: argparse.Namespace) -> None:
    if (args.weight_update_group_init_method is None) != (args.weight_update_group_world_size is None):
        raise ValueError("--weight-update-group-init-method and --weight-update-group-world-size go together")
    if args.weight_update_group_init_method is not None and not args.disable_weight_updates and not args.enable_rl_api:
        raise ValueError(
            "--weight-update-group-init-method: PipelineRL's updates come through /receive_weight_update, an RL "
            "route: add --enable-rl-api (or --disable-weight-updates)"
        )


def start_pipelinerl_join(engine: AsyncLLM, args: argparse.Namespace, state: FrameworkState) -> None:
    """Join PipelineRL's group in the background as the server starts (PipelineRL's server joins before serving;
    here /health answers meanwhile, and /receive_weight_update waits for the join)."""
    if args.disable_weight_updates or args.weight_update_group_init_method is None:
        return
    config = engine.config
    init_info = {
        "init_method": args.weight_update_group_init_method,
        "world_size": args.weight_update_group_world_size,
        "actor_llm_idx": args.actor_llm_idx,
        "actor_ngpus": config.tensor_parallel_size * config.data_parallel_size,
    }

    async def join() -> None:
        call = engine.init_weight_transfer_engine({"init_info": init_info}, backend="pipelinerl")
        try:
            await engine_call(call, "init_info", data_param="init_info")
        except APIError as e:
            logger.error("PipelineRL weight-update group: %s", e.message)
            raise
        logger.info("joined PipelineRL's weight-update group at %s", args.weight_update_group_init_method)

    task = state.pipelinerl_join = asyncio.create_task(join())
    # Logged in join(); /receive_weight_update reports it. Retrieved here so asyncio does not report it again.
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
