"""Engines as Ray actors, the way SkyRL and verl drive vLLM's: a trainer script creates N engines on a placement
group and drives them all with one call each.

Each engine is an `AsyncLLMActor`: an `AsyncLLM` (its core a process beside the actor) in an async Ray actor, so
its methods are AsyncLLM's and a pause or a weight update reaches it while a generate is in flight. Engine i behaves
as data-parallel rank i of one deployment, as vLLM's engines of one group do: given the group's `init_info`, its
workers take the weight-transfer ranks `rank_offset + i * engine world size + worker`, so a trainer sends the same
init_info to every engine (vLLM's `RayVLLMWeightSyncClient` does) with `world_size` = 1 + `get_world_size()` of the
group.

`EngineGroup` fans a call out to every engine and gathers the results: blocking methods for a script, and
`submit(method, ...)` for the calls a trainer must overlap with its own side (the rendezvous, the broadcast). Its
weight-sync part is vLLM 0.33's `RayVLLMWeightSyncClient`, which also drives engines the caller started (an
AsyncLLMActor, or `ray.remote(LLM)` as vLLM's examples make them).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.engine.frontend.llm import _field
from rlserve.engine.frontend.ray_launcher import connect_ray
from rlserve.outputs import RequestOutput
from rlserve.sampling_params import SamplingParams


class AsyncLLMActor(AsyncLLM):
    """An AsyncLLM to run as an async Ray actor (`ray.remote(AsyncLLMActor)`): engine `engine_index` of a group."""

    def __init__(self, model: str, *, engine_index: int = 0, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.engine_index = engine_index

    async def generate_batch(
        self, prompts: Sequence[Any], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """LLM.generate's batch on this engine: every prompt's final output, in order."""
        params = _per_prompt(prompts, sampling_params)

        async def final(prompt: Any, p: SamplingParams) -> RequestOutput:
            async for out in self.generate(prompt, p):
                if out.finished:
                    return out
            raise RuntimeError("the engine ended a stream without its final output")

        return list(await asyncio.gather(*(final(prompt, p) for prompt, p in zip(prompts, params, strict=True))))

    async def init_weight_transfer_engine(self, request) -> None:
        """The group's init_info, this engine's workers placed after those of the engines before it."""
        init_info = dict(_field(request, "init_info"))
        init_info["rank_offset"] = init_info.get("rank_offset", 1) + self.engine_index * self.get_world_size()
        await super().init_weight_transfer_engine({"init_info": init_info})


def _per_prompt(
    prompts: Sequence[Any], sampling_params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
    return list(sampling_params)


class RayVLLMWeightSyncClient:
    """vLLM 0.33's client of the weight-sync calls on engines that are Ray actors (one handle or a list: engines of
    one group, each given the same init_info): every call goes to every engine and returns when all have answered.
    The handles stay the caller's. `submit` starts a call without waiting, for what a trainer overlaps with its own
    side (the rendezvous, the broadcast)."""

    def __init__(self, handle: Any) -> None:
        self.ray = connect_ray("rlserve.ray")
        self.handles = list(handle) if isinstance(handle, (list, tuple)) else [handle]

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Start `method` on every engine; the ObjectRefs, one per engine (ray.get them, or pass them to `get`)."""
        return [getattr(handle, method).remote(*args, **kwargs) for handle in self.handles]

    def get(self, refs: list[Any], timeout: float | None = None) -> list[Any]:
        return self.ray.get(refs, timeout=timeout)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`method` on every engine at once; each engine's result, in order."""
        return self.get(self.submit(method, *args, **kwargs))

    def get_world_size(self) -> int:
        """The workers of every engine: the trainer's group has 1 + this ranks."""
        return sum(self.call("get_world_size"))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("shutdown_weight_transfer_engine")

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.call("start_weight_update", is_checkpoint_format)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update", weight_version)


class EngineGroup(RayVLLMWeightSyncClient):
    """N engine actors that `create_engines` started, driven as one: the weight-sync calls, and generation, pause
    and shutdown (see the module's doc)."""

    def __init__(self, handles: list[Any], placement_group: Any = None) -> None:
        """`placement_group`: one the group created and removes on shutdown (None: the caller's, left alone)."""
        super().__init__(handles)
        self._own_placement_group = placement_group

    def generate(
        self, prompts: Sequence[Any], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """The prompts split in contiguous runs over the engines (a GRPO group sent as consecutive prompts stays on
        one engine, where its prefix is cached); the outputs in the prompts' order."""
        params = _per_prompt(prompts, sampling_params)
        size = math.ceil(len(prompts) / len(self.handles)) or 1
        refs = [
            handle.generate_batch.remote(list(prompts[start : start + size]), params[start : start + size])
            for handle, start in zip(self.handles, range(0, len(prompts), size), strict=False)
        ]
        return [out for outputs in self.get(refs) for out in outputs]

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self.call("pause_generation", mode=mode, clear_cache=clear_cache)

    def resume_generation(self) -> None:
        self.call("resume_generation")

    def is_paused(self) -> bool:
        return all(self.call("is_paused"))

    def get_weight_version(self) -> list[str]:
        return self.call("get_weight_version")

    def shutdown(self) -> None:
        """Stop every engine (its core with it) and kill the actors; remove the placement group the group made."""
        ray = self.ray
        try:
            ray.get([handle.shutdown.remote() for handle in self.handles], timeout=30)
        except ray.exceptions.RayError:
            pass  # an engine already dead: killed below all the same
        for handle in self.handles:
            ray.kill(handle)
        self.handles = []
        if self._own_placement_group is not None:
            ray.util.remove_placement_group(self._own_placement_group)
            self._own_placement_group = None


def create_engines(
    model: str,
    num_engines: int,
    *,
    placement_group: Any = None,
    bundle_offset: int = 0,
    **engine_kwargs: Any,
) -> EngineGroup:
    """`num_engines` AsyncLLMActor engines of `model` (AsyncLLM's keywords in `engine_kwargs`), engine i on bundle
    `bundle_offset + i` of `placement_group`; without one, a new group of one bundle per engine (a GPU each on CUDA,
    a CPU on the CPU; PACK) that the EngineGroup removes on shutdown. Returns once every engine serves."""
    ray = connect_ray("rlserve.ray")
    from ray.util.placement_group import placement_group as new_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlserve.config import resolve_device

    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    on_gpu = resolve_device(engine_kwargs.get("device", "auto")).startswith("cuda")
    own = None
    if placement_group is None:
        bundle = {"GPU": 1} if on_gpu else {"CPU": 1}
        placement_group = own = new_placement_group([dict(bundle)] * num_engines, strategy="PACK")
    actor_class = ray.remote(AsyncLLMActor)
    handles = [
        actor_class.options(
            num_cpus=0 if on_gpu else 1,
            num_gpus=1 if on_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=bundle_offset + i
            ),
        ).remote(model, engine_index=i, **engine_kwargs)
        for i in range(num_engines)
    ]
    group = EngineGroup(handles, own)
    try:
        group.call("get_world_size")  # returns once every engine's constructor has
    except BaseException:
        group.shutdown()
        raise
    return group
