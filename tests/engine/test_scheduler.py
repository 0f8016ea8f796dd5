"""The scheduler on its own: token budget, admission order, chunked prefill, preemption and pause states."""

from __future__ import annotations

from rlserve.engine.sched.kv_cache import KVCacheManager
from rlserve.engine.sched.request import Request, RequestStatus
from rlserve.engine.sched.scheduler import PauseState, Scheduler, SchedulerConfig
from rlserve.sampling_params import SamplingParams

BLOCK = 4


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=32, chunked=True, prefix_caching=False) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, chunked), kv)


def make_request(request_id: str, prompt_len: int, max_tokens: int = 8) -> Request:
    prompt = [(hash(request_id) + i) % 1000 + 1 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), frozenset(), 1024)


def run_step(scheduler: Scheduler, token: int = 7) -> list[tuple[str, int]]:
    """Schedule, launch (placeholders), then read back a token for every sampling request, as EngineCore does."""
    scheduled = scheduler.schedule()
    sample_rows = [
        i for i, s in enumerate(scheduled) if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens
    ]
    scheduler.advance(scheduled, sample_rows)
    for i in sample_rows:
        request = scheduled[i].request
        status = request.resolve_placeholder(token)
        if status is not None:
            scheduler.finish(request, status)
    return [(s.request.request_id, s.num_new_tokens) for s in scheduled]


def test_admits_in_order_within_the_token_budget_and_chunks_the_rest():
    scheduler = make_scheduler(budget=32)
    for rid, n in (("a", 20), ("b", 20)):
        scheduler.add_request(make_request(rid, n))
    assert run_step(scheduler) == [("a", 20), ("b", 12)]  # b's prompt is chunked at the budget
    assert run_step(scheduler) == [("a", 1), ("b", 8)]  # decodes first, then the rest of b's prompt
    assert run_step(scheduler) == [("a", 1), ("b", 1)]


def test_without_chunked_prefill_a_prompt_over_the_budget_waits():
    scheduler = make_scheduler(budget=32, chunked=False)
    for rid, n in (("a", 20), ("b", 20)):
        scheduler.add_request(make_request(rid, n))
    assert run_step(scheduler) == [("a", 20)]
    assert run_step(scheduler) == [("a", 1), ("b", 20)]


def test_max_num_seqs_bounds_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2, budget=256)
    for rid in "abc":
        scheduler.add_request(make_request(rid, 4))
    assert [rid for rid, _ in run_step(scheduler)] == ["a", "b"]
    assert len(scheduler.running) == 2 and [r.request_id for r in scheduler.waiting] == ["c"]


def test_out_of_blocks_preempts_the_latest_admitted_and_readmits_it_first():
    # 6 blocks of 4 tokens: two 8-token prompts take 4 blocks; decoding past 12 tokens each needs more than 6.
    scheduler = make_scheduler(num_blocks=6, budget=64)
    a, b = make_request("a", 8, max_tokens=16), make_request("b", 8, max_tokens=16)
    scheduler.add_request(a)
    scheduler.add_request(b)
    preempted_at = None
    for step in range(40):
        run_step(scheduler)
        if b.num_preemptions and preempted_at is None:
            preempted_at = step
            assert b.status is RequestStatus.WAITING and scheduler.waiting[0] is b and a in scheduler.running
        if not scheduler.has_schedulable_work():
            break
    assert preempted_at is not None, "the cache was never short: the test does not exercise preemption"
    assert a.num_preemptions == 0
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH
    assert len(a.output_token_ids) == len(b.output_token_ids) == 16
    assert scheduler.kv_cache.num_free_blocks == 6  # every block came back


def test_pause_states():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4))
    run_step(scheduler)
    scheduler.add_request(make_request("b", 4))
    scheduler.pause_state = PauseState.PAUSED_ALL
    assert scheduler.schedule() == [] and not scheduler.has_schedulable_work()
    scheduler.pause_state = PauseState.PAUSED_NEW  # running requests continue, nothing new starts
    assert [rid for rid, _ in run_step(scheduler)] == ["a"]
    assert scheduler.num_in_flight == 1
    scheduler.pause_state = PauseState.UNPAUSED
    assert [rid for rid, _ in run_step(scheduler)] == ["a", "b"]


def test_finish_removes_a_waiting_request_and_frees_its_blocks():
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 4), make_request("b", 4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler)
    scheduler.finish(b, RequestStatus.FINISHED_ABORTED)
    scheduler.finish(a, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.waiting and not scheduler.running
    assert scheduler.kv_cache.num_free_blocks == 64
