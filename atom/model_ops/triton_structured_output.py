"""Packed-bitmask logit masking: a Triton kernel for CUDA and a CPU reference with the same meaning.

Semantics (shared by both paths, matching llguidance's bitmask layout):

- ``bitmask`` is int32 ``[R, W]``; bit ``j`` of word ``w`` (little-endian) is token ``32 * w + j``;
  a set bit means *allowed*.
- Without ``row_indices``, mask row ``i`` applies to logits row ``i`` for ``i < B``.
  With ``row_indices`` (``N`` ints), mask row ``i`` applies to logits row ``row_indices[i]``; the
  mask buffer can therefore be compact (one row per constrained target/bonus row).
- Forbidden logits become ``-inf``; allowed logits keep their values.
- Logit columns at or past ``32 * W`` (an LM head wider than the grammar vocabulary) are forbidden.

The kernel never expands a vocabulary-sized Boolean tensor and never gathers complete logit rows.
Each program takes a tile of mask words of one row and views its logits as 16-byte vectors
(8 bf16/fp16 or 4 fp32 tokens, one byte or nibble of a mask word each). Every vector is handled
by predication, with no branches and no loop over bits: a vector whose bits are all set issues
no memory access; one with no bit set is overwritten with ``-inf`` by a full 16-byte store
without being read; a mixed one is loaded, selected and stored back whole (allowed values
unchanged), so no access is narrower than 16 bytes. When rows are whole 4-byte lanes (always
for fp32; even vocab and stride for 16-bit types) the select is done on int32 lanes with a
per-device 16-byte keep-mask table indexed by the vector's mask bits (one L1-resident load and
bitwise ops instead of a select per element); otherwise per element. With several tiles per
program the next tile's mask words are loaded before the current tile's stores.

Triton is imported here, but only this module does so and nothing on the ordinary (unconstrained)
path imports it; set ``TRITON_INTERPRET=1`` before the first import to run the kernel on CPU.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference path
    triton = None
    tl = None

__all__ = [
    "apply_token_bitmask_inplace",
    "apply_token_bitmask_inplace_reference",
    "apply_token_bitmask_inplace_triton",
    "kernel_config",
]


def _check(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | None) -> int:
    """Validate shapes and return the number of mask rows to apply."""
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError("logits must be [B, V] and bitmask [R, W]")
    if bitmask.dtype != torch.int32:
        raise ValueError("bitmask must be int32")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported logits dtype {logits.dtype}")
    n = logits.shape[0] if row_indices is None else row_indices.numel()
    if n > bitmask.shape[0]:
        raise ValueError(f"{n} rows to mask but the bitmask holds {bitmask.shape[0]}")
    return n


def apply_token_bitmask_inplace_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | None = None
) -> None:
    """CPU reference (and the CPU execution path): one row at a time, bits unpacked per row."""
    n = _check(logits, bitmask, row_indices)
    vocab = logits.shape[1]
    covered = min(vocab, 32 * bitmask.shape[1])
    rows = range(n) if row_indices is None else row_indices.tolist()
    words = bitmask[:n].cpu().numpy()
    for i, row in enumerate(rows):
        bits = np.unpackbits(words[i].view(np.uint8), bitorder="little")[:covered]
        forbidden = torch.from_numpy(bits == 0).to(logits.device)
        logits[row, :covered].masked_fill_(forbidden, float("-inf"))
        if covered < vocab:
            logits[row, covered:] = float("-inf")


_SMS = 132  # H200; the grid only needs the order of magnitude


def kernel_config(n_rows: int, n_words: int, elem_size: int = 2) -> tuple[int, int, int, int]:
    """(words per tile, tiles per program, warps, wide mask load), from the H200 sweeps in
    ``benchmarks/bench_bitmask_kernel.py --sweep`` (no run-time autotuning): 128-word tiles
    with one contiguous mask load for 2-byte logits, 64-word tiles for fp32 (twice the vectors
    per word); halved while the grid would leave SMs idle (small batches)."""
    block_w, tiles, warps, wide = (128, 1, 4, 1) if elem_size <= 2 else (64, 1, 4, 0)
    while block_w > 32 and n_rows * -(-n_words // block_w) < 2 * _SMS:
        block_w //= 2
    return block_w, tiles, warps, wide


if triton is not None:

    @triton.jit
    def _bitmask_kernel(
        logits_ptr,
        bitmask_ptr,
        rows_ptr,
        vocab,
        n_words,
        logits_stride,
        bitmask_stride,
        lut_ptr,
        progs_per_row,
        HAS_ROWS: tl.constexpr,
        BLOCK_W: tl.constexpr,
        TILES: tl.constexpr,
        VEC: tl.constexpr,
        WIDE_MASK: tl.constexpr = False,
        PACKED: tl.constexpr = False,
        EVEN_VEC: tl.constexpr = False,
        NINF32: tl.constexpr = 0,
    ):
        # One program: TILES consecutive tiles of BLOCK_W mask words of one row. A tile is held
        # as [BLOCK_W * 32 / VEC, VEC]: one 16-byte logits vector per row of the tensor, whose
        # VEC mask bits are one byte (bf16/fp16) or nibble (fp32) of its word. Per vector:
        # all bits set -> no load, no store; no bit set -> store -inf, no load; mixed -> load,
        # select, store the whole vector (full 16-byte accesses, never partial ones).
        # 1-D grid, tile-major within a row: neighbouring programs stream neighbouring memory.
        pid = tl.program_id(0)
        i = pid // progs_per_row
        t0 = (pid % progs_per_row) * TILES
        if HAS_ROWS:
            row = tl.load(rows_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        G: tl.constexpr = 32 // VEC
        NV: tl.constexpr = BLOCK_W * G
        FULL: tl.constexpr = (1 << VEC) - 1
        v = tl.arange(0, NV)
        lanes = tl.arange(0, VEC)
        mrow = bitmask_ptr + i.to(tl.int64) * bitmask_stride
        if PACKED:  # vocab and logits_stride are in int32 lanes
            lrow = logits_ptr.to(tl.pointer_type(tl.int32)) + row * logits_stride
        else:
            lrow = logits_ptr + row * logits_stride
        shift = (v % G) * VEC
        # Words past the mask read as 0: the LM-head tail beyond the grammar vocab is forbidden.
        if WIDE_MASK:  # one contiguous (16-byte per thread) load, spread to vectors on chip
            w = t0 * BLOCK_W + tl.arange(0, BLOCK_W)
        else:  # each vector loads its own word (G neighbours share one address)
            w = t0 * BLOCK_W + v // G
        words = tl.load(mrow + w, mask=w < n_words, other=0)
        for k in range(TILES):
            t = t0 + k
            # Prefetch the next tile's words before this tile's stores (their latency overlaps).
            if TILES > 1:
                w_next = w + BLOCK_W
                nxt = tl.load(mrow + w_next, mask=(w_next < n_words) & (k + 1 < TILES), other=0)
            if WIDE_MASK:
                wv = tl.reshape(tl.broadcast_to(words[:, None], (BLOCK_W, G)), (NV,))
            else:
                wv = words
            bits = (wv >> shift) & FULL
            mixed = (bits != FULL) & (bits != 0)
            if PACKED:
                # The vector as 4 int32 lanes; the LUT row for its mask bits holds, per lane,
                # all-ones over allowed elements: new = (old & m) | (-inf & ~m). Per vector
                # this is one L1-resident LUT load and 4 bitwise ops instead of a select per
                # element (what bounds the time when most vectors are all-allowed).
                E: tl.constexpr = VEC // 4  # elements per int32 lane
                j = tl.arange(0, 4)
                start = t * (BLOCK_W * 32 // E) + v * 4  # int32 lane of each vector's start
                cols = start[:, None] + j[None, :]
                if EVEN_VEC:  # vocab is whole vectors: one compare per vector
                    in_vocab = (start < vocab)[:, None]
                else:
                    in_vocab = cols < vocab
                ptrs = lrow + cols
                m = tl.load(lut_ptr + bits[:, None] * 4 + j[None, :], mask=mixed[:, None], other=0)
                old = tl.load(ptrs, mask=mixed[:, None] & in_vocab)  # unread lanes: m == 0
                new = (old & m) | (NINF32 & ~m)
            else:
                cols = (t * (BLOCK_W * 32) + v * VEC)[:, None] + lanes[None, :]
                in_vocab = cols < vocab
                ptrs = lrow + cols
                old = tl.load(ptrs, mask=mixed[:, None] & in_vocab, other=float("-inf"))
                keep = ((bits[:, None] >> lanes[None, :]) & 1) != 0
                new = tl.where(keep, old, float("-inf")).to(logits_ptr.dtype.element_ty)
            tl.store(ptrs, new, mask=(bits != FULL)[:, None] & in_vocab)
            if TILES > 1:
                words = nxt
                w = w_next


# -inf in every element of an int32 lane, as a signed int32.
_NINF32 = {
    torch.bfloat16: 0xFF80FF80 - 2**32,
    torch.float16: 0xFC00FC00 - 2**32,
    torch.float32: 0xFF800000 - 2**32,
}
_LUTS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _lut(device: torch.device, elem: int) -> torch.Tensor:
    """int32 [2**VEC, 4]: row b is the 16-byte keep-mask of a vector whose mask bits are b
    (all-ones over each allowed element). Built once per device and element size, on the host
    (a few KB); the first call must not be inside a CUDA-graph capture."""
    key = (device, elem)
    if key not in _LUTS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("call apply_token_bitmask_inplace once before graph capture")
        vec = 16 // elem
        b = torch.arange(2**vec, dtype=torch.int64)[:, None]
        k = torch.arange(vec)
        ones = ((b >> k) & 1).view(2**vec, 4, vec // 4)  # [entry, lane, element in lane]
        elem_mask = (1 << (8 * elem)) - 1
        shifts = torch.arange(vec // 4) * (8 * elem)
        lanes = (ones * (elem_mask << shifts)).sum(-1)  # uint32 values in int64
        lanes = torch.where(lanes >= 2**31, lanes - 2**32, lanes).to(torch.int32)
        _LUTS[key] = lanes.contiguous().to(device)
    return _LUTS[key]


def apply_token_bitmask_inplace_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    row_indices: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int] | None = None,
) -> None:
    """Launch the Triton kernel (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

    ``config`` overrides ``kernel_config``: (words per tile, tiles per program, warps[, wide]),
    ``wide`` loading each tile's mask words with one contiguous load (see the kernel).
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    n = _check(logits, bitmask, row_indices)
    if n == 0:
        return
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    if row_indices is not None and not row_indices.is_contiguous():
        row_indices = row_indices.contiguous()
    vocab = logits.shape[1]
    words = -(-vocab // 32)  # logits columns to cover, including a tail past the mask
    elem = logits.element_size()
    block_w, tiles, warps, *wide = config or kernel_config(n, words, elem)
    progs_per_row = triton.cdiv(words, block_w * tiles)
    grid = (n * progs_per_row,)
    # Packed path: logits rows seen as int32 lanes (needs whole lanes: 4-byte rows and base).
    packed = (vocab * elem) % 4 == 0 and (logits.stride(0) * elem) % 4 == 0
    packed = packed and logits.data_ptr() % 4 == 0
    per_lane = 4 // elem if packed else 1  # logits elements per int32 lane
    _bitmask_kernel[grid](
        logits,
        bitmask,
        row_indices if row_indices is not None else bitmask,
        vocab // per_lane if packed else vocab,
        bitmask.shape[1],
        logits.stride(0) // per_lane if packed else logits.stride(0),
        bitmask.stride(0),
        _lut(logits.device, elem) if packed else bitmask,
        progs_per_row,
        HAS_ROWS=row_indices is not None,
        BLOCK_W=block_w,
        TILES=tiles,
        VEC=16 // elem,
        WIDE_MASK=bool(wide and wide[0]),
        PACKED=packed,
        EVEN_VEC=packed and (vocab * elem) % 16 == 0,
        NINF32=_NINF32[logits.dtype] if packed else 0,
        num_warps=warps,
    )


def apply_token_bitmask_inplace(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | None = None
) -> None:
    """Mask ``logits`` in place: the Triton kernel on CUDA, the reference elsewhere."""
    if logits.is_cuda:
        apply_token_bitmask_inplace_triton(logits, bitmask, row_indices)
    else:
        apply_token_bitmask_inplace_reference(logits, bitmask, row_indices)
