"""One step's mask rows, filled where a rank's grammar states live: the rank's own process
(``worker``) or its grammar process (``grammar_process``), with the same code."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from atom.structured_output.manager import GrammarState, StructuredOutputManager

__all__ = ["GrammarRows", "RowJob", "fill_rows"]


@dataclass
class GrammarRows:
    """One step's filled host mask rows: how many, the logits row each masks, and the errors by
    sequence id of the constrained requests that get no row (or failed filling theirs)."""

    num_rows: int
    logits_rows: list[int]
    errors: dict[int, str]


# One constrained sampling row group of a step: (sequence id, request id, its drafts, its first
# logits row); the request's rows are that one and one per draft after it.
RowJob = tuple[int, str, list[int], int]


def fill_rows(
    manager: StructuredOutputManager | None,
    host_rows: Callable[[int], torch.Tensor],
    jobs: list[RowJob],
) -> GrammarRows:
    """The mask rows of ``jobs`` filled into ``host_rows(n)``, and the errors of the requests
    that have no state (or a failed one) here, or failed while their rows were filled. Runs where
    the states live."""
    errors: dict[int, str] = {}
    live: list[tuple[str, list[int]]] = []
    live_states: list[tuple[int, GrammarState]] = []
    logits_rows: list[int] = []
    for seq_id, request_id, drafts, first in jobs:
        state = manager.state(request_id) if manager is not None else None
        if state is None:
            errors[seq_id] = "structured output: this request has no grammar state on this rank"
        elif state.error is not None:
            errors[seq_id] = state.error
        else:
            live.append((request_id, drafts))
            live_states.append((seq_id, state))
            if drafts:
                logits_rows += range(first, first + 1 + len(drafts))
            else:
                logits_rows.append(first)
    if not live:
        return GrammarRows(0, [], errors)
    assert manager is not None
    manager.fill_masks(host_rows(len(logits_rows)), live)
    for seq_id, state in live_states:
        if state.error is not None:  # a matcher failure while masking: stop mask, error
            errors[seq_id] = state.error
    return GrammarRows(len(logits_rows), logits_rows, errors)
