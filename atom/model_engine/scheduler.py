"""Continuous batching with chunked prefill, preemption by recompute and abort in any state.

Each step spends a token budget (`max_num_batched_tokens`): running sequences first (one decode
token, or the next prefill chunk), then waiting ones in arrival order. When the KV cache runs out,
the most recently admitted running sequence is preempted: its blocks are freed and it goes back to
the head of the queue to be recomputed (prefix caching usually makes that cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from atom.config import EngineConfig
from atom.model_engine.block_manager import BlockManager
from atom.model_engine.sequence import Sequence, SequenceStatus


@dataclass
class GrammarUpdate:
    """Structured output, scheduler -> runner: the spec on a request's first schedule (None
    afterwards; the matcher itself was bound on every rank at submission, so the runner never
    binds or compiles here) and the output tokens accepted since the previous update
    (committed by the runner before it masks this step's logits)."""

    request_id: str
    spec: Any
    new_token_ids: list[int]


@dataclass
class ScheduledBatch:
    """One step's work: `num_new_tokens[i]` tokens of `seqs[i]` starting at its computed count."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # runner may drop their state
    grammar_updates: list[GrammarUpdate] = field(default_factory=list)  # constrained only

    def samples(self, i: int) -> bool:
        """Does row i reach the end of its sequence (so a token is sampled)?"""
        return self.seqs[i].num_computed_tokens + self.num_new_tokens[i] == len(self.seqs[i])


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self._finished_seq_ids: list[int] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = []
        bm, budget = self.block_manager, self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            while not bm.can_allocate(seq, seq.num_computed_tokens + n):
                preempted = True
                if self._preempt(self.running.pop()) is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            bm.allocate(seq, seq.num_computed_tokens + n)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            if not seq.block_table:
                bm.match_prefix(seq)
                if seq.status == SequenceStatus.WAITING:  # report first-admission hits only
                    seq.num_cached_tokens = seq.num_computed_tokens
            n = min(len(seq) - seq.num_computed_tokens, budget)
            if not bm.can_allocate(seq, seq.num_computed_tokens + n):
                bm.free_blocks(seq)  # give prefix-cache hits back until it can run
                break
            bm.allocate(seq, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        for seq in batch.seqs:
            if seq.params.structured_output is not None:
                self._grammar_update(batch, seq)
        return batch

    @staticmethod
    def _grammar_update(batch: ScheduledBatch, seq: Sequence) -> None:
        """Send the spec once, then only the output tokens accepted since the last update."""
        spec = None if seq.grammar_spec_sent else seq.params.structured_output
        new = seq.token_ids[seq.num_prompt_tokens + seq.num_grammar_acked :]
        if spec is None and not new:
            return
        seq.grammar_spec_sent = True
        seq.num_grammar_acked += len(new)
        batch.grammar_updates.append(GrammarUpdate(seq.request_id, spec, new))

    def update(self, batch: ScheduledBatch, sampled: dict[int, int]) -> list[Sequence]:
        """Advance computed counts; append sampled tokens. Returns sequences that got a token."""
        got_token = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
            token = sampled.get(seq.seq_id)
            if token is not None:
                seq.append_token(token)
                got_token.append(seq)
        return got_token

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Terminal transition from any state; frees KV blocks. Idempotent."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.requests.pop(seq.request_id, None)
        self._finished_seq_ids.append(seq.seq_id)

    def abort(self, request_ids: list[str]) -> list[Sequence]:
        aborted = []
        for rid in request_ids:
            seq = self.requests.get(rid)
            if seq is not None:
                self.finish(seq, "abort")
                aborted.append(seq)
        return aborted

    def _preempt(self, seq: Sequence) -> Sequence:
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq
