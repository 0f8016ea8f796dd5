"""Block accounting of KVCacheManager on its own: which free block is taken next, what a hit and a reset do."""

from __future__ import annotations

import pytest

from rlserve.engine.sched.kv_cache import KVCacheManager
from rlserve.engine.sched.request import Request
from rlserve.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=8)
    request = Request(request_id, list(tokens), params, frozenset(), max_model_len=1024, cache_salt=cache_salt)
    request.all_token_ids = list(tokens)
    return request


def compute(cache: KVCacheManager, request: Request) -> None:
    """What a step does for the request: cover its tokens with blocks and register the full ones."""
    assert cache.allocate(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    cache.commit_full_blocks(request, request.num_computed_tokens)


def test_free_blocks_are_taken_uncached_first_then_unused_then_least_recently_freed() -> None:
    cache = KVCacheManager(num_blocks=6, block_size=BLOCK, enable_prefix_caching=True)
    cached = make_request("cached", list(range(8)))  # two full blocks: cached content once freed
    compute(cache, cached)
    partial = make_request("partial", [100, 101])  # one partial block: nothing cached
    compute(cache, partial)
    assert (cached.block_table, partial.block_table) == ([0, 1], [2])
    cache.free(cached)
    cache.free(partial)
    assert cache.num_free_blocks == 6

    taker = make_request("taker", list(range(200, 224)))  # needs all six blocks
    assert cache.allocate(taker, 24)
    # The freed partial block first, then the never-used ones, then the cached blocks, tail (freed first) before
    # the prefix: a prefix outlives its continuation.
    assert taker.block_table == [2, 3, 4, 5, 1, 0]
    assert cache.num_free_blocks == 0
    assert not cache.allocate(make_request("more", [1]), 1)


def test_hit_takes_a_freed_cached_block_and_eviction_forgets_it() -> None:
    cache = KVCacheManager(num_blocks=3, block_size=BLOCK, enable_prefix_caching=True)
    first = make_request("a", list(range(9)))  # two full blocks and one token
    compute(cache, first)
    cache.free(first)

    again = make_request("b", list(range(9)))
    assert cache.match_prefix(again) == 2 * BLOCK
    assert again.block_table == [0, 1]
    assert cache.num_free_blocks == 1
    cache.free(again)

    # Fill the cache with other content: the old blocks are evicted and no longer match.
    other = make_request("c", list(range(50, 62)))
    compute(cache, other)
    cache.free(other)
    assert cache.match_prefix(make_request("d", list(range(9)))) == 0


def test_a_cache_salt_is_a_namespace() -> None:
    """Requests share cached blocks only with requests of the same salt (none being a namespace of its own)."""
    cache = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    tokens = list(range(9))
    for salt in ("policy-1", None):
        first = make_request(f"first-{salt}", tokens, salt)
        compute(cache, first)
        cache.free(first)
    assert cache.match_prefix(make_request("same", tokens, "policy-1")) == 2 * BLOCK
    assert cache.match_prefix(make_request("unsalted", tokens)) == 2 * BLOCK
    assert cache.match_prefix(make_request("other", tokens, "policy-2")) == 0


@pytest.mark.parametrize("in_use", [False, True])
def test_reset_forgets_every_prefix_and_keeps_the_count(in_use: bool) -> None:
    cache = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    holder = make_request("a", list(range(9)))
    compute(cache, holder)
    if not in_use:
        cache.free(holder)
    free_before = cache.num_free_blocks
    cache.reset_prefix_cache()
    assert cache.num_free_blocks == free_before
    assert cache.match_prefix(make_request("b", list(range(9)))) == 0
    if in_use:
        # KV begun before the reset is never registered again, even when more of it is committed.
        holder.all_token_ids += [9, 10, 11]
        holder.num_computed_tokens = 12
        cache.commit_full_blocks(holder, 12)
        assert cache.match_prefix(make_request("c", list(range(13)))) == 0
        cache.free(holder)
    assert cache.num_free_blocks == 8


def test_a_reset_touches_only_blocks_that_were_used() -> None:
    cache = KVCacheManager(num_blocks=5_000_000, block_size=BLOCK, enable_prefix_caching=True)
    request = make_request("a", list(range(9)))
    compute(cache, request)
    cache.free(request)
    cache.reset_prefix_cache()
    assert cache.num_free_blocks == 5_000_000
    assert len(cache.free_uncached) == 3  # the only blocks ever touched
