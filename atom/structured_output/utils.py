"""Packed mask buffers, H2D kernel dispatch and owned asynchronous token D2H snapshots.

Only constrained batches touch this module; nothing is allocated until a mask is first needed.
On CUDA the host side is pinned so copies are truly asynchronous, and CUDA events order reuse:

- host rows are rewritten only after the previous H2D copy has read them (``copy_done``);
- the device rows are overwritten only after the previous kernel has read them (``kernel_done``),
  waited on by the *current* stream, so a runner that changes streams stays correct.

On CPU the same API works on plain tensors and masks with the reference implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MaskBuffers", "TokenSnapshot", "num_mask_words"]


def num_mask_words(vocab_size: int) -> int:
    """Packed 32-bit words for one mask row."""
    return (vocab_size + 31) // 32


class MaskBuffers:
    """Reusable ``[rows, words]`` int32 masks (host, plus a device copy on CUDA), grown on demand.

    Per step: ``rows = buffers.host_rows(n)``; fill ``rows`` (llguidance); then
    ``buffers.apply(logits, n, row_indices)``. ``row_indices`` are CPU mirrors (a list), never a
    GPU tensor read back with ``tolist()``.
    """

    def __init__(
        self, vocab_size: int, device: torch.device | str = "cpu", host: torch.Tensor | None = None
    ) -> None:
        """``host``: fixed host rows filled elsewhere (a grammar process maps them too; on CUDA
        already page-locked) instead of rows allocated here and grown on demand."""
        self.vocab_size = vocab_size
        self.num_words = num_mask_words(vocab_size)
        self.device = torch.device(device)
        self._capacity = 0
        self._host: torch.Tensor | None = None
        self._view: torch.Tensor | None = None  # the last ``host_rows`` view
        self._view_rows = 0
        self._host_rows_idx: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._dev_rows_idx: torch.Tensor | None = None
        self._copy_done: Any = None  # torch.cuda.Event: the last H2D copy finished reading host
        self._kernel_done: Any = None  # torch.cuda.Event: the last kernel finished reading device
        self._fixed = host is not None
        if host is not None:
            if host.dtype is not torch.int32 or host.dim() != 2 or host.shape[1] != self.num_words:
                raise ValueError(f"host rows must be int32 [rows, {self.num_words}]")
            self._allocate(host.shape[0], host)

    @property
    def capacity(self) -> int:
        """Rows allocated so far (0 until the first ``host_rows``: nothing is allocated early)."""
        return self._capacity

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def host_rows(self, n: int) -> torch.Tensor:
        """Host rows ``[n, words]`` that are safe to overwrite now (waits for an unfinished copy)."""
        self.wait_host_free()
        if n > self._capacity:
            self._grow(n)
        assert self._host is not None
        if self._view is None or self._view_rows != n:
            # Reused while n is unchanged: no per-step slicing, and ``fill_masks`` recognizes it.
            self._view, self._view_rows = self._host[:n], n
        return self._view

    def wait_host_free(self) -> None:
        """Return once the host rows may be overwritten (the last H2D copy has read them)."""
        if self._copy_done is not None:
            self._copy_done.synchronize()

    def _grow(self, n: int) -> None:
        """Reallocate with headroom; the old device buffer is dropped only after its last kernel."""
        if self._fixed:
            raise IndexError(f"{n} mask rows exceed the {self._capacity} fixed host rows")
        capacity = max(n, 2 * self._capacity, 8)
        if self._kernel_done is not None:
            self._kernel_done.synchronize()
        self._allocate(capacity)

    def _allocate(self, capacity: int, host: torch.Tensor | None = None) -> None:
        pin = self.on_cuda
        if host is None:
            host = torch.empty((capacity, self.num_words), dtype=torch.int32, pin_memory=pin)
        self._host = host
        self._view = None
        self._host_rows_idx = torch.empty(capacity, dtype=torch.int32, pin_memory=pin)
        if self.on_cuda:
            self._dev = torch.empty(
                (capacity, self.num_words), dtype=torch.int32, device=self.device
            )
            self._dev_rows_idx = torch.empty(capacity, dtype=torch.int32, device=self.device)
        self._capacity = capacity

    def apply(self, logits: torch.Tensor, n: int, row_indices: Sequence[int] | None = None) -> None:
        """Mask ``logits`` with the first ``n`` host rows; ``row_indices[i]`` is row i's target."""
        from atom.model_ops.triton_structured_output import apply_token_bitmask_inplace

        if n == 0:
            return
        if n > self._capacity or (row_indices is not None and len(row_indices) != n):
            raise ValueError("fill host_rows(n) first and give one row index per mask row")
        assert self._host is not None and self._host_rows_idx is not None
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the row-index host buffer may still be in flight
        host_idx = None
        if row_indices is not None:
            host_idx = self._host_rows_idx[:n]
            host_idx.copy_(torch.as_tensor(row_indices, dtype=torch.int32))
        if not self.on_cuda:
            apply_token_bitmask_inplace(logits, self._host[:n], host_idx)
            return
        assert self._dev is not None and self._dev_rows_idx is not None
        stream = torch.cuda.current_stream(self.device)
        if self._kernel_done is not None:
            stream.wait_event(self._kernel_done)  # the previous kernel may run on another stream
        dev = self._dev[:n]
        dev.copy_(self._host[:n], non_blocking=True)
        dev_idx = None
        if host_idx is not None:
            dev_idx = self._dev_rows_idx[:n]
            dev_idx.copy_(host_idx, non_blocking=True)
        self._copy_done = torch.cuda.Event()
        self._copy_done.record(stream)
        apply_token_bitmask_inplace(logits, dev, dev_idx)
        self._kernel_done = torch.cuda.Event()
        self._kernel_done.record(stream)


class TokenSnapshot:
    """An owned copy of device token ids, copied to pinned host memory on a side stream.

    The ids are first cloned on the producing stream, so the caller may reuse or reorder its input
    buffers immediately; ``wait()`` blocks only on this snapshot's own copy event.
    """

    _copy_streams: dict[torch.device, Any] = {}

    def __init__(self, tokens: torch.Tensor) -> None:
        if not tokens.is_cuda:
            self._host = tokens.detach().to("cpu", copy=True)
            self._event = None
            return
        producer = torch.cuda.current_stream(tokens.device)
        owned = tokens.detach().clone()  # ordered after the producer's writes, owned by us
        side = self._copy_streams.get(tokens.device)
        if side is None:
            side = self._copy_streams[tokens.device] = torch.cuda.Stream(tokens.device)
        side.wait_stream(producer)
        self._host = torch.empty(owned.shape, dtype=owned.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            self._host.copy_(owned, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(side)
        owned.record_stream(side)  # keep the device clone alive until the side stream used it

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> torch.Tensor:
        """The host tensor, once its copy has finished."""
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def tolist(self) -> list[int]:
        return self.wait().tolist()
