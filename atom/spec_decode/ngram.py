"""N-gram prompt lookup: draft the tokens that followed the last earlier occurrence of the
sequence's final n tokens (longest n first), as in prompt-lookup decoding.

Work per call is bounded: each sequence's tokens are copied once, incrementally, into a numpy
buffer (4 bytes a token), and a lookup is one vectorized comparison over the last `window` tokens
plus work proportional to the places where the last token occurs there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from atom.spec_decode.proposer import DraftRequest, Proposal


def find_continuation(
    tokens: np.ndarray, min_n: int, max_n: int, max_drafts: int, skip: int = 0
) -> list[int]:
    """Up to `max_drafts` tokens that followed the most recent earlier occurrence of the longest
    suffix of `tokens` (n from `max_n` down to `min_n`) seen before; [] when none occurs. With
    `skip`, the tokens after the first `skip` that followed it (an occurrence with none after
    those does not count).

    A match is grown one token backward at a time over the places where the previous length
    matched, so only the first step reads the whole array.
    """
    last = len(tokens) - 1
    if max_drafts <= 0 or last < min_n:
        return []
    # Matches of length 1, ending early enough to be followed by `skip` tokens and one more.
    ends = np.flatnonzero(tokens[: max(0, last - skip)] == tokens[last])
    best = ends[-1] if len(ends) and min_n <= 1 else None
    for n in range(2, min(max_n, last) + 1):
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[last - (n - 1)]]
        if not len(ends):
            break
        if n >= min_n:
            best = ends[-1]
    if best is None:
        return []
    return tokens[best + 1 + skip : best + 1 + skip + max_drafts].tolist()


class _History:
    """One sequence's known tokens as a growing numpy buffer (amortized doubling)."""

    def __init__(self) -> None:
        self.buffer = np.empty(1024, dtype=np.int32)
        self.length = 0

    def update(self, token_ids: Sequence[int], num_known: int) -> np.ndarray:
        """Append what was added since the last call; start over when the tokens no longer
        extend what was seen (fewer of them, or a different last one)."""
        n = self.length
        if num_known < n or (n and token_ids[n - 1] != self.buffer[n - 1]):
            n = 0
        if num_known > len(self.buffer):
            grown = np.empty(max(num_known, 2 * len(self.buffer)), dtype=np.int32)
            grown[:n] = self.buffer[:n]
            self.buffer = grown
        self.buffer[n:num_known] = token_ids[n:num_known]
        self.length = num_known
        return self.buffer[:num_known]


class NgramProposer:
    """Prompt-lookup drafts: deterministic, so `Proposal.probs` is None (one-hot drafts).

    min_n, max_n: the n-gram lengths tried, longest first. window: how many final tokens are
    searched (bounds a call's work on long sequences).
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, window: int = 32768) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.window = min_n, max_n, window
        self._histories: dict[int, _History] = {}

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        return Proposal([self.propose_one(r) for r in requests])

    def propose_one(self, request: DraftRequest) -> list[int]:
        history = self._histories.setdefault(request.seq_id, _History())
        tokens = history.update(request.token_ids, request.num_known)[-self.window :]
        if request.in_flight is None:
            return find_continuation(tokens, self.min_n, self.max_n, request.max_drafts)
        # A continuation's first token stands for the unknown last one of the step in flight.
        ahead = np.concatenate([tokens, np.asarray(request.in_flight, dtype=np.int32)])
        return find_continuation(ahead, self.min_n, self.max_n, request.max_drafts, skip=1)

    def release(self, seq_id: int) -> None:
        self._histories.pop(seq_id, None)
