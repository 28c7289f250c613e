"""Packed-bitmask logit masking: a Triton kernel for CUDA and a CPU reference with the same meaning.

Semantics (shared by both paths, matching llguidance's bitmask layout):

- ``bitmask`` is int32 ``[R, W]``; bit ``j`` of word ``w`` (little-endian) is token ``32 * w + j``;
  a set bit means *allowed*.
- Without ``row_indices``, mask row ``i`` applies to logits row ``i`` for ``i < B``.
  With ``row_indices`` (``N`` ints), mask row ``i`` applies to logits row ``row_indices[i]``; the
  mask buffer can therefore be compact (one row per constrained target/bonus row).
- Forbidden logits become ``-inf``; allowed logits are never read or written.
- Logit columns at or past ``32 * W`` (an LM head wider than the grammar vocabulary) are forbidden.

The kernel never expands a vocabulary-sized Boolean tensor and never gathers complete logit rows.
It walks each row in steps of a few packed words: a step holding only all-zero/all-one words
writes ``-inf`` with full-width vector stores (all-ones words issue no memory traffic, no bit
work); a step with mixed words reads those words' logits and writes them back whole, so every
access is a full vectorized word rather than a partial-sector write.

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


def kernel_config(n_rows: int, n_words: int) -> tuple[int, int, int]:
    """(words per step, steps per program, warps), from the H200 sweep in
    ``benchmarks/bench_bitmask_kernel.py --sweep``: 32-word steps, 4 per program (skipping uniform
    steps pays most when a program covers several), fewer steps when that would leave SMs idle."""
    sub_w, steps, warps = 32, 4, 2
    while steps > 1 and n_rows * -(-n_words // (sub_w * steps)) < 8 * 132:
        steps //= 2
    return sub_w, steps, warps


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
        HAS_ROWS: tl.constexpr,
        SUB_W: tl.constexpr,
        STEPS: tl.constexpr,
    ):
        i = tl.program_id(0)
        chunk = tl.program_id(1)
        if HAS_ROWS:
            row = tl.load(rows_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        lanes = tl.arange(0, 32)
        neg_inf = tl.full([SUB_W, 32], float("-inf"), logits_ptr.dtype.element_ty)
        for step in range(STEPS):
            w = (chunk * STEPS + step) * SUB_W + tl.arange(0, SUB_W)
            # Words past the mask read as 0: the LM-head tail beyond the grammar vocab is forbidden.
            words = tl.load(
                bitmask_ptr + i.to(tl.int64) * bitmask_stride + w, mask=w < n_words, other=0
            )
            cols = w[:, None] * 32 + lanes[None, :]
            in_vocab = cols < vocab
            out = logits_ptr + row * logits_stride + cols
            mixed = (words != 0) & (words != -1)
            if tl.sum(mixed.to(tl.int32)) > 0:
                # Mixed words are read and written whole, so every access is a full vectorized
                # word (no partial-sector writes); all-zero words are written without a read.
                bit_set = ((words[:, None] >> lanes[None, :]) & 1) != 0
                old = tl.load(out, mask=mixed[:, None] & in_vocab, other=0.0)
                full = (words == -1)[:, None]
                tl.store(out, tl.where(bit_set, old, neg_inf), mask=(~full) & in_vocab)
            else:
                # Only all-zero / all-one words: no bit work; all-ones issue no memory traffic.
                tl.store(out, neg_inf, mask=(words == 0)[:, None] & in_vocab)


def apply_token_bitmask_inplace_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    row_indices: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int] | None = None,
) -> None:
    """Launch the Triton kernel (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

    ``config`` overrides ``kernel_config`` (words per step, steps per program, warps).
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
    sub_w, steps, warps = config or kernel_config(n, words)
    grid = (n, triton.cdiv(words, sub_w * steps))
    _bitmask_kernel[grid](
        logits,
        bitmask,
        row_indices if row_indices is not None else bitmask,
        vocab,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        HAS_ROWS=row_indices is not None,
        SUB_W=sub_w,
        STEPS=steps,
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
