"""Page-locked memory a runner's step inputs are staged in, allocated once and reused.

A copy to the device is asynchronous only from page-locked host memory. Page-locking each
step's arrays afresh (`Tensor.pin_memory`) goes through PyTorch's caching host allocator on
every call, which on the H200's host cost the engine thread 20-50 µs a call
(`benchmarks/results/h200_2026-12-05d`). Instead each step copies its arrays into one of a few
slots of page-locked buffers, taken in turn. A slot is written again only once the stream has
passed an event recorded after the step that last used it had queued all its copies, so a copy
still queued never reads a later step's data.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PinnedStaging"]


class _Slot:
    """One step's page-locked buffers (one a dtype, grown on demand) and the event after which
    the stream is done with them."""

    def __init__(self) -> None:
        self.buffers: dict[np.dtype, torch.Tensor] = {}
        self.taken: set[np.dtype] = set()  # dtypes whose buffer this step holds
        self.event: torch.cuda.Event | None = None


class PinnedStaging:
    """Page-locked staging for one runner's steps (CUDA only): `begin_step` once a step, before
    its arrays, then `pinned` for each array. A step's first array of each dtype goes to its
    slot's buffer (the step inputs have one int64 and one int32 array); any other is page-locked
    afresh."""

    def __init__(self, num_slots: int = 4) -> None:
        self._slots = [_Slot() for _ in range(num_slots)]
        self._next = 0
        self._current = self._slots[-1]

    def begin_step(self) -> None:
        """The previous step has queued every copy from its slot: mark that point on the
        stream, and take the next slot once the stream has passed its own mark."""
        if self._current.taken:
            self._current.event = torch.cuda.Event()
            self._current.event.record()
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.event is not None:
            slot.event.synchronize()  # the copies of `num_slots` steps ago: long done
            slot.event = None
        slot.taken = set()
        self._current = slot

    def pinned(self, array: np.ndarray) -> torch.Tensor:
        """`array` copied into page-locked memory of the current step."""
        slot, dtype = self._current, array.dtype
        if dtype in slot.taken:
            return torch.from_numpy(array).pin_memory()
        slot.taken.add(dtype)
        buffer = slot.buffers.get(dtype)
        if buffer is None or buffer.numel() < array.size:
            size = max(array.size, 2 * buffer.numel() if buffer is not None else 0)
            buffer = torch.from_numpy(np.empty(size, dtype=dtype)).pin_memory()
            slot.buffers[dtype] = buffer
        view = buffer[: array.size]
        np.copyto(view.numpy(), array.reshape(-1))
        return view.view(array.shape)
