"""A step's batch as the scheduler hands it to the worker (vLLM's SchedulerOutput, as rlserve has it): the scheduled
requests in schedule order, each with the number of its tokens the step computes. Rows of the step's results are in
the same order. The worker reads what it needs to build the step's inputs from each request (its token ids, block
table, sampling parameters); the scheduler accounts for the step once it is launched (`Scheduler.advance`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlserve.engine.sched.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # from request.num_computed_tokens on
