"""stream_interval: a stream gets its tokens K at a time (fewer outputs to build), the same tokens in the end; a
request with stop strings still streams every token (the front end must see each to find them)."""

from __future__ import annotations

import asyncio

from conftest import KV_BLOCKS

from rlserve.engine.async_llm import AsyncLLM
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
    assert [len(c) for c in one] == [1] * 10
    assert [len(c) for c in four] == [4, 4, 2]
    assert sum(four, []) == sum(one, [])
    assert [len(c) for c in stopping if c] == [1] * 10
