"""One step's sampled ids (and logprobs), read by the host later: deferred output.

With asynchronous scheduling the engine submits step N+1 before it reads step N's output. The
sampled ids stay on the device, where step N+1's inputs take them (the host only knows their
rows); a copy into pinned host memory is queued on a side stream right after sampling and an
event marks its end, so reading them waits for that copy alone, never for work queued later. The
step owns its device tensors until they are read, and tells the allocator that the side stream
uses them, so their memory is never reused under the copy. On CPU there is nothing to copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from atom.model_engine.output import TokenLogprob
from atom.model_ops.sampler import Logprobs

if TYPE_CHECKING:
    from atom.model_ops.rejection_sampler import Verification


@dataclass
class RunnerOutput:
    """Sampled token (and logprobs when asked) per sequence id that reached its end."""

    token_ids: dict[int, int]
    logprobs: dict[int, TokenLogprob]
    # Structured-output failures by sequence id: the request ends with finish_reason "error".
    errors: dict[int, str] = field(default_factory=dict)
    # Speculative decoding: the tokens a verification step emitted after the first, in order.
    more_token_ids: dict[int, list[int]] = field(default_factory=dict)


class DeferredOutput:
    """The output of one submitted step; `result` waits only for its own host copy."""

    def __init__(
        self,
        seq_ids: list[int],
        token_ids: torch.Tensor,
        errors: dict[int, str],
        logprobs: Logprobs | None = None,
        num_logprobs: list[int | None] | None = None,
        copy_stream: torch.cuda.Stream | None = None,
    ):
        self.seq_ids = seq_ids  # host mirror: row i was sampled for sequence seq_ids[i]
        self.token_ids = token_ids  # [R] on the device, read by the next step's inputs
        self.next_input_ids = token_ids
        self.errors = errors
        self.num_logprobs = num_logprobs
        tensors = [token_ids]
        if logprobs is not None:
            tensors += [logprobs.sampled, logprobs.top_ids, logprobs.top]
        self._host, self._ready = _copy_to_host(tensors, copy_stream)
        self._ids: list[int] | None = None
        # A constrained step of a grammar process (``grammar_board``): its gate, and a call
        # returning its structured-output errors, made before the host copy is waited for
        # (that copy waits for the gate's rows; the call releases them if the child failed).
        self.gate: int | None = None
        self.pending_errors: Callable[[], dict[int, str]] | None = None

    @cached_property
    def rows(self) -> dict[int, int]:
        """The row of each sequence id (built when first asked: a decode step whose batch
        is the one before it takes its inputs without it, `ModelRunner._fill_placeholders`)."""
        return {seq_id: i for i, seq_id in enumerate(self.seq_ids)}

    @classmethod
    def empty(cls) -> DeferredOutput:
        return cls([], torch.empty(0, dtype=torch.long), {})

    def ready(self) -> bool:
        """Has the host copy finished (reading waits for nothing more)?"""
        return self._ready is None or self._ready.query()

    def host_token_ids(self) -> list[int]:
        """The sampled ids on the host (waits for this step's copy the first time)."""
        if self.pending_errors is not None:
            self.errors = {**self.errors, **self.pending_errors()}
            self.pending_errors = None
        if self._ids is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._ids = self._host[0].tolist()
        return self._ids

    def token_of(self, seq_id: int) -> int:
        return self.host_token_ids()[self.rows[seq_id]]

    def tokens_of(self, seq_id: int) -> list[int]:
        """What the sequence's placeholder stands for (one token; a verification's: several)."""
        return [self.token_of(seq_id)]

    def result(self) -> RunnerOutput:
        ids = self.host_token_ids()
        if self.errors:
            tokens = {s: t for s, t in zip(self.seq_ids, ids, strict=True) if s not in self.errors}
        else:  # the common step: one C-level build
            tokens = dict(zip(self.seq_ids, ids, strict=True))
        out = RunnerOutput(tokens, {}, self.errors)
        if len(self._host) > 1:
            sampled, top_ids, top = (t.tolist() for t in self._host[1:])
            for i, (seq_id, k) in enumerate(zip(self.seq_ids, self.num_logprobs, strict=True)):
                if k is not None:
                    candidates = list(zip(top_ids[i][:k], top[i][:k], strict=True))
                    out.logprobs[seq_id] = TokenLogprob(ids[i], sampled[i], candidates)
        return out


def _copy_to_host(
    tensors: list[torch.Tensor], stream: torch.cuda.Stream | None
) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Pinned host copies of device tensors, queued on `stream` after the work that produces
    them, and the event that marks their end; CPU tensors are returned as they are."""
    if stream is None or not tensors[0].is_cuda:
        return tensors, None
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        host = []
        for t in tensors:
            t.record_stream(stream)
            copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.append(copy.copy_(t, non_blocking=True))
        ready = torch.cuda.Event()
        ready.record(stream)
    return host, ready


class VerifiedOutput:
    """The output of a step that verified drafts (speculative decoding): per sequence the tokens
    `rejection_sample` emitted. As a `DeferredOutput`, it stays on the device for the next
    step's inputs (its last emitted token, and how many drafts it accepted: the next step's
    positions) and is copied to pinned host memory on the side stream; `result` waits only for
    that copy."""

    def __init__(
        self,
        seq_ids: list[int],
        verification: Verification,
        errors: dict[int, str],
        copy_stream: torch.cuda.Stream | None = None,
    ):
        self.seq_ids = seq_ids
        self.rows = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        self.errors = errors
        self.num_accepted = verification.num_accepted  # [N] on the device
        emitted = verification.token_ids
        self.next_input_ids = emitted.gather(1, self.num_accepted.unsqueeze(1)).squeeze(1)
        self._host, self._ready = _copy_to_host([emitted, self.num_accepted], copy_stream)
        self._emitted: list[list[int]] | None = None

    def ready(self) -> bool:
        """Has the host copy finished (reading waits for nothing more)?"""
        return self._ready is None or self._ready.query()

    def emitted(self) -> list[list[int]]:
        """Per sequence its emitted tokens (waits for this step's copy the first time)."""
        if self._emitted is None:
            if self._ready is not None:
                self._ready.synchronize()
            rows, accepted = (t.tolist() for t in self._host)
            self._emitted = [row[: n + 1] for row, n in zip(rows, accepted, strict=True)]
        return self._emitted

    def tokens_of(self, seq_id: int) -> list[int]:
        return self.emitted()[self.rows[seq_id]]

    def result(self) -> RunnerOutput:
        out = RunnerOutput({}, {}, self.errors)
        for seq_id, tokens in zip(self.seq_ids, self.emitted(), strict=True):
            if seq_id in self.errors:
                continue
            out.token_ids[seq_id] = tokens[0]
            if len(tokens) > 1:
                out.more_token_ids[seq_id] = tokens[1:]
        return out
