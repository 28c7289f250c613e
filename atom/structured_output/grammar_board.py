"""The memory a rank and its grammar process share: counters, sampled ids and mask rows.

With a grammar process (``grammar_process``) a constrained step is a numbered "gate". The rank
never waits for the child's work: it queues, on its stream, a wait until the child has written
the gate's rows, the copy of those rows and the mask kernel, then the sampling, and publishes the
sampled ids here for the child to commit. Three 64-bit counters say how far each side got:

- ``TOKENS``: the newest gate whose sampled ids are in the ring (written by the stream after the
  ids' copy; by the host on CPU).
- ``DONE``: the newest gate whose rows the child has written (the stream's wait reads it).
- ``COPIED``: the newest gate whose rows the stream has copied to the device, so the child may
  write that area again (gate ``n`` uses area ``n % 2``).

Beside them, ``QUIET`` slots say which gates ended without errors: the child answers those
with no message, and the rank reads their (empty) errors here instead of from the pipe
(``mark_quiet``, ``quiet``). And the rank posts a repeated gate (a batch that keeps decoding)
here instead of on the pipe (``post_repeat``, ``next_repeat``), with the number of pipe
messages sent before it, so that the child takes both in the order they were sent. A steady
batch thus costs the rank no pipe message either way.

The counters only grow. The rank sets ``DONE`` to ``RELEASED`` when the child fails or the rank
shuts down, so a stream never waits for a child that is gone; a gate released that way finds
an area stamped with another gate (``row_index``), whose rows then mask nothing. The mapping is
one file in ``/dev/shm``, page-locked in the rank on CUDA (``pin``), so the stream reads and
writes it directly. The board owns that page lock: it ends with the board even when nobody
shuts the rank down, before the memory is unmapped (a page lock outliving its mapping made the
next board mapped at that address fail to lock).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import weakref
from collections.abc import Callable

import torch

from atom.structured_output.stream_flags import host_register, host_unregister

__all__ = [
    "COPIED",
    "DONE",
    "POSTED",
    "QUIET",
    "RELEASED",
    "RING_SLOTS",
    "TAKEN",
    "TOKENS",
    "GrammarBoard",
    "GrammarBoardTimeout",
    "stamp_of",
]

TOKENS, DONE, COPIED = 0, 1, 2
RELEASED = 1 << 62  # past every gate: a stream waiting on DONE goes on
RING_SLOTS = 4  # gates whose sampled ids the ring keeps; a step reads only the previous gate's
# The first of RING_SLOTS counters after COPIED: slot ``gate % RING_SLOTS`` holds the newest
# gate of that slot that ended without errors (the rank reads a gate's errors before the child
# is two gates further, so a slot is never overwritten while its gate is unread).
QUIET = 3
# Repeated gates posted (a count), then taken by the child (a count), then RING_SLOTS slots of
# (gate, pipe messages sent before it), slot ``count % RING_SLOTS``.
POSTED, TAKEN, REPEATS = 7, 8, 9
_ALIGN = 64  # each section starts on a cache line
_FLAG_BYTES = -(-8 * (REPEATS + 2 * RING_SLOTS) // _ALIGN) * _ALIGN  # the counters
_SPIN_S = 0.002  # a host wait spins (yielding) this long before it sleeps between looks


def stamp_of(gate: int) -> int:
    """The stamp an area holds once ``gate``'s rows are in it: the gate's number as an int32
    entry (it wraps after 2**31 gates; two gates one area apart never share it)."""
    return gate & 0x7FFFFFFF


class GrammarBoardTimeout(TimeoutError):
    """A counter did not reach its value in time."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _layout(max_rows: int, num_words: int) -> tuple[int, int, int]:
    """Bytes of the ring, of an area's row index, and of an area (row index, then mask rows, so
    that one copy takes both); each section starts on a 64-byte boundary after the counters."""
    index = _aligned((max_rows + 1) * 4)  # the logits row of each mask row, then the stamp
    return _aligned(RING_SLOTS * max_rows * 8), index, index + _aligned(max_rows * num_words * 4)


class GrammarBoard:
    """Views of one shared mapping of ``max_rows`` rows of ``num_words`` mask words."""

    def __init__(self, path: str, max_rows: int, num_words: int) -> None:
        self.path, self.max_rows, self.num_words = path, max_rows, num_words
        ring, index_bytes, area = _layout(max_rows, num_words)
        self.nbytes = _FLAG_BYTES + ring + 2 * area
        self.index_words = index_bytes // 4  # int32 entries before an area's first mask row
        raw = self.raw = torch.from_file(path, shared=True, size=self.nbytes, dtype=torch.uint8)
        self._flags = raw[:_FLAG_BYTES].view(torch.int64).numpy()
        ring_ids = raw[_FLAG_BYTES : _FLAG_BYTES + RING_SLOTS * max_rows * 8].view(torch.int64)
        self.ring = ring_ids.view(RING_SLOTS, max_rows)
        self._areas = []
        for k in range(2):
            start = _FLAG_BYTES + ring + k * area
            flat = raw[start : start + index_bytes + max_rows * num_words * 4].view(torch.int32)
            rows = flat[self.index_words :].view(max_rows, num_words)
            self._areas.append((flat, rows, flat[: max_rows + 1]))
        self._unpin: weakref.finalize | None = None

    @classmethod
    def create(cls, max_rows: int, num_words: int) -> GrammarBoard:
        """A new zeroed mapping; its file is unlinked once the other side mapped it
        (``unlink``), the memory lives as long as a mapping does."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="atom-grammar-board-", dir=folder)
        ring, _, area = _layout(max_rows, num_words)
        try:
            os.ftruncate(fd, _FLAG_BYTES + ring + 2 * area)
        finally:
            os.close(fd)
        return cls(path, max_rows, num_words)

    def unlink(self) -> None:
        os.unlink(self.path)

    def pin(self, device: torch.device) -> None:
        """Page-lock the mapping for ``device`` until ``unpin`` or until this board is
        collected: a copy from pageable memory would wait for the stream, and a stream can wait
        on and write only page-locked counters."""
        host_register(device, self.raw.data_ptr(), self.nbytes)
        self._unpin = weakref.finalize(self, _unpin, device, self.raw.data_ptr())

    def unpin(self) -> None:
        """End the page lock (after the device's work so far); idempotent."""
        if self._unpin is not None:
            self._unpin()

    def rows(self, gate: int) -> torch.Tensor:
        """The mask rows of ``gate``'s area: ``[max_rows, num_words]`` int32."""
        return self._areas[gate % 2][1]

    def row_index(self, gate: int) -> torch.Tensor:
        """``[max_rows + 1]`` int32 of ``gate``'s area: the logits row of each mask row, then
        the stamp (``index[max_rows]``, ``stamp_of``): the gate whose rows the area holds,
        written last. A
        gate released without its rows (a failed or dead child) finds another stamp there, and
        its rows are not applied: they would be another step's, whose row index may point at
        an unconstrained neighbour."""
        return self._areas[gate % 2][2]

    def area(self, gate: int, n: int) -> torch.Tensor:
        """``gate``'s area as one int32 run: the row index and stamp (``index_words``
        entries), then the first ``n`` mask rows; what a step copies to the device."""
        return self._areas[gate % 2][0][: self.index_words + n * self.num_words]

    def tokens(self, gate: int) -> torch.Tensor:
        """The ring slot of ``gate``'s sampled ids (int64), in its sampling row order."""
        return self.ring[gate % RING_SLOTS]

    def address(self, flag: int) -> int:
        """The host address of counter ``flag`` (a stream waits on or writes it there)."""
        return self.raw.data_ptr() + 8 * flag

    def get(self, flag: int) -> int:
        return int(self._flags[flag])

    def set(self, flag: int, value: int) -> None:
        """Raise a counter from the host (never lowers it)."""
        if int(self._flags[flag]) < value:
            self._flags[flag] = value

    def mark_quiet(self, gate: int) -> None:
        """The child: ``gate`` ended without errors and gets no answer; before ``DONE``."""
        self._flags[QUIET + gate % RING_SLOTS] = gate

    def quiet(self, gate: int) -> bool:
        """Whether ``gate`` (done: ``DONE`` reached it) ended without errors, so that no answer
        follows it on the pipe."""
        marked = int(self._flags[QUIET + gate % RING_SLOTS])
        if marked > gate:
            raise RuntimeError(f"gate {gate}'s quiet slot was taken by gate {marked} unread")
        return marked == gate

    def post_repeat(self, gate: int, after: int) -> bool:
        """The rank: post ``gate``, a repeat of the last gate, for the child to take once it
        read ``after`` pipe messages; False (nothing posted) while all slots wait for it."""
        flags = self._flags
        posted = int(flags[POSTED])
        if posted - int(flags[TAKEN]) >= RING_SLOTS:
            return False
        slot = REPEATS + 2 * (posted % RING_SLOTS)
        flags[slot], flags[slot + 1] = gate, after
        flags[POSTED] = posted + 1  # last: the slot is written
        return True

    def next_repeat(self) -> tuple[int, int] | None:
        """The child: the oldest posted repeat not taken, as ``(gate, after)``, or None."""
        flags = self._flags
        taken = int(flags[TAKEN])
        if int(flags[POSTED]) <= taken:
            return None
        slot = REPEATS + 2 * (taken % RING_SLOTS)
        return int(flags[slot]), int(flags[slot + 1])

    def take_repeat(self) -> None:
        """The child: the oldest posted repeat is taken; its slot may be posted again."""
        self._flags[TAKEN] += 1

    def wait(
        self,
        flag: int,
        value: int,
        timeout_s: float,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        """Return once counter ``flag`` reached ``value``: spin (yielding the core) for a moment,
        then look every 100 µs; raise ``GrammarBoardTimeout`` after ``timeout_s`` or once
        ``alive()`` is false (the writer is gone)."""
        flags = self._flags
        if flags[flag] >= value:
            return
        start = time.perf_counter()
        while flags[flag] < value:
            waited = time.perf_counter() - start
            if waited > timeout_s or not alive():
                raise GrammarBoardTimeout(f"counter {flag} did not reach {value} in {waited:.3g} s")
            if waited < _SPIN_S:
                os.sched_yield()
            else:
                time.sleep(1e-4)


def _unpin(device: torch.device, address: int) -> None:
    """A board's page lock ends (its finalizer: the mapping is still there). At interpreter
    exit the driver may already be gone, and with it the lock."""
    with contextlib.suppress(RuntimeError):
        host_unregister(device, address)
