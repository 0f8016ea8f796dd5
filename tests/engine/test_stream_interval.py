"""stream_interval: a stream gets its tokens K at a time (fewer outputs to build), the same tokens in the end; a
request with stop strings still streams every token (the front end must see each to find them). A consumer slower
than the engine gets what arrived meanwhile as one output (more than K tokens), never a token lost or repeated."""

from __future__ import annotations

import asyncio

import numpy as np
from conftest import KV_BLOCKS

from rlserve.engine.frontend.async_llm import AsyncLLM
from rlserve.outputs import CompletionOutput, RequestOutput
from rlserve.sampling_params import RequestOutputKind, SamplingParams


async def _stream(engine: AsyncLLM, params: SamplingParams) -> list[list[int]]:
    chunks = []
    async for out in engine.generate("hello", params):
        chunks.append(out.outputs[0].token_ids)
    return chunks


def test_stream_interval_groups_tokens(qwen3_dir):
    params = SamplingParams(max_tokens=10, seed=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    every = AsyncLLM(str(qwen3_dir), num_kv_blocks=KV_BLOCKS)
    grouped = AsyncLLM(str(qwen3_dir), num_kv_blocks=KV_BLOCKS, stream_interval=4)
    with_stop = SamplingParams(**{**params.__dict__, "stop": ["\x00never"]})

    async def run() -> tuple[list[list[int]], ...]:
        return await _stream(every, params), await _stream(grouped, params), await _stream(grouped, with_stop)

    try:
        one, four, stopping = asyncio.run(run())
    finally:
        every.shutdown()
        grouped.shutdown()
    # A chunk may hold more when the consumer lagged behind a step (outputs folded): K at a time at least.
    assert all(one) and len(sum(one, [])) == 10
    assert all(len(c) % 4 == 0 for c in four[:-1]) and sum(four, []) == sum(one, [])
    assert sum(stopping, []) == sum(one, [])


def test_slow_consumer_gets_folded_deltas(qwen3_dir):
    """A consumer that reads slower than the engine steps gets fewer outputs, which together hold exactly what
    a prompt reader gets: every token once, its logprob and weight version beside it, the text in order."""
    params = SamplingParams(max_tokens=24, seed=5, ignore_eos=True, logprobs=0, output_kind=RequestOutputKind.DELTA)
    engine = AsyncLLM(str(qwen3_dir), num_kv_blocks=KV_BLOCKS)

    async def read(delay: float) -> list:
        outs = []
        async for out in engine.generate("hello", params):
            outs.append(out.outputs[0])
            await asyncio.sleep(delay)
        return outs

    async def both() -> tuple[list, list]:
        return await read(0.0), await read(0.05)

    try:
        prompt, slow = asyncio.run(both())
    finally:
        engine.shutdown()
    assert len(slow) < len(prompt)
    for outs in (prompt, slow):
        token_ids = sum((o.token_ids for o in outs), [])
        assert len(token_ids) == 24
        assert len(sum((o.logprobs for o in outs), [])) == 24
        assert len(sum((o.weight_versions for o in outs), [])) == 24
        assert [o.finish_reason for o in outs][-1] == "length" and not any(o.finish_reason for o in outs[:-1])
    assert sum((o.token_ids for o in slow), []) == sum((o.token_ids for o in prompt), [])
    assert "".join(o.text for o in slow) == "".join(o.text for o in prompt)


def test_cumulative_outputs_fold_to_the_latest():
    def output(text: str, token_ids: list[int], finished: bool) -> RequestOutput:
        sample = CompletionOutput(0, text, token_ids, None, None, "length" if finished else None)
        return RequestOutput("r", "p", [1], None, [sample], finished)

    folded = output("ab", [1, 2], False)
    folded.add(output("abc", [1, 2, 3], True), aggregate=False)
    assert (folded.outputs[0].text, folded.outputs[0].token_ids, folded.finished) == ("abc", [1, 2, 3], True)
    assert folded.outputs[0].finish_reason == "length"


def test_folded_deltas_keep_the_finished_outputs_routed_experts():
    """Only the finished delta carries the routing of the whole sequence (a MoE server's last stream chunk): an
    unfinished delta folded with it must not drop it."""
    routing = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)

    def delta(text: str, token_ids: list[int], routed: np.ndarray | None) -> RequestOutput:
        finished = routed is not None
        sample = CompletionOutput(0, text, token_ids, None, None, "length" if finished else None)
        sample.routed_experts = routed
        return RequestOutput("r", "p", [1], None, [sample], finished)

    folded = delta("a", [1], None)
    folded.add(delta("b", [2], routing), aggregate=True)
    assert folded.finished and folded.outputs[0].token_ids == [1, 2]
    np.testing.assert_array_equal(folded.outputs[0].routed_experts, routing)
