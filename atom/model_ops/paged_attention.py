"""Paged attention in Triton: each sequence reads only the KV blocks its block table names.

Layout: `k_cache`, `v_cache` are `[num_blocks, block_size, Hk, D]`; token `j` of sequence `b`
lives in block `block_tables[b, j // block_size]` at offset `j % block_size`. Query rows are the
newest tokens of their sequence: row `i` of a sequence with `query_len` rows and `context_len`
cached tokens (this step's included) sits at position `context_len - query_len + i` and sees
keys `0..position` (causal within the sequence).

One kernel serves decode and prefill. A program owns one sequence, one tile of its query rows
and one KV head, and stacks that head's GQA group of query heads as extra rows, so each K/V tile
is loaded once for the whole group and both products are `tl.dot`s. It walks the key tiles in
order with an online softmax in fp32; query tiles stop at their last row's position (causal).

- Decode (`paged_decode_attention`): one query row per sequence. When `batch * Hk` programs
  would leave the GPU's SMs idle (small batches, long contexts), each sequence's tiles are split
  over `num_splits` programs that write partial softmax states, merged by a second kernel.
- Prefill, chunked prefill and mixed batches (`paged_prefill_attention`): varlen queries given by
  `cu_seqlens_q`, tiles of query rows per sequence; programs past a sequence's rows exit at once.

CUDA-graph contract for decode (the model runner pads the batch to a captured size):

- Launch shapes, the split count and the workspace depend only on `q.shape`, the cache shape and
  `block_tables.shape`; nothing reads a tensor on the host (no `.item()`, `.tolist()`).
- A padding row has `context_lens[b] == 0` (its block-table row may hold anything, e.g. zeros,
  and is never read) and gets an output of zeros.
- `store_kv` skips tokens whose `slot_mapping` entry is negative: padding rows use slot -1 and
  write nothing to the cache.

`paged_attention_reference` is the plain-PyTorch oracle of the same semantics used by the tests.
Set `TRITON_INTERPRET=1` before triton is first imported to run the kernels on CPU tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never call the kernels
    triton = None
    tl = None

__all__ = [
    "KernelConfig",
    "decode_config",
    "paged_attention_reference",
    "paged_decode_attention",
    "paged_prefill_attention",
    "store_kv",
]

_LOG2E = 1.4426950408889634
_PREFILL_ROWS = 64  # query rows (tokens x group heads) per prefill program
_BLOCK_N = 64  # keys per loop step
_MAX_SPLITS = 32


@dataclass(frozen=True)
class KernelConfig:
    """Keys per loop step and Triton's launch settings of one `_attention_kernel` launch."""

    block_n: int = _BLOCK_N
    num_warps: int = 4
    num_stages: int = 3


def decode_config(batch: int) -> KernelConfig:
    """The decode launch for `batch` rows (a function of shapes only, so that a CUDA graph
    captures the launch it replays). Two pipeline stages beat Triton's default three in every
    case measured; 128 keys per step won below 128 rows, 64 at 256 (H200, bf16, Llama-3.2-1B
    heads: benchmarks/results/h200_2026-12-03f, 0.80-0.96x of the default's time)."""
    return KernelConfig(block_n=64 if batch >= 128 else 128, num_warps=4, num_stages=2)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The oracle: per sequence, gather the blocks its context covers (no other table entry is
    read) and run a masked softmax in fp32.

    q: [T, Hq, D] -> float32 [T, Hq, D]; a sequence with no context gets zeros.
    """
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    page, group = k_cache.size(1), q.size(1) // k_cache.size(2)
    for b, n in enumerate(context_lens.tolist()):
        first, last = cu_seqlens_q[b].item(), cu_seqlens_q[b + 1].item()
        if n == 0 or last == first:
            continue
        blocks = block_tables[b, : -(-n // page)].long()
        keys = k_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, 1)
        values = v_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, 1)
        queries = q[first:last].float()
        pos = n - (last - first) + torch.arange(last - first, device=q.device)
        mask = torch.arange(n, device=q.device).view(1, -1) <= pos.view(-1, 1)  # [Q, K]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[first:last] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_splits(
    batch: int, kv_heads: int, max_keys: int, block_n: int, device: torch.device
) -> int:
    """Split the key range when one program per (sequence, KV head) would not fill the SMs."""
    programs = batch * kv_heads
    sms = _num_sms(device)
    if programs >= sms:
        return 1
    return min(_MAX_SPLITS, _pow2(-(-sms // programs)), _pow2(-(-max_keys // block_n)))


if triton is not None:

    @triton.jit
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, denom_ptr, acc_ptr,
        tables_ptr, context_lens_ptr, cu_q_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_table, page_size,
        GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        SPLITS: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Grid: (sequence, query tile, KV head * SPLITS). Row r of the tile is query token
        # r // G_PAD of the tile and query head kv_head * GROUP + r % G_PAD.
        seq = tl.program_id(0)
        q_tile = tl.program_id(1)
        kv_head = tl.program_id(2) // SPLITS
        split = tl.program_id(2) % SPLITS
        ctx_len = tl.load(context_lens_ptr + seq).to(tl.int32)
        if VARLEN:
            q_first = tl.load(cu_q_ptr + seq).to(tl.int32)
            q_len = tl.load(cu_q_ptr + seq + 1).to(tl.int32) - q_first
        else:
            q_first = seq
            q_len = 1
        rows = tl.arange(0, BLOCK_Q * G_PAD)
        q_idx = q_tile * BLOCK_Q + rows // G_PAD
        head = kv_head * GROUP + rows % G_PAD
        row_ok = (q_idx < q_len) & (rows % G_PAD < GROUP)
        q_pos = ctx_len - q_len + q_idx
        token = (q_first + q_idx).to(tl.int64)
        d = tl.arange(0, D_PAD)
        d_ok = d[None, :] < HEAD_DIM
        q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)

        # Keys up to the tile's last query position (none for a tile past the sequence's rows),
        # cut into SPLITS contiguous runs of key tiles.
        kv_end = tl.minimum(ctx_len, ctx_len - q_len + (q_tile + 1) * BLOCK_Q)
        kv_end = tl.where(q_tile * BLOCK_Q < q_len, kv_end, 0)
        n_tiles = tl.cdiv(kv_end, BLOCK_N)
        per_split = tl.cdiv(n_tiles, SPLITS)
        first_tile = split * per_split
        last_tile = tl.minimum(first_tile + per_split, n_tiles)

        m = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
        for t in range(first_tile, last_tile):
            n = t * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < kv_end
            page = tl.load(tables_ptr + seq * stride_table + n // page_size, mask=n_ok, other=0)
            page = page.to(tl.int64)
            kv_mask = n_ok[:, None] & d_ok
            off = (n % page_size)[:, None]
            k_ptrs = k_ptr + page[:, None] * stride_kb + off * stride_kt + kv_head * stride_kh
            k = tl.load(k_ptrs + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
            denom = denom * alpha + tl.sum(p, 1)
            v_ptrs = v_ptr + page[:, None] * stride_vb + off * stride_vt + kv_head * stride_vh
            v = tl.load(v_ptrs + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new

        if SPLITS == 1:
            out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # no keys (padding row): zeros
            o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok)
        else:  # partial state of (token, head, split), merged by _merge_splits_kernel
            part = (token * (tl.num_programs(2) // SPLITS * GROUP) + head) * SPLITS + split
            tl.store(m_ptr + part, m, mask=row_ok)
            tl.store(denom_ptr + part, denom, mask=row_ok)
            tl.store(acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _merge_splits_kernel(
        out_ptr, m_ptr, denom_ptr, acc_ptr, stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        # Grid: (token, query head). Rescale each split's state to the common maximum.
        token = tl.program_id(0)
        head = tl.program_id(1)
        part = (token * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)
        m = tl.load(m_ptr + part)
        m_max = tl.max(m, 0)
        w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
        denom = tl.sum(w * tl.load(denom_ptr + part), 0)
        d = tl.arange(0, D_PAD)
        acc = tl.sum(w[:, None] * tl.load(acc_ptr + part[:, None] * D_PAD + d[None, :]), 0)
        out = acc / tl.where(denom > 0, denom, 1.0)
        o_ptrs = out_ptr + token * stride_ot + head * stride_oh + d
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
        stride_k, stride_v, stride_cb, stride_ct, page_size,
        WIDTH: tl.constexpr, W_PAD: tl.constexpr,
    ):  # fmt: skip
        # Grid: (token,). One token's Hk * D values of K and of V; a negative slot writes nothing.
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        i = tl.arange(0, W_PAD)
        ok = i < tl.where(slot >= 0, WIDTH, 0)
        dst = (slot // page_size) * stride_cb + (slot % page_size) * stride_ct + i
        tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_k + i, mask=ok), mask=ok)
        tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_v + i, mask=ok), mask=ok)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v [T, Hk, D] at flat cache slots `slot_mapping` [T]; negative slots are skipped."""
    hk, d = k_cache.shape[2:]
    for x in (k, v):
        if x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError("k/v rows must hold their heads contiguously")
    if k_cache.stride() != v_cache.stride() or k_cache.stride()[2:] != (d, 1):
        raise ValueError("k_cache and v_cache must share a [blocks, block_size, Hk, D] layout")
    if k.size(0) == 0:
        return
    _store_kv_kernel[(k.size(0),)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.size(1),
        hk * d, _pow2(hk * d),
    )  # fmt: skip


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    scale: float,
    grid: tuple[int, int, int],
    block_q: int,
    splits: int,
    config: KernelConfig,
) -> torch.Tensor:
    """Check inputs, run `_attention_kernel` (and the split merge) and return [T, Hq, D]."""
    t, hq, d = q.shape
    hk = k_cache.size(2)
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError("q, k_cache and v_cache must share a dtype")
    if hq % hk or q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("Hq must be a multiple of Hk and head_dim contiguous")
    group, d_pad = hq // hk, _pow2(d, 16)
    g_pad = _pow2(group, 16 // block_q)
    out = torch.empty_like(q)
    part = t * hq * splits
    m = torch.empty(part if splits > 1 else 1, dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    acc = torch.empty(part * d_pad if splits > 1 else 1, dtype=torch.float32, device=q.device)
    _attention_kernel[grid](
        q, k_cache, v_cache, out, m, denom, acc,
        block_tables, context_lens, context_lens if cu_seqlens_q is None else cu_seqlens_q,
        scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0), k_cache.size(1),
        group, g_pad, block_q, config.block_n, d, d_pad, splits, cu_seqlens_q is not None,
        "ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(t, hq)](
            out, m, denom, acc, out.stride(0), out.stride(1), d, d_pad, splits
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """One query row per sequence. q: [B, Hq, D]; block_tables: [B, max_blocks];
    context_lens: [B] (0 for padding rows, which get zeros) -> [B, Hq, D].

    `num_splits` (a power of two) and `config` override what is chosen from the shapes
    (benchmarks/tune_decode_attention.py compares configs)."""
    batch, hk = q.size(0), k_cache.size(2)
    if block_tables.size(0) != batch or context_lens.size(0) != batch:
        raise ValueError("q, block_tables and context_lens must have one row per sequence")
    config = config or decode_config(batch)
    if num_splits is None:
        max_keys = block_tables.size(1) * k_cache.size(1)
        num_splits = _default_splits(batch, hk, max_keys, config.block_n, q.device)
    if num_splits & (num_splits - 1):
        raise ValueError("num_splits must be a power of two")
    grid = (batch, 1, hk * num_splits)
    return _launch(
        q, k_cache, v_cache, block_tables, context_lens, None, scale, grid, 1, num_splits, config
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> torch.Tensor:
    """Varlen queries (prefill chunks, decode rows, any mix). q: [T, Hq, D] with sequence b's
    rows at `cu_seqlens_q[b]:cu_seqlens_q[b + 1]`; `max_query_len` (a host int) sizes the grid.
    -> [T, Hq, D]."""
    group = q.size(1) // k_cache.size(2)
    block_q = max(1, _PREFILL_ROWS // _pow2(group))
    grid = (block_tables.size(0), triton.cdiv(max_query_len, block_q), k_cache.size(2))
    return _launch(
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale, grid, block_q, 1,
        KernelConfig(),
    )  # fmt: skip
