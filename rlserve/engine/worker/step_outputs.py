"""What a launched step gives back: `LaunchedStep` while its device work runs (the next step reads its sampled ids
for placeholders), and its results on the host, `RunnerOutput`, aligned with the scheduler's batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlserve.engine.sched.batch import ScheduledRequest
from rlserve.model.sampler import LogprobsTensors
from rlserve.outputs import PositionLogprobsData


@dataclass
class RunnerOutput:
    """Aligned with the scheduled list: a token where the request sampled, None where it only prefilled."""

    sampled_token_ids: list[int | None]
    logprobs: list[PositionLogprobsData | None]
    # request index in the scheduled list -> logprobs of the prompt tokens this step's chunk predicts
    prompt_logprobs: dict[int, list[PositionLogprobsData]]


@dataclass(eq=False)
class LaunchedStep:
    """A step whose device work is enqueued; its results are read back by `ModelRunner.resolve`."""

    scheduled: list[ScheduledRequest]
    sample_rows: list[int]  # index into `scheduled` of each request that samples
    sample_index: dict[str, int]  # request id -> row of its token in sampled_token_ids
    prompt_rows: list[tuple[int, int, int]]  # (scheduled index, first hidden row, count)
    sampled_token_ids: torch.Tensor  # on the device: the next step's placeholder inputs come from here
    host_token_ids: torch.Tensor  # the same, being copied to (pinned) host memory
    host_logprobs: LogprobsTensors | None
    host_prompt_logprobs: LogprobsTensors | None
    # With routed experts returned: the step's rows (host copy), each input token's slot, (request id, end) pairs.
    host_routed: tuple[torch.Tensor, list[int], list[tuple[str, int]]] | None = None
    done: torch.cuda.Event | None = None  # recorded after the copies; None on the CPU, where work is synchronous

    def output(self) -> RunnerOutput:
        """The step's tokens and logprobs as host values, once its copies are done (`ModelRunner.resolve` waits)."""
        sampled: list[int | None] = [None] * len(self.scheduled)
        logprobs: list[PositionLogprobsData | None] = [None] * len(self.scheduled)
        for i, token in zip(self.sample_rows, self.host_token_ids.tolist(), strict=True):
            sampled[i] = token
        if self.host_logprobs is not None:
            for i, row in zip(self.sample_rows, _to_host(self.host_logprobs), strict=True):
                k = self.scheduled[i].request.sampling_params.logprobs
                if k is not None:
                    logprobs[i] = row._replace(topk_ids=row.topk_ids[:k], topk_values=row.topk_values[:k])
        prompt_logprobs: dict[int, list[PositionLogprobsData]] = {}
        if self.host_prompt_logprobs is not None:
            host = _to_host(self.host_prompt_logprobs)
            offset = 0
            for i, _, count in self.prompt_rows:
                kk = self.scheduled[i].request.sampling_params.prompt_logprobs
                prompt_logprobs[i] = [
                    PositionLogprobsData(a[:kk], b[:kk], c, d) for a, b, c, d in host[offset : offset + count]
                ]
                offset += count
        return RunnerOutput(sampled, logprobs, prompt_logprobs)


def _to_host(t: LogprobsTensors) -> list[PositionLogprobsData]:
    columns = t.topk_ids.tolist(), t.topk_values.tolist(), t.token_values.tolist(), t.token_ranks.tolist()
    return list(map(PositionLogprobsData._make, zip(*columns, strict=True)))
