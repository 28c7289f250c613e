"""Packed-bitmask logit masking: a Triton kernel for CUDA and a CPU reference with the same meaning.

Semantics (shared by both paths, matching llguidance's bitmask layout):

- ``bitmask`` is int32 ``[R, W]``; bit ``j`` of word ``w`` (little-endian) is token ``32 * w + j``;
  a set bit means *allowed*.
- Without ``row_indices``, mask row ``i`` applies to logits row ``i`` for ``i < B``.
  With ``row_indices`` (``N`` ints), mask row ``i`` applies to logits row ``row_indices[i]``; the
  mask buffer can therefore be compact (one row per constrained target/bonus row).
- Forbidden logits become ``-inf``; allowed logits keep their values.
- Logit columns at or past ``32 * W`` (an LM head wider than the grammar vocabulary) are forbidden.
- With ``stamp`` (a one-element int32 tensor and an expected value) the rows apply only if the
  tensor holds that value when the kernel runs; otherwise no logit changes. A grammar process's
  rows carry such a stamp (``structured_output.grammar_board``), checked here on the device
  instead of in two more launches.

The kernel never expands a vocabulary-sized Boolean tensor and never gathers complete logit rows.
Each program takes tiles of mask words of one row and picks, per tile, one of two paths:

- Sparse: when every word of the tile forbids at most ``sparse_k`` tokens (a nearly free
  position in the grammar), each forbidden token gets one scalar store of ``-inf``, found by
  clearing the word's lowest set bit; allowed logits are neither read nor written.
- Dense: the tile's logits are viewed as 16-byte vectors (8 bf16/fp16 or 4 fp32 tokens, one
  byte or nibble of a mask word each), handled by predication with no loop over bits: a vector
  whose bits are all set issues no memory access; one with no bit set is overwritten with
  ``-inf`` by a full 16-byte store without being read; a mixed one is loaded, selected and stored
  back whole, so no access is narrower than 16 bytes. When rows are whole 4-byte lanes (always
  for fp32; even vocab and stride for 16-bit types) the select is done on int32 lanes with a
  per-device 16-byte keep-mask table indexed by the vector's mask bits (one L1-resident load and
  bitwise ops instead of a select per element); otherwise per element.

The choice is one reduction per tile, so it costs a branch per program, not per token. Compiled
kernels are cached by their specialization and launched directly, which keeps the host cost
of a call low (Triton's argument binding is skipped).

Triton is imported here, but only this module does so and nothing on the ordinary (unconstrained)
path imports it; set ``TRITON_INTERPRET=1`` before the first import to run the kernel on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # CPU-only installs use the reference path
    triton = None
    tl = None

__all__ = [
    "apply_token_bitmask_inplace",
    "apply_token_bitmask_inplace_reference",
    "apply_token_bitmask_inplace_triton",
    "KernelConfig",
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


# An optional condition on a launch: (a one-element int32 tensor, the value it must hold).
Stamp = tuple[torch.Tensor, int]


def apply_token_bitmask_inplace_reference(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    row_indices: torch.Tensor | None = None,
    stamp: Stamp | None = None,
) -> None:
    """CPU reference (and the CPU execution path): one row at a time, bits unpacked per row."""
    n = _check(logits, bitmask, row_indices)
    if stamp is not None and int(stamp[0].item()) != stamp[1]:
        return
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


class KernelConfig(NamedTuple):
    """Launch shape. A program masks ``tiles`` consecutive tiles of ``block_w * sub`` mask words
    of one row; ``sparse_k`` > 0 lets a tile whose words each forbid at most that many tokens
    take the sparse path (one scattered store per forbidden token instead of a pass over every
    16-byte logits vector); ``wide`` loads each dense sub-tile's words with one contiguous load;
    ``eager`` loads logits beside the mask instead of after it (shorter latency, more bytes read);
    ``max_regs`` caps registers per thread (0: the compiler's choice)."""

    block_w: int
    sub: int = 1
    tiles: int = 1
    warps: int = 4
    wide: bool = False
    sparse_k: int = 0
    eager: bool = False
    max_regs: int = 0


# Up to this many logits bytes a launch is latency-bound (batch 8 at 129,280 tokens).
_SMALL_BYTES = 9 << 19


def kernel_config(n_rows: int, n_words: int, elem_size: int = 2) -> KernelConfig:
    """The configuration for a launch, from the H200 sweeps in
    ``benchmarks/bench_bitmask_kernel.py --sweep`` (no run-time autotuning). Small launches
    load logits eagerly in dense tiles of 64 (16-bit) or 32 (fp32) words. Larger ones check
    128-word tiles for the sparse path (16-bit: two 64-word dense sub-tiles; fp32: four 32-word
    ones). The tile shrinks while the grid would leave SMs idle: first fewer tiles per program,
    then fewer sub-tiles, then narrower sub-tiles."""
    wide = elem_size <= 2
    small = n_rows * n_words * 32 * elem_size <= _SMALL_BYTES
    if small:
        cfg = KernelConfig(64 if wide else 32, wide=wide, eager=True)
    elif wide:
        cfg = KernelConfig(64, sub=2, wide=True, sparse_k=3)
    else:
        cfg = KernelConfig(32, sub=4, sparse_k=3, max_regs=56)

    def programs(c: KernelConfig) -> int:
        return n_rows * -(-n_words // (c.block_w * c.sub * c.tiles))

    while programs(cfg) < 2 * _SMS:
        if cfg.tiles > 1:
            cfg = cfg._replace(tiles=cfg.tiles // 2)
        elif cfg.sub > 1:
            cfg = cfg._replace(sub=cfg.sub // 2)
        elif cfg.block_w > 32:
            cfg = cfg._replace(block_w=cfg.block_w // 2)
        else:
            break
    return cfg


if triton is not None:

    @triton.jit
    def _dense_tile(
        lrow,
        mrow,
        lut_ptr,
        vocab,
        n_words,
        t,
        BLOCK_W: tl.constexpr,
        VEC: tl.constexpr,
        WIDE_MASK: tl.constexpr,
        PACKED: tl.constexpr,
        EVEN_VEC: tl.constexpr,
        NINF32: tl.constexpr,
        EAGER: tl.constexpr,
    ):
        # Tile ``t`` of BLOCK_W words, held as [BLOCK_W * 32 / VEC, VEC]: one 16-byte logits
        # vector per row, whose VEC mask bits are one byte (bf16/fp16) or nibble (fp32) of its
        # word. Per vector: all bits set -> no access; no bit set -> a store of -inf, no load;
        # mixed -> load, select, store the whole vector (never an access under 16 bytes).
        G: tl.constexpr = 32 // VEC
        NV: tl.constexpr = BLOCK_W * G
        FULL: tl.constexpr = (1 << VEC) - 1
        v = tl.arange(0, NV)
        shift = (v % G) * VEC
        # Words past the mask read as 0: the LM-head tail beyond the grammar vocab is forbidden.
        if WIDE_MASK:  # one contiguous (16-byte per thread) load, spread to vectors on chip
            w = t * BLOCK_W + tl.arange(0, BLOCK_W)
            words = tl.load(mrow + w, mask=w < n_words, other=0)
            wv = tl.reshape(tl.broadcast_to(words[:, None], (BLOCK_W, G)), (NV,))
        else:  # each vector loads its own word (G neighbours share one address)
            w = t * BLOCK_W + v // G
            wv = tl.load(mrow + w, mask=w < n_words, other=0)
        bits = (wv >> shift) & FULL
        mixed = (bits != FULL) & (bits != 0)
        if PACKED:
            # The vector as 4 int32 lanes; the LUT row for its mask bits holds, per lane,
            # all-ones over allowed elements: new = (old & m) | (-inf & ~m): one L1-resident
            # LUT load and 4 bitwise ops instead of a select per element.
            E: tl.constexpr = VEC // 4  # elements per int32 lane
            j = tl.arange(0, 4)
            start = t * (BLOCK_W * 32 // E) + v * 4  # int32 lane of each vector's start
            cols = start[:, None] + j[None, :]
            if EVEN_VEC:  # vocab is whole vectors: one compare per vector
                in_vocab = (start < vocab)[:, None]
            else:
                in_vocab = cols < vocab
            ptrs = lrow + cols
            if EAGER:  # latency first (small batches): logits load beside the mask, no LUT
                old = tl.load(ptrs, mask=in_vocab)
                sel = bits[:, None] >> (j[None, :] * E)
                if E == 2:
                    m = ((sel & 1) * 0xFFFF) | ((sel & 2) * -32768)  # -32768 * 2 = 0xFFFF0000
                else:
                    m = -(sel & 1)
            else:
                m = tl.load(lut_ptr + bits[:, None] * 4 + j[None, :], mask=mixed[:, None], other=0)
                old = tl.load(ptrs, mask=mixed[:, None] & in_vocab)  # unread lanes: m == 0
            new = (old & m) | (NINF32 & ~m)
        else:
            lanes = tl.arange(0, VEC)
            cols = (t * (BLOCK_W * 32) + v * VEC)[:, None] + lanes[None, :]
            in_vocab = cols < vocab
            ptrs = lrow + cols
            old_mask = in_vocab if EAGER else mixed[:, None] & in_vocab
            old = tl.load(ptrs, mask=old_mask, other=float("-inf"))
            keep = ((bits[:, None] >> lanes[None, :]) & 1) != 0
            new = tl.where(keep, old, float("-inf")).to(lrow.dtype.element_ty)
        tl.store(ptrs, new, mask=(bits != FULL)[:, None] & in_vocab)

    @triton.jit
    def _sparse_tile(erow, x, w, vocab_e, rounds, K: tl.constexpr):
        # ``x`` holds each word's forbidden bits, at most ``rounds`` <= K per word (the caller's
        # one reduction): clear them one lowest set bit per round with a scalar store each.
        tok0 = w * 32
        ninf = tl.full(x.shape, float("-inf"), erow.dtype.element_ty)
        for j in tl.static_range(K):
            if j < rounds:
                low = x & -x
                # log2 of a power of two: the exponent of its exact float32 value.
                f = low.to(tl.uint32, bitcast=True).to(tl.float32)
                tok = tok0 + (f.to(tl.int32, bitcast=True) >> 23) - 127
                tl.store(erow + tok, ninf, mask=(x != 0) & (tok < vocab_e))
                x = x ^ low

    @triton.jit(do_not_specialize=["expected"])  # a new value each gate: never a constant
    def _bitmask_kernel(
        logits_ptr,
        bitmask_ptr,
        rows_ptr,
        vocab,
        n_words,
        logits_stride,
        bitmask_stride,
        lut_ptr,
        stamp_ptr,
        expected,
        PROGS_PER_ROW: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        BLOCK_W: tl.constexpr,
        SUB: tl.constexpr,
        TILES: tl.constexpr,
        VEC: tl.constexpr,
        WIDE_MASK: tl.constexpr,
        PACKED: tl.constexpr,
        EVEN_VEC: tl.constexpr,
        NINF32: tl.constexpr,
        SPARSE_K: tl.constexpr,
        EAGER: tl.constexpr,
        HAS_STAMP: tl.constexpr,
    ):
        # 1-D grid, tile-major within a row: neighbouring programs stream neighbouring memory.
        # With SPARSE_K, each tile first checks (one reduction) whether every word forbids at
        # most SPARSE_K tokens; such a tile is cleared token by token, any other one vector by
        # vector, in SUB dense sub-tiles of BLOCK_W words (the same registers as one).
        # PROGS_PER_ROW is a constant so that this division is a multiply, not ~30 instructions
        # (a large share of a sparse tile's work).
        pid = tl.program_id(0)
        if HAS_STAMP:  # a stale stamp empties the row (no word, no column): nothing is stored
            live = tl.load(stamp_ptr) == expected
            vocab = tl.where(live, vocab, 0)
            n_words = tl.where(live, n_words, 0)
        i = pid // PROGS_PER_ROW
        t0 = (pid % PROGS_PER_ROW) * TILES
        if HAS_ROWS:
            row = tl.load(rows_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        E: tl.constexpr = VEC // 4  # logits elements per int32 lane
        if PACKED:  # vocab and logits_stride are in int32 lanes
            lrow = logits_ptr.to(tl.pointer_type(tl.int32)) + row * logits_stride
            erow = logits_ptr + row * (logits_stride * E)
            vocab_e = vocab * E
        else:
            lrow = logits_ptr + row * logits_stride
            erow = lrow
            vocab_e = vocab
        mrow = bitmask_ptr + i.to(tl.int64) * bitmask_stride
        TILE_W: tl.constexpr = BLOCK_W * SUB
        for k in range(TILES):
            t = t0 + k
            if SPARSE_K > 0:
                w = t * TILE_W + tl.arange(0, TILE_W)
                words = tl.load(mrow + w, mask=w < n_words, other=0)
                x = tl.where(w < (vocab_e + 31) // 32, ~words, 0)  # past the row: nothing
                # Per word min(forbidden tokens, SPARSE_K + 1); its tile maximum picks the path.
                rest = x
                level = (rest != 0).to(tl.int32)
                for _ in tl.static_range(SPARSE_K):
                    rest = rest & (rest - 1)
                    level += (rest != 0).to(tl.int32)
                rounds = tl.max(level, axis=0)
                if rounds <= SPARSE_K:
                    _sparse_tile(erow, x, w, vocab_e, rounds, SPARSE_K)
                else:
                    for s in range(SUB):
                        _dense_tile(
                            lrow, mrow, lut_ptr, vocab, n_words, t * SUB + s,
                            BLOCK_W, VEC, WIDE_MASK, PACKED, EVEN_VEC, NINF32, EAGER,
                        )  # fmt: skip
            else:
                for s in range(SUB):
                    _dense_tile(
                        lrow, mrow, lut_ptr, vocab, n_words, t * SUB + s,
                        BLOCK_W, VEC, WIDE_MASK, PACKED, EVEN_VEC, NINF32, EAGER,
                    )  # fmt: skip


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


# Launchers by everything a launch depends on; a hit skips Triton's argument binding and
# cache lookup, tens of µs of host time per call on a slow host.
_LAUNCHES: dict[tuple, Callable[..., None]] = {}


def apply_token_bitmask_inplace_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    row_indices: torch.Tensor | None = None,
    stamp: Stamp | None = None,
    *,
    config: KernelConfig | None = None,
) -> None:
    """Launch the Triton kernel (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``);
    ``config`` overrides ``kernel_config``."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    n = _check(logits, bitmask, row_indices)
    if n == 0:
        return
    if row_indices is not None and not row_indices.is_contiguous():
        row_indices = row_indices.contiguous()
    rows = row_indices if row_indices is not None else bitmask
    stamp_at, expected = stamp if stamp is not None else (bitmask, 0)
    key = (
        n,
        logits.shape,
        logits.stride(),
        logits.dtype,
        logits.device,
        bitmask.shape[1],
        bitmask.stride(),
        row_indices is not None,
        config,
        logits.data_ptr() % 16,  # Triton specializes on 16-byte alignment; packing needs 4
        bitmask.data_ptr() % 16 == 0,
        rows.data_ptr() % 16 == 0,
        stamp is not None,
        stamp_at.data_ptr() % 16 == 0,
    )
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _first_launch(logits, bitmask, row_indices, stamp, n, config)
        if len(_LAUNCHES) >= 256:
            _LAUNCHES.clear()
        _LAUNCHES[key] = launch
    else:
        launch(logits, bitmask, rows, stamp_at, expected)


def _first_launch(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    row_indices: torch.Tensor | None,
    stamp: Stamp | None,
    n: int,
    config: KernelConfig | None,
) -> Callable[..., None]:
    """Work out the launch, run it once (compiling if needed), return a launcher for repeats."""
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    vocab = logits.shape[1]
    words = -(-vocab // 32)  # logits columns to cover, including a tail past the mask
    elem = logits.element_size()
    cfg = KernelConfig(*config) if config is not None else kernel_config(n, words, elem)
    progs_per_row = triton.cdiv(words, cfg.block_w * cfg.sub * cfg.tiles)
    # Packed path: logits rows seen as int32 lanes (needs whole lanes: 4-byte rows and base).
    packed = (vocab * elem) % 4 == 0 and (logits.stride(0) * elem) % 4 == 0
    packed = packed and logits.data_ptr() % 4 == 0
    per_lane = 4 // elem if packed else 1  # logits elements per int32 lane
    lut = _lut(logits.device, elem) if packed else None  # unused otherwise: any pointer
    head = (vocab // per_lane, bitmask.shape[1], logits.stride(0) // per_lane, bitmask.stride(0))
    consts = (  # the constexprs in signature order
        progs_per_row,
        row_indices is not None,
        cfg.block_w,
        cfg.sub,
        cfg.tiles,
        16 // elem,
        bool(cfg.wide),
        packed,
        packed and (vocab * elem) % 16 == 0,
        _NINF32[logits.dtype] if packed else 0,
        cfg.sparse_k,
        bool(cfg.eager),
        stamp is not None,
    )
    grid = n * progs_per_row

    def args(lg: torch.Tensor, bm: torch.Tensor, rows: torch.Tensor, at: torch.Tensor, value: int):
        return (lg, bm, rows, *head, bm if lut is None else lut, at, value, *consts)

    rows = row_indices if row_indices is not None else bitmask
    stamp_at, expected = stamp if stamp is not None else (bitmask, 0)
    options = {"num_warps": cfg.warps} | ({"maxnreg": cfg.max_regs} if cfg.max_regs else {})
    compiled = _bitmask_kernel[(grid,)](*args(logits, bitmask, rows, stamp_at, expected), **options)
    if isinstance(_bitmask_kernel, InterpretedFunction):
        return lambda *a: _bitmask_kernel[(grid,)](*args(*a))
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    current_stream = triton.runtime.driver.active.get_current_stream
    device = logits.device.index

    def launch(
        lg: torch.Tensor, bm: torch.Tensor, rows: torch.Tensor, at: torch.Tensor, value: int
    ) -> None:
        # Triton's launcher: grid, stream, kernel, metadata, no launch hooks, the arguments.
        run(
            grid,
            1,
            1,
            current_stream(device),
            function,
            metadata,
            None,
            None,
            None,
            *args(lg, bm, rows, at, value),
        )

    return launch


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    row_indices: torch.Tensor | None = None,
    stamp: Stamp | None = None,
) -> None:
    """Mask ``logits`` in place: the Triton kernel on CUDA, the reference elsewhere."""
    if logits.is_cuda:
        apply_token_bitmask_inplace_triton(logits, bitmask, row_indices, stamp)
    else:
        apply_token_bitmask_inplace_reference(logits, bitmask, row_indices, stamp)
