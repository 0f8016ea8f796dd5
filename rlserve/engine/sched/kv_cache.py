"""Paged KV-cache block accounting with a prefix cache keyed by chained hashes of full blocks.

Only bookkeeping lives here; the cache tensors belong to the model runner. A block is "full" once all its
block_size token positions are computed; its hash chains the parent block's hash with its token ids, so equal hashes
mean equal prefixes. Freed blocks keep their hash and sit in an LRU free list, so a later request can still hit them
until the block is reused.
"""

from __future__ import annotations

from collections import OrderedDict

from rlserve.engine.sched.request import Request


class KVCacheManager:
    """Per-block state is kept in flat containers, not one object per block: a small model on a large GPU has
    millions of blocks, and start-up, `reset_prefix_cache` (every weight update) and `free` must not walk them all.
    Only blocks that hold cached content (a hash) cost more than a list slot."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: dict[int, int] = {}  # block id -> hash of its full, committed content
        self.block_token_ids: dict[int, tuple[int, ...]] = {}  # stored to rule out hash collisions
        # Free blocks, taken in this order: freed blocks without cached content (a stack), blocks never used
        # (ids from num_used_once up), then freed blocks with cached content, least recently freed first (taking one
        # evicts its content). Values of the LRU are unused.
        self.free_uncached: list[int] = []
        self.num_used_once = 0
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int, int] = {}
        # Per request: hashes of its full blocks, in order (the chain grows as the request computes tokens).
        self.block_hashes: dict[str, list[int]] = {}
        # The cache epoch in which each request's KV began; a reset starts a new epoch, and KV begun in an older one
        # (computed under replaced weights) is never offered to other requests.
        self.epoch = 0
        self.request_epoch: dict[str, int] = {}
        self.num_committed: dict[str, int] = {}  # full blocks already registered, per request
        # Full blocks an admitted request is computing now, by hash: another request needing the same block (the
        # n samples of one GRPO prompt) waits a step and takes it from the cache instead of computing it again.
        self.in_progress: dict[int, str] = {}  # block hash -> id of the request computing it
        self.in_progress_by_request: dict[str, list[int]] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + (self.num_blocks - self.num_used_once) + len(self.free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _chain(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = self.block_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            # The salt is the first block's parent: requests with different salts share no block (every later hash
            # chains from the first). So is the adapter with its version: KV computed under an adapter serves
            # neither the base model, nor another adapter, nor the same one reloaded.
            if hashes:
                parent = hashes[-1]
            else:
                parent = request.cache_salt if request.lora is None else (request.cache_salt, request.lora)
            hashes.append(hash((parent, tuple(tokens[i * bs : (i + 1) * bs]))))
        return hashes

    def _take_free_block(self) -> int:
        if self.free_uncached:
            block_id = self.free_uncached.pop()
        elif self.num_used_once < self.num_blocks:
            block_id = self.num_used_once
            self.num_used_once += 1
        else:
            block_id, _ = self.free_cached.popitem(last=False)
            block_hash = self.block_hash.pop(block_id)  # reusing it evicts its cached content
            del self.block_token_ids[block_id]
            if self.hash_to_block.get(block_hash) == block_id:
                del self.hash_to_block[block_hash]
        self.ref_count[block_id] = 1
        return block_id

    def match_prefix(self, request: Request) -> int:
        """Attach cached blocks holding a prefix of the request's tokens; return how many tokens they cover.

        The last token is never served from cache: the model must compute at least one position to sample from.
        """
        if not self._uses_cache(request) or request.block_table:
            return 0
        self.request_epoch[request.request_id] = self.epoch
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._chain(request, max_blocks)
        hit = 0
        for i in range(max_blocks):
            block_id = self.hash_to_block.get(hashes[i])
            if block_id is None:
                break
            if self.block_token_ids[block_id] != tuple(request.all_token_ids[i * bs : (i + 1) * bs]):
                break
            if self.ref_count[block_id] == 0:
                del self.free_cached[block_id]
            self.ref_count[block_id] += 1
            request.block_table.append(block_id)
            hit += 1
        self.prefix_queries += request.num_tokens
        self.prefix_hits += hit * bs
        return hit * bs

    def _uses_cache(self, request: Request) -> bool:
        # Prompt logprobs need every prompt position computed, so such requests do not take cached blocks.
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def waits_for_another(self, request: Request) -> bool:
        """Whether the first block of the request's prefix that is not cached yet is being computed by another
        request: admitted a step later, it finds that block in the cache."""
        if not self._uses_cache(request) or request.block_table:
            return False
        for block_hash in self._chain(request, (request.num_tokens - 1) // self.block_size):
            if block_hash not in self.hash_to_block:
                owner = self.in_progress.get(block_hash)
                return owner is not None and owner != request.request_id
        return False

    def mark_in_progress(self, request: Request, num_cached_tokens: int) -> None:
        """Record the full blocks an admitted request will compute, so that requests sharing them wait for them."""
        if not self._uses_cache(request):
            return
        hashes = self._chain(request, (request.num_tokens - 1) // self.block_size)
        mine = self.in_progress_by_request.setdefault(request.request_id, [])
        for block_hash in hashes[num_cached_tokens // self.block_size :]:
            if block_hash not in self.hash_to_block and block_hash not in self.in_progress:
                self.in_progress[block_hash] = request.request_id
                mine.append(block_hash)

    def _done_in_progress(self, request_id: str, block_hash: int) -> None:
        if self.in_progress.get(block_hash) == request_id:
            del self.in_progress[block_hash]

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Make the request's block table cover num_computed_tokens + num_new_tokens; False if blocks run out."""
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(request.block_table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        if not request.block_table:
            self.request_epoch[request.request_id] = self.epoch
        for _ in range(needed):
            request.block_table.append(self._take_free_block())
        return True

    def commit_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register blocks that became full once the request's first num_computed_tokens are in the cache (a step
        has finished), so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        first = self.num_committed.get(request.request_id, 0)
        if num_full <= first or self.request_epoch.get(request.request_id) != self.epoch:
            return
        hashes = self._chain(request, num_full)
        bs = self.block_size
        self.num_committed[request.request_id] = num_full
        for i in range(first, num_full):
            block_id = request.block_table[i]
            if block_id in self.block_hash:
                continue
            self.block_hash[block_id] = hashes[i]
            self.block_token_ids[block_id] = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            self.hash_to_block.setdefault(hashes[i], block_id)
            self._done_in_progress(request.request_id, hashes[i])

    def free(self, request: Request) -> None:
        # Release tail blocks first so that, under eviction, a prefix outlives its continuation.
        ref_count = self.ref_count
        for block_id in reversed(request.block_table):
            ref_count[block_id] -= 1
            if ref_count[block_id] == 0:
                if block_id in self.block_hash:
                    self.free_cached[block_id] = None
                else:
                    self.free_uncached.append(block_id)
        request.block_table = []
        self.block_hashes.pop(request.request_id, None)
        self.request_epoch.pop(request.request_id, None)
        self.num_committed.pop(request.request_id, None)
        for block_hash in self.in_progress_by_request.pop(request.request_id, []):
            self._done_in_progress(request.request_id, block_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix. Blocks in use stay with their requests but will not be shared again."""
        self.hash_to_block.clear()
        self.in_progress.clear()
        self.in_progress_by_request.clear()
        self.block_hash.clear()
        self.block_token_ids.clear()
        self.free_uncached.extend(self.free_cached)
        self.free_cached.clear()
        self.epoch += 1

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
