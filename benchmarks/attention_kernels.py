"""Check and time rlserve's Triton paged-attention kernels on a GPU (written for an H200). From the repo root
(prefix PYTHONPATH=. when rlserve is not pip-installed):

    python benchmarks/attention_kernels.py            # checks, decode (also grouped) / prefill / store timings, graphs
    python benchmarks/attention_kernels.py --quick    # fewer sizes
    python benchmarks/attention_kernels.py --sweep    # also time tile configs of both kernels, best first

Every kernel result is compared with a float64 PyTorch reference that gathers K/V through the block table
(relative Frobenius error; bf16 inputs pass under 1e-2). Times are do_bench medians (L2 flushed between runs).
Decode is bandwidth-bound, so it reports GB/s over the bytes it must move (each sequence's K and V once, plus q and
out) against the H200's ~4.2 TB/s; prefill reports TFLOP/s of causal attention (4 * D * Hq per query-key pair).
The PyTorch baseline is scaled_dot_product_attention on contiguous (non-paged) copies: decode pads every sequence to
the longest context (no mask), so its GB/s counts the padded bytes it reads.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PEAK_BYTES_PER_S = 4.2e12  # H200 HBM3e, about what a device-to-device copy reaches
PEAK_BF16_FLOPS = 790e12  # dense bf16 matmul measured on an H200
HQ, HKV, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
DTYPE = torch.bfloat16


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D], a view of a fused qkv projection like the engine's
    k_new: torch.Tensor  # [T, Hkv, D] views: this step's keys and values
    v_new: torch.Tensor
    slots: torch.Tensor  # [T] int64
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    q_lens: list[int]
    ctx_lens: list[int]  # seq_len per sequence, after this step

    @property
    def max_seqlen_q(self) -> int:
        return max(self.q_lens)


@functools.cache
def kernels():
    """rlserve's Triton kernels, imported on first use: the script answers --help where Triton is missing (CPU CI)."""
    from rlserve.model.kernels import paged_attention

    return paged_attention


@functools.cache
def prefix_kernels():
    """The grouped decode kernels (grouped_prefix_attention), imported on first use as kernels() is."""
    from rlserve.model.kernels import prefix_attention

    return prefix_attention


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def make_batch(
    lens: list[tuple[int, int]],
    *,
    num_heads: int = HQ,
    num_kv_heads: int = HKV,
    head_dim: int = HEAD_DIM,
    block_size: int = BLOCK_SIZE,
    dtype: torch.dtype = DTYPE,
    seed: int = 0,
) -> PagedBatch:
    """Random caches and a shuffled block table for (q_len, seq_len) per sequence; the step's k/v are not stored."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_tokens = sum(q for q, _ in lens)
    blocks_needed = [ceil_div(s, block_size) for _, s in lens]
    num_blocks = sum(blocks_needed) + 8
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    block_tables = torch.full((len(lens), max(blocks_needed) + 1), -1, dtype=torch.int32, device="cuda")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    v_cache = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, device="cuda", generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k_new = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, -1)
    v_new = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots, start = [], 0
    for b, (q_len, seq_len) in enumerate(lens):
        ids = perm[start : start + blocks_needed[b]]
        start += blocks_needed[b]
        block_tables[b, : len(ids)] = ids
        if seq_len < q_len:  # CUDA-graph padding row: nothing to store
            slots.append(torch.full((q_len,), -1, dtype=torch.int64, device="cuda"))
            continue
        pos = torch.arange(seq_len - q_len, seq_len, device="cuda")
        slots.append(ids[pos // block_size].long() * block_size + pos % block_size)
    q_lens = [q for q, _ in lens]
    cu = torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in lens], dtype=torch.int32, device="cuda")
    return PagedBatch(
        q, k_new, v_new, torch.cat(slots), k_cache, v_cache, cu, seq_lens, block_tables, q_lens, [s for _, s in lens]
    )


def reference(batch: PagedBatch, scale: float) -> torch.Tensor:
    """float64 causal attention, gathering K/V through the block table; decode batches are done in chunks."""
    num_tokens, num_heads, head_dim = batch.q.shape
    block_size, num_kv_heads = batch.k_cache.shape[1], batch.k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64, device="cuda")
    if all(q == 1 for q in batch.q_lens):
        for lo in range(0, len(batch.q_lens), 64):
            hi = min(lo + 64, len(batch.q_lens))
            length = max(batch.ctx_lens[lo:hi])
            ids = batch.block_tables[lo:hi, : ceil_div(length, block_size)].clamp_min(0).long()
            keys = batch.k_cache[ids].flatten(1, 2)[:, :length].double()  # [b, L, Hkv, D]
            values = batch.v_cache[ids].flatten(1, 2)[:, :length].double()
            query = batch.q[lo:hi].double().view(hi - lo, num_kv_heads, group, head_dim)
            scores = torch.einsum("bhgd,blhd->bhgl", query, keys) * scale
            invalid = torch.arange(length, device="cuda")[None, :] >= batch.seq_lens[lo:hi, None]
            scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
            o = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), values).reshape(hi - lo, num_heads, head_dim)
            out[lo:hi] = torch.where(batch.seq_lens[lo:hi, None, None] > 0, o, 0.0)
        return out
    row = 0
    for b, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
        ids = batch.block_tables[b, : ceil_div(seq_len, block_size)].long()
        keys = batch.k_cache[ids].flatten(0, 1)[:seq_len].double().repeat_interleave(group, dim=1)
        values = batch.v_cache[ids].flatten(0, 1)[:seq_len].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", batch.q[row : row + q_len].double(), keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device="cuda")[:, None]
        scores = scores.masked_fill(torch.arange(seq_len, device="cuda")[None, :] > q_pos, float("-inf"))
        out[row : row + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        row += q_len
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("nan")
    return ((out.double() - ref).norm() / ref.norm()).item()


def bench(fn: Callable[[], object], rep: int = 200) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def decode_bytes(batch: PagedBatch) -> int:
    """Fewest bytes a decode step must move: each sequence's K and V once, q read, out written."""
    elem = batch.k_cache.element_size()
    kv = sum(batch.ctx_lens) * batch.k_cache.shape[2] * batch.k_cache.shape[3] * 2 * elem
    return kv + 2 * batch.q.numel() * elem


def causal_flops(batch: PagedBatch) -> int:
    """QK^T and PV: 2 * 2 * D flops per (query head, visible key) pair."""
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(batch.q_lens, batch.ctx_lens, strict=True))
    return 4 * batch.q.shape[2] * batch.q.shape[1] * pairs


@dataclass
class Row:
    case: str
    kernel: str
    ms: float
    err: float | None = None
    gbps: float | None = None
    tflops: float | None = None

    def show(self) -> str:
        err = "" if self.err is None else f"{self.err:.1e}"
        gbps = "" if self.gbps is None else f"{self.gbps:7.0f} ({100 * self.gbps * 1e9 / PEAK_BYTES_PER_S:3.0f}%)"
        tflops = "" if self.tflops is None else f"{self.tflops:6.1f}"
        return f"{self.case:<30} {self.kernel:<26} {self.ms:9.4f} {gbps:>15} {tflops:>8} {err:>8}"


HEADER = f"{'case':<30} {'kernel':<26} {'ms':>9} {'GB/s (%peak)':>15} {'TFLOP/s':>8} {'rel err':>8}"


def run_decode(name: str, batch_size: int, lo: int, hi: int, rows: list[Row]) -> None:
    gen = torch.Generator().manual_seed(batch_size)
    ctx = torch.randint(lo, hi + 1, (batch_size,), generator=gen).tolist()
    batch = make_batch([(1, s) for s in ctx], seed=batch_size)
    scale = HEAD_DIM**-0.5
    ref = reference(batch, scale)
    nbytes = decode_bytes(batch)
    out = torch.empty_like(batch.q)

    def decode() -> None:
        kernels().paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, scale, out=out, max_seq_len=hi
        )

    def varlen() -> None:
        kernels().paged_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, scale, 1, out
        )

    splits = kernels()._decode_num_splits(batch_size, HKV, hi, batch.q.device)
    for label, fn in ((f"decode kernel (splits={splits})", decode), ("paged_attention (varlen)", varlen)):
        out.fill_(float("nan"))
        fn()
        err = rel_error(out, ref)
        ms = bench(fn)
        rows.append(Row(name, label, ms, err, gbps=nbytes / ms / 1e6))

    # Baseline: SDPA over contiguous K/V padded to the longest context.
    idx = batch.block_tables[:, : ceil_div(hi, BLOCK_SIZE)].clamp_min(0).long()
    keys = batch.k_cache[idx].flatten(1, 2)[:, :hi].transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    values = batch.v_cache[idx].flatten(1, 2)[:, :hi].transpose(1, 2).contiguous()
    query = batch.q.unsqueeze(2).contiguous()  # [B, Hq, 1, D]
    ms = bench(lambda: F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True))
    padded_bytes = 2 * keys.numel() * keys.element_size() + 2 * query.numel() * query.element_size()
    rows.append(Row(name, "torch SDPA (padded)", ms, gbps=padded_bytes / ms / 1e6))


def run_grouped_decode(name: str, num_groups: int, members: int, prefix_len: int, rows: list[Row]) -> None:
    """A GRPO decode step: num_groups groups of `members` sequences sharing a prefix_len-token prompt (whole blocks),
    each with 1-256 tokens of its own. Today's decode kernel reads every prompt once per member; the grouped kernels
    once per group (per work item). GB/s is over the bytes the step must move when each prompt is read once."""
    from rlserve.model.attention.prefix_groups import find_prefix_groups, members_per_item

    gen = torch.Generator().manual_seed(members)
    own = torch.randint(1, 257, (num_groups * members,), generator=gen).tolist()
    batch = make_batch([(1, prefix_len + n) for n in own], seed=members)
    shared_blocks = prefix_len // BLOCK_SIZE
    prompt_blocks = batch.block_tables[::members, :shared_blocks]  # each group's first member's blocks hold its prompt
    batch.block_tables[:, :shared_blocks] = prompt_blocks.repeat_interleave(members, 0)
    item_size = members_per_item(HQ // HKV)
    groups = find_prefix_groups(batch.block_tables.cpu(), batch.ctx_lens, BLOCK_SIZE, item_size)
    groups = groups.to_device(lambda t: t.cuda())
    scale = HEAD_DIM**-0.5
    ref = reference(batch, scale)
    elem = batch.k_cache.element_size()
    nbytes = (num_groups * prefix_len + sum(own)) * HKV * HEAD_DIM * 2 * elem + 2 * batch.q.numel() * elem
    out = torch.empty_like(batch.q)
    bound = prefix_len + 256

    def today() -> None:
        kernels().paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, scale, out=out, max_seq_len=bound
        )

    def grouped() -> None:
        prefix_kernels().grouped_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, scale, groups.member_rows,
            groups.items, groups.suffix_starts, groups.members_per_item, groups.max_shared_len, out=out,
            max_seq_len=bound,
        )  # fmt: skip

    for label, fn in (("decode kernel (today)", today), (f"grouped ({groups.items.shape[0]} items)", grouped)):
        out.fill_(float("nan"))
        fn()
        err = rel_error(out, ref)
        ms = bench(fn)
        rows.append(Row(name, label, ms, err, gbps=nbytes / ms / 1e6))


def run_prefill(name: str, lens: list[tuple[int, int]], rows: list[Row]) -> None:
    batch = make_batch(lens, seed=len(lens))
    scale = HEAD_DIM**-0.5
    ref = reference(batch, scale)
    flops = causal_flops(batch)
    out = torch.empty_like(batch.q)

    def varlen() -> None:
        kernels().paged_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, scale,
            batch.max_seqlen_q, out,
        )  # fmt: skip

    out.fill_(float("nan"))
    varlen()
    err = rel_error(out, ref)
    ms = bench(varlen)
    rows.append(Row(name, "paged_attention (varlen)", ms, err, tflops=flops / ms / 1e9))

    # Baseline: SDPA per uniform batch on contiguous copies (only when all sequences have the same shape).
    if len(set(lens)) == 1:
        q_len, seq_len = lens[0]
        ids = batch.block_tables[:, : ceil_div(seq_len, BLOCK_SIZE)].long()
        keys = batch.k_cache[ids].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
        values = batch.v_cache[ids].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
        query = batch.q.view(len(lens), q_len, HQ, HEAD_DIM).transpose(1, 2).contiguous()
        if q_len == seq_len:
            mask, causal = None, True
        else:  # bottom-right aligned causal mask: query i sees keys up to seq_len - q_len + i
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device="cuda").tril(seq_len - q_len)
            causal = False
        ms = bench(
            lambda: F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )
        )
        rows.append(Row(name, "torch SDPA (contiguous)", ms, tflops=flops / ms / 1e9))


def run_store(num_tokens: int, rows: list[Row]) -> None:
    batch = make_batch([(num_tokens, num_tokens)], seed=7)
    k_cache, v_cache = batch.k_cache, batch.v_cache
    kernels().store_kv_cache(batch.k_new, batch.v_new, k_cache, v_cache, batch.slots)
    flat_k = k_cache.view(-1, HKV, HEAD_DIM)
    err = 0.0 if torch.equal(flat_k[batch.slots], batch.k_new) else float("nan")
    ms = bench(lambda: kernels().store_kv_cache(batch.k_new, batch.v_new, k_cache, v_cache, batch.slots))
    nbytes = 4 * batch.k_new.numel() * batch.k_new.element_size()  # k and v, each read once and written once
    rows.append(Row(f"store_kv T={num_tokens}", "store_kv_cache", ms, err, gbps=nbytes / ms / 1e6))


def run_cuda_graph(rows: list[Row]) -> None:
    """Capture a decode step (store this step's k/v, then attend) at batch 256 and replay it on new inputs."""
    batch_size, max_seq_len = 256, 641
    gen = torch.Generator().manual_seed(3)
    ctx = torch.randint(256, 640, (batch_size,), generator=gen).tolist()
    ctx[-8:] = [0] * 8  # CUDA-graph padding rows: seq_len 0, slot -1
    # Block tables cover one more token than the captured step, for the replayed one.
    batch = make_batch([(1, s + 1) for s in ctx], seed=3)
    live = torch.tensor(ctx, device="cuda") > 0
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(batch.q)

    def set_lens(lens: torch.Tensor) -> None:
        """Point this step's slots at each live sequence's last position and set seq_lens, in place."""
        last = (lens.long() - 1).clamp_min(0)
        block_ids = batch.block_tables.gather(1, (last // BLOCK_SIZE)[:, None])[:, 0].long()
        batch.slots.copy_(torch.where(live, block_ids * BLOCK_SIZE + last % BLOCK_SIZE, -1))
        batch.seq_lens.copy_(torch.where(live, lens, 0))
        batch.ctx_lens = batch.seq_lens.tolist()

    def step() -> None:
        kernels().store_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slots)
        kernels().paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, scale, out, None, max_seq_len
        )

    set_lens(torch.tensor(ctx, dtype=torch.int32, device="cuda"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # The next step: new queries and keys, one more token per live sequence, written into the captured inputs.
    batch.q.copy_(torch.randn(batch.q.shape, device="cuda").to(DTYPE))
    batch.k_new.copy_(torch.randn(batch.k_new.shape, device="cuda").to(DTYPE))
    set_lens(batch.seq_lens + 1)
    out.fill_(float("nan"))
    graph.replay()
    err = rel_error(out, reference(batch, scale))
    ms = bench(graph.replay)
    rows.append(Row("decode B=256 (store+attn)", "CUDA graph replay", ms, err, gbps=decode_bytes(batch) / ms / 1e6))
    rows.append(Row("decode B=256 (store+attn)", "eager", bench(step)))


def check_shapes(quick: bool) -> list[str]:
    """Odd shapes the timed cases miss: every block size, head dims, GQA ratios, dtypes, split counts."""
    failures = []
    combos = [
        (torch.bfloat16, 16, 128, 2, 8),
        (torch.float16, 32, 64, 4, 2),
        (torch.float32, 64, 128, 1, 4),
        (torch.bfloat16, 128, 64, 7, 2),
        (torch.bfloat16, 256, 128, 4, 2),
        (torch.float32, 16, 96, 3, 2),
    ]
    lens = [(300, 300), (0, 0), (37, 700), (1, 129), (90, 90), (1, 1), (64, 1000)]
    decode_lens = [(1, 700), (1, 0), (1, 1), (1, 257), (1, 64)]
    for dtype, block_size, head_dim, group, num_kv_heads in combos[:3] if quick else combos:
        shape = dict(
            num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size
        )
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        tag = f"{dtype} bs{block_size} d{head_dim} g{group}"
        batch = make_batch(lens, dtype=dtype, seed=1, **shape)
        expected_k = batch.k_cache.clone()
        expected_k.view(-1, num_kv_heads, head_dim)[batch.slots] = batch.k_new
        kernels().store_kv_cache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.slots.int())
        if not torch.equal(batch.k_cache, expected_k):
            failures.append(f"store_kv_cache {tag}")
        out = torch.full_like(batch.q, float("nan"))
        args = (batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, 0.1)
        kernels().paged_attention(*args, batch.max_seqlen_q, out)
        if not rel_error(out, reference(batch, 0.1)) < tol:
            failures.append(f"paged_attention {tag}: {rel_error(out, reference(batch, 0.1)):.2e}")
        batch = make_batch(decode_lens, dtype=dtype, seed=2, **shape)
        ref = reference(batch, 0.1)
        for splits in (1, 3, None):
            out = torch.full_like(batch.q, float("nan"))
            kernels().paged_decode_attention(
                batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, 0.1, out, splits, 1024
            )
            if not rel_error(out, ref) < tol:
                failures.append(f"paged_decode_attention {tag} splits={splits}: {rel_error(out, ref):.2e}")
    return failures


def sweep(rows: list[Row]) -> None:
    """Time the tile configs of both kernels on the W1 decode shapes and on prefill; the 5 fastest per case."""
    scale = HEAD_DIM**-0.5

    def fastest(configs: list[tuple[str, Callable[[], object]]]) -> list[tuple[float, str]]:
        results = []
        for label, fn in configs:
            try:
                results.append((bench(fn, rep=50), label))
            except Exception:  # a config the compiler rejects (shared memory, registers) is simply not a candidate
                continue
        return sorted(results)[:5]

    for batch_size in (256, 1024):
        gen = torch.Generator().manual_seed(batch_size)
        ctx = torch.randint(256, 641, (batch_size,), generator=gen).tolist()
        b = make_batch([(1, s) for s in ctx], seed=batch_size)
        out = torch.empty_like(b.q)
        decode_args = (b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, scale, out)
        configs = [
            (
                f"splits={sp} BLOCK_N={bn} warps={w} stages={st}",
                functools.partial(kernels()._launch_decode, *decode_args, sp, bn, w, st),
            )
            for sp, bn, w, st in itertools.product((1, 2, 4), (64, 128), (2, 4), (2, 3))
        ]
        for ms, label in fastest(configs):
            rows.append(Row(f"sweep decode B={batch_size}", label, ms, gbps=decode_bytes(b) / ms / 1e6))
    prefill_cases = [
        ("sweep prefill 8x512", [(512, 512)] * 8),
        ("sweep chunk 8x512@2048", [(512, 2048)] * 8),
        ("sweep prefill 2x4096", [(4096, 4096)] * 2),
    ]
    for name, lens in prefill_cases:
        b = make_batch(lens, seed=5)
        out = torch.empty_like(b.q)
        varlen_args = (b.q, b.k_cache, b.v_cache, b.cu_seqlens_q, b.seq_lens, b.block_tables, scale, out)
        configs = [
            (
                f"BLOCK_M={bm} BLOCK_N={bn} w={w} s={st}",
                functools.partial(kernels()._launch_paged_attention, *varlen_args, bm, bn, w, st),
            )
            for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
        ]
        for ms, label in fastest(configs):
            rows.append(Row(name, label, ms, tflops=causal_flops(b) / ms / 1e9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--sweep", action="store_true", help="also time tile configs of both kernels")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_kernels.py checks and times Triton kernels on a CUDA GPU: none here")
    import triton

    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)

    failures = check_shapes(args.quick)
    print("shape checks:", "all passed" if not failures else "FAILED\n  " + "\n  ".join(failures), flush=True)

    rows: list[Row] = []
    decode_cases = [("decode B=256 ctx 256-640", 256, 256, 640), ("decode B=1024 ctx 256-640", 1024, 256, 640)]
    if not args.quick:
        decode_cases += [("decode B=1024 ctx 256-512 (W1)", 1024, 256, 512), ("decode B=8 ctx 4k-8k", 8, 4096, 8192)]
    for case in decode_cases:
        run_decode(*case, rows)
    grouped_cases = [("W2 decode 128x8 @ 512", 128, 8, 512), ("W2 decode 32x32 @ 512", 32, 32, 512)]
    if not args.quick:
        grouped_cases += [("long decode 64x16 @ 4096", 64, 16, 4096)]
    for case in grouped_cases:
        run_grouped_decode(*case, rows)
    prefill_cases = [("prefill 8x512", [(512, 512)] * 8), ("chunked 8x512 @ ctx 2048", [(512, 2048)] * 8)]
    if not args.quick:
        prefill_cases += [
            ("prefill 2x4096", [(4096, 4096)] * 2),
            ("mixed 2x512@1024 + 254 decode", [(512, 1024)] * 2 + [(1, 256 + 3 * i // 2) for i in range(254)]),
        ]
    for name, lens in prefill_cases:
        run_prefill(name, lens, rows)
    for num_tokens in (1024,) if args.quick else (1024, 8192):
        run_store(num_tokens, rows)
    run_cuda_graph(rows)
    if args.sweep:
        sweep(rows)

    print()
    print(HEADER)
    for row in rows:
        print(row.show())
    bad = [r for r in rows if r.err is not None and not r.err < 1e-2]
    print("checks:", "all passed" if not failures and not bad else f"FAILED ({len(failures) + len(bad)})")


if __name__ == "__main__":
    main()
