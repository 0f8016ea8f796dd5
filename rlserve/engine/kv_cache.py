"""Paged KV-cache block accounting with a prefix cache keyed by chained hashes of full blocks.

Only bookkeeping lives here; the cache tensors belong to the model runner. A block is "full" once all its
block_size token positions are computed; its hash chains the parent block's hash with its token ids, so equal hashes
mean equal prefixes. Freed blocks keep their hash and sit in an LRU free list, so a later request can still hit them
until the block is reused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from rlserve.engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # stored to rule out hash collisions


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (least recently freed first). Values are unused.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
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
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _chain(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = self.block_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(tokens[i * bs : (i + 1) * bs]))))
        return hashes

    def _take_free_block(self) -> Block:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # reusing it evicts its cached content
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash = block.token_ids = None
        block.ref_count = 1
        return block

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
            block = self.blocks[block_id]
            if block.token_ids != tuple(request.all_token_ids[i * bs : (i + 1) * bs]):
                break
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
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
            request.block_table.append(self._take_free_block().block_id)
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
            block = self.blocks[request.block_table[i]]
            if block.block_hash is not None:
                continue
            block.block_hash = hashes[i]
            block.token_ids = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            self.hash_to_block.setdefault(hashes[i], block.block_id)
            self._done_in_progress(request.request_id, hashes[i])

    def free(self, request: Request) -> None:
        # Release tail blocks first so that, under eviction, a prefix outlives its continuation.
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
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
        for block in self.blocks:
            block.block_hash = block.token_ids = None
        self.epoch += 1

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
