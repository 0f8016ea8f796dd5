"""GRPO groups streamed from a live engine's `/v1/completions`, scored by a task, with the engine's per-token
logprobs and weight versions: many requests in flight, so generation never waits for the trainer."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx
from transformers import PreTrainedTokenizerBase

from rlserve.rl.grpo import Rollout
from rlserve.rl.tasks import AdditionTask, Problem


@dataclass(frozen=True)
class Group:
    """One prompt's samples: the unit GRPO normalises rewards over."""

    problem: Problem
    rollouts: list[Rollout]


@dataclass(frozen=True)
class RolloutBatch:
    groups: list[Group]
    num_dropped: int  # samples dropped for lagging more than max_lag versions behind the trainer
    wait_ms: float  # how long the trainer waited for them


class RolloutStream:
    """Keeps `concurrency` GRPO groups generating at all times and buffers up to `buffer` finished ones.

    Each worker loops: draw a prompt, POST /v1/completions with n=group_size, queue the scored group. The queue is
    bounded, so when the trainer falls behind the workers wait with finished groups in hand instead of running
    further ahead of the weights (which bounds the lag).
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        task: AdditionTask,
        tokenizer: PreTrainedTokenizerBase,
        *,
        group_size: int,
        concurrency: int,
        seed: int,
        buffer: int | None = None,
        temperature: float = 1.0,
    ) -> None:
        self.http = http
        self.task = task
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.concurrency = concurrency
        self.temperature = temperature
        self._rng = random.Random(seed)
        self._seed = seed
        self._num_requests = 0
        # By default a quarter of the in-flight groups may wait finished: the trainer rarely waits long, and samples
        # lag about one version (one-step off-policy, as in PipelineRL).
        buffer = max(1, concurrency // 4) if buffer is None else buffer
        if concurrency < 1 or buffer < 1:
            raise ValueError(f"concurrency and buffer must be >= 1, got {concurrency} and {buffer}")
        self._queue: asyncio.Queue[Group] = asyncio.Queue(maxsize=buffer)
        self._workers: list[asyncio.Task] = []
        self._failed: asyncio.Future | None = None

    async def __aenter__(self) -> RolloutStream:
        self._failed = asyncio.get_running_loop().create_future()
        self._workers = [asyncio.create_task(self._work()) for _ in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []

    async def _work(self) -> None:
        try:
            while True:
                group = await self.generate(self.task.sample(self._rng))
                await self._queue.put(group)
        except Exception as e:  # the trainer waits in take(): hand it the failure instead of a silent hang
            if not self._failed.done():
                self._failed.set_exception(e)

    async def generate(self, problem: Problem) -> Group:
        prompt_ids = self.tokenizer(problem.prompt).input_ids
        self._num_requests += 1
        body = {
            "prompt": prompt_ids,
            "n": self.group_size,
            "max_tokens": self.task.max_completion_tokens,
            "temperature": self.temperature,
            "logprobs": 0,  # the sampled token's logprob only
            "return_token_ids": True,
            "return_token_weight_versions": True,  # each token's weight version: the lag of every token
            # Seeded per request: a request's samples do not depend on what else is in the engine's batch.
            "seed": self._seed * 1_000_003 + self._num_requests * self.group_size,
        }
        response = await self.http.post("/v1/completions", json=body)
        if response.is_error:
            raise RuntimeError(f"/v1/completions -> {response.status_code}: {response.text}")
        rollouts = [
            Rollout(
                prompt_ids=prompt_ids,
                completion_ids=choice["token_ids"],
                logprobs=choice["logprobs"]["token_logprobs"],
                versions=[int(v) for v in choice["token_weight_versions"]],
                reward=self.task.reward(problem, choice["text"], choice["finish_reason"]),
            )
            for choice in sorted(response.json()["choices"], key=lambda c: c["index"])
        ]
        return Group(problem, rollouts)

    async def take(self, num_groups: int, trainer_version: int, max_lag: int) -> RolloutBatch:
        """The next `num_groups` groups in order of arrival, without their samples older than `max_lag` versions
        (a group left with no sample does not count)."""
        if self._failed is None:
            raise RuntimeError("RolloutStream.take outside `async with stream:`")
        start = time.perf_counter()
        groups: list[Group] = []
        dropped = 0
        while len(groups) < num_groups:
            getter = asyncio.ensure_future(self._queue.get())
            await asyncio.wait([getter, self._failed], return_when=asyncio.FIRST_COMPLETED)
            if self._failed.done():
                getter.cancel()
                self._failed.result()  # raises the worker's error
            group = getter.result()
            fresh = [r for r in group.rollouts if trainer_version - r.oldest_version <= max_lag]
            dropped += len(group.rollouts) - len(fresh)
            if fresh:
                groups.append(Group(group.problem, fresh))
        return RolloutBatch(groups, dropped, (time.perf_counter() - start) * 1e3)
