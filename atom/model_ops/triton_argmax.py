"""Greedy argmax over a vocabulary row in two short Triton launches instead of torch's one block.

torch reduces each row of ``logits.argmax(dim=-1)`` in a single thread block, so a row of the
DeepSeek vocabulary (129,280 tokens) costs about 36 µs of device time on the H200 whatever the
batch (benchmarks/results/h200_2026-12-02g/kernels: 3% of a batch-1 decode step), though it
reads 260 KB. Here every row is cut into chunks of ``CHUNK`` tokens reduced by programs of their
own (one 16-byte load per thread), and a second launch picks, per row, the first chunk holding
the row's maximum.

Same answer as ``torch.argmax``: the first index of the maximum; NaN counts as larger than
everything, so a row with a NaN gives its first NaN; a row of ``-inf`` gives 0. Values are
compared as order-preserving int32 keys of their float32 value (exact for 16-bit inputs).
Launch shapes depend only on tensor shapes (CUDA-graph safe). Only CUDA tensors come here
(``sampler.argmax_rows``), so CPU runs never import triton; ``TRITON_INTERPRET=1`` runs the
kernels on CPU tensors.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use torch.argmax (``sampler.argmax_rows``)
    triton = None
    tl = None

__all__ = ["argmax_rows_triton"]

CHUNK = 4096  # tokens per program of the first pass: 32 programs per row of 129,280


if triton is not None:

    @triton.jit
    def _key(x):
        # float32 -> int32 in the same order; every NaN above +inf.
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return tl.where(x != x, 0x7FFFFFFF, key)

    @triton.jit
    def _chunk_max_kernel(
        x_ptr, keys_ptr, index_ptr, vocab, stride_row, chunks, BLOCK: tl.constexpr
    ):  # fmt: skip
        # Grid: (row, chunk). The chunk's largest key and its first index, at [row, chunk].
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_row + cols, mask=cols < vocab).to(tl.float32)
        key = tl.where(cols < vocab, _key(x), -0x7FFFFFFF - 1)
        best, at = tl.max(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(keys_ptr + row * chunks + chunk, best)
        tl.store(index_ptr + row * chunks + chunk, chunk * BLOCK + at)

    @triton.jit
    def _pick_kernel(keys_ptr, index_ptr, out_ptr, chunks, CHUNKS_PAD: tl.constexpr):
        # Grid: (row,). The first chunk with the row's largest key holds the first maximum.
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, CHUNKS_PAD)
        keys = tl.load(keys_ptr + row * chunks + c, mask=c < chunks, other=-0x7FFFFFFF - 1)
        _, first = tl.max(keys, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row, tl.load(index_ptr + row * chunks + first).to(tl.int64))


def argmax_rows_triton(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] logits (float32, bfloat16 or float16; rows contiguous) -> [N] int64 argmax of
    each row, as ``logits.argmax(dim=-1)`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be [N, V] with contiguous rows")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax of an empty row")
    chunks = triton.cdiv(vocab, CHUNK)
    keys = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    index = torch.empty_like(keys)
    warps = 8 if logits.element_size() == 2 else 16  # one 16-byte load per thread
    _chunk_max_kernel[(rows, chunks)](
        logits, keys, index, vocab, logits.stride(0), chunks, CHUNK, num_warps=warps
    )
    _pick_kernel[(rows,)](keys, index, out, chunks, triton.next_power_of_2(chunks), num_warps=1)
    return out
