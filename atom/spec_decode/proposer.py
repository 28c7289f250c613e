"""What the engine asks of a draft proposer (n-gram lookup now, a draft model later)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DraftRequest:
    """One sequence to draft for. `token_ids` is its prompt and output so far, append-only per
    `seq_id`; only its first `num_known` entries are real tokens (the engine's token list may
    end in placeholders of unread steps), and at most `max_drafts` drafts are wanted."""

    seq_id: int
    token_ids: Sequence[int]
    num_known: int
    max_drafts: int
    # Where a draft model writes its K/V (the sequence's blocks, sized by the engine for the
    # positions drafted), and how many times the sequence was preempted (its draft K/V is gone).
    block_table: Sequence[int] = ()
    generation: int = 0
    # Asynchronous scheduling (n-gram only): a step of this sequence is in flight, verifying
    # these drafts after its known tokens, and its last emitted token is not known yet. The
    # drafts wanted are for the step after it, proposed as if it accepted them all.
    in_flight: Sequence[int] | None = None


@dataclass
class Proposal:
    """Drafts per request (0..max_drafts each), and for a draft model the distributions they
    were sampled from, [total drafts, V] in draft order, as `rejection_sample` takes them; None
    for a deterministic proposer (verified as one-hot)."""

    token_ids: list[list[int]]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """Drafts for a batch of sequences."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's state."""
        ...
