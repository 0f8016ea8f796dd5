"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are read back.

Its placeholders must be invisible: every output equals the synchronous engine's (seeded sampling, logprobs, prompt
logprobs, stops that leave a wasted token in flight, preemption), and no placeholder outlives a run.
"""

from __future__ import annotations

import dataclasses

import pytest

from rlserve import RequestOutputKind, SamplingParams
from rlserve.engine.sched.request import PLACEHOLDER

PROMPTS = [
    {"prompt_token_ids": [5, 17, 200, 33, 90]},
    {"prompt_token_ids": list(range(40, 70))},
    {"prompt_token_ids": [7] * 11},
    {"prompt_token_ids": list(range(100, 123))},
]


def mixed_params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=17, ignore_eos=True, logprobs=0),
        # Stops on a token the model does emit, mid-run: the step after it is already in flight.
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token], logprobs=1),
        SamplingParams(temperature=0.9, seed=3, max_tokens=25, min_tokens=6, stop_token_ids=[stop_token]),
    ]


def exact_fields(outputs) -> list:
    return [
        (
            [(c.token_ids, c.finish_reason, c.stop_reason, c.weight_versions, _ranks(c.logprobs)) for c in o.outputs],
            _ranks(o.prompt_logprobs),
        )
        for o in outputs
    ]


def logprob_values(outputs) -> list[float]:
    """Compared with a tolerance: batches differ by the wasted rows, and fp32 matmuls round by shape."""
    positions = [p for o in outputs for c in o.outputs for p in c.logprobs or []]
    positions += [p for o in outputs for p in o.prompt_logprobs or []]
    return [lp.logprob for p in positions if p is not None for lp in p.values()]


def _ranks(positions) -> list | None:
    if positions is None:
        return None
    return [None if p is None else {t: lp.rank for t, lp in p.items()} for p in positions]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"block_size": 4, "num_kv_blocks": 24, "max_model_len": 64, "max_num_batched_tokens": 16}],
    ids=["default", "preempting-chunked"],
)
def test_async_outputs_equal_sync(qwen3_dir, make_llm, generate, tracked, kwargs) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    sync = make_llm(qwen3_dir, async_scheduling=False, **kwargs)
    # A token the greedy request reaches after a few steps, so its stop lands in the middle of the run.
    stop_token = generate(sync, [PROMPTS[2]], greedy)[0].outputs[0].token_ids[5]
    expected = generate(sync, PROMPTS, mixed_params(stop_token))

    engine = make_llm(qwen3_dir, in_process=True, **kwargs)  # in process: the requests' placeholders are read off
    requests = tracked(engine)
    got = generate(engine, PROMPTS, mixed_params(stop_token))

    assert exact_fields(got) == exact_fields(expected)
    assert logprob_values(got) == pytest.approx(logprob_values(expected), abs=1e-5)
    assert got[2].outputs[0].finish_reason == "stop" and got[2].outputs[0].token_ids[-1] == stop_token
    for request in requests:
        assert request.num_placeholders == 0 and PLACEHOLDER not in request.all_token_ids
    if "num_kv_blocks" in kwargs:
        assert sum(r.num_preemptions for r in requests) > 0, "the tight KV cache was meant to force preemption"


def test_next_step_launches_before_the_previous_is_read(qwen3_dir, make_llm, generate) -> None:
    llm = make_llm(qwen3_dir, in_process=True)  # in process: the runner's launches and resolves are logged
    runner = llm.engine_core.runner
    events: list[str] = []
    launch, resolve = runner.launch, runner.resolve
    sampled_rows = 0

    def logged_launch(scheduled, prev):
        nonlocal sampled_rows
        events.append("launch")
        step = launch(scheduled, prev)
        sampled_rows += len(step.sample_rows)
        return step

    def logged_resolve(step):
        events.append("resolve")
        return resolve(step)

    runner.launch, runner.resolve = logged_launch, logged_resolve
    outputs = generate(llm, PROMPTS, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))

    assert events[:3] == ["launch", "launch", "resolve"]
    assert events.count("launch") == events.count("resolve")
    # Length limits are known at launch: no request is given a token beyond max_tokens, so no row is wasted.
    assert sampled_rows == sum(len(c.token_ids) for o in outputs for c in o.outputs) == 12 * len(PROMPTS)


def test_final_only_requests_send_their_tokens_at_the_end(qwen3_dir, make_llm) -> None:
    """Final-only requests get one output, not one per step; a weight-version change splits it so that every token
    keeps the version it was sampled with, and an abort still returns what was sampled."""
    llm = make_llm(qwen3_dir, in_process=True)  # in process: the test steps the core itself
    core = llm.engine_core
    prompt = PROMPTS[1]["prompt_token_ids"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    expected = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0]
    final_only = dataclasses.replace(greedy, output_kind=RequestOutputKind.FINAL_ONLY)

    core.add_request("a", prompt, final_only)
    core.add_request("b", prompt, final_only)
    outputs = []
    for _ in range(5):
        outputs += core.step()
    assert outputs == []
    llm.update_weight_version("v2")
    aborted = core.abort_requests(["b"])
    while core.has_work():
        outputs += core.step()

    assert [(o.request_id, o.finish_reason, o.weight_version) for o in outputs] == [
        ("a", None, "default"),
        ("a", "length", "v2"),
    ]
    assert [t for o in outputs for t in o.new_token_ids] == expected.token_ids
    # new_logprobs rows are (top ids, top values, the token's value, its rank)
    assert [row[2] for o in outputs for row in o.new_logprobs] == pytest.approx(
        [lp[t].logprob for lp, t in zip(expected.logprobs, expected.token_ids, strict=True)], abs=1e-5
    )
    (abort,) = aborted
    assert abort.finish_reason == "abort" and abort.weight_version == "default"
    assert (
        0 < len(abort.new_token_ids) == len(abort.new_logprobs)
        and abort.new_token_ids == (expected.token_ids[: len(abort.new_token_ids)])
    )


def test_blocks_are_shared_from_the_step_that_computes_them(qwen3_dir, make_llm) -> None:
    """A request admitted right after another's prompt was launched hits its full blocks, as without async
    scheduling: they are registered when the step is launched, not when it is read back."""
    prompt = list(range(3, 3 + 64))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    hits = {}
    for mode in (False, True):
        # The token budget fits one prompt per step: "second" is admitted in the step after "first"'s prefill,
        # which with async scheduling is scheduled before that prefill is read back.
        # In process: the test steps the core itself.
        llm = make_llm(qwen3_dir, in_process=True, block_size=16, max_num_batched_tokens=64, async_scheduling=mode)
        core = llm.engine_core
        core.add_request("first", prompt, params)
        core.add_request("second", prompt, params)
        while core.has_work():
            core.step()
        hits[mode] = core.kv_cache.prefix_hits
    assert hits[True] == hits[False] == 48  # three full blocks; the last token is always computed
