"""Continuous batching with chunked prefill, preemption by recompute and abort in any state.

Each step spends a token budget (`max_num_batched_tokens`): running sequences first (one decode
token, or the next prefill chunk), then waiting ones in arrival order. When the KV cache runs out,
the most recently admitted running sequence is preempted: its blocks are freed and it goes back to
the head of the queue to be recomputed (prefix caching usually makes that cheap).

The samples of one prompt (`n` > 1) share its KV blocks: the first is prefilled, the others
wait until its prompt's full blocks are in the prefix cache and then compute only the rest.

A constrained request waits (`WAITING_FOR_GRAMMAR`) until the engine core reports its grammar
bound on every rank (`grammar_ready`); until then it is skipped and later requests run.

Scheduling is ahead of output (asynchronous scheduling): `schedule` counts a step's tokens as
computed at once and appends a placeholder for each token it will sample, so the next step can be
scheduled before this one's output is read; `update` later replaces the placeholders. A sequence
whose pending tokens already reach its length limit is not scheduled again, and a preempted one
waits until its pending token is known. Stops the host only sees in the output (EOS, stop tokens
and strings) end a sequence one step late: the engine core drops the extra token. A verification
step in flight emits an unknown number of tokens: the next step is placed as if it emitted one,
with blocks for all it may emit (`Sequence.unread_drafts`; the device moves it on).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from atom.config import EngineConfig
from atom.model_engine.block_manager import BlockManager
from atom.model_engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclass
class GrammarUpdate:
    """Structured output, scheduler -> ranks: the output tokens of a request accepted since its
    previous update, committed to its grammar before this step's logits are masked (its matcher
    was bound on every rank before it was first scheduled, so no rank binds or compiles here)."""

    request_id: str
    new_token_ids: list[int]
    seq_id: int  # the sequence whose placeholder a new token may be (``PLACEHOLDER``)


@dataclass
class ScheduledBatch:
    """One step's work: `num_new_tokens[i]` tokens of `seqs[i]` starting at its computed count."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # runner may drop their state
    has_constrained: bool = False  # some of `seqs` carry a structured-output spec
    grammar_updates: list[GrammarUpdate] = field(default_factory=list)  # constrained only
    # ... but for the constrained sequences whose only new token is the placeholder of their
    # previous step (asynchronous decoding, every step): (request id, sequence id), a
    # ``GrammarUpdate`` of ``[PLACEHOLDER]`` each. Per row, a dataclass and a slice were most of
    # the scheduler's constrained cost (91 µs of 256 rows on this repo's CPU machine).
    grammar_placeholders: list[tuple[str, int]] = field(default_factory=list)
    # Per sequence, fixed at schedule time: tokens in the KV cache before this step (the
    # position of its first new token) and whether its last new token is sampled.
    num_computed_before: list[int] = field(default_factory=list)
    sampling: list[bool] = field(default_factory=list)
    # Speculative decoding: per sequence, the drafts this step verifies (its last
    # `len(draft_token_ids[i])` new tokens; `num_new_tokens` counts them); empty lists otherwise.
    draft_token_ids: list[list[int]] = field(default_factory=list)
    has_drafts: bool = False
    # A steady decode step: its sequences are the previous batch's, in the same order, and
    # each computes the one token after the one it computed there, with the same block table
    # but for a block appended (none preempted, admitted or finished in between; no drafts).
    # The runner advances that step's inputs instead of reading every sequence again.
    steady: bool = False

    def all_grammar_updates(self) -> list[GrammarUpdate]:
        """``grammar_updates`` and ``grammar_placeholders``, as updates."""
        placeholders = [GrammarUpdate(r, [PLACEHOLDER], s) for r, s in self.grammar_placeholders]
        return self.grammar_updates + placeholders


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self._awaiting_grammar: dict[str, Sequence] = {}  # WAITING_FOR_GRAMMAR, by request id
        self._finished_seq_ids: list[int] = []
        self.num_preemptions = 0
        # The previous batch's sequences if it was a decode step (one token each), else empty.
        self._decoded: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_for_grammar(self) -> int:
        return len(self._awaiting_grammar)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def only_waiting_for_grammar(self) -> bool:
        """Nothing can run until a grammar is ready (the engine loop may pause between polls)."""
        return not self.running and len(self.waiting) == len(self._awaiting_grammar)

    def add(self, seq: Sequence) -> None:
        if self.config.max_model_len is not None:
            seq.max_len = min(seq.max_len, self.config.max_model_len)
        self.requests[seq.request_id] = seq
        if seq.params.structured_output is not None:
            seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
            self._awaiting_grammar[seq.request_id] = seq
        self.waiting.append(seq)

    def waiting_for_grammar(self) -> list[Sequence]:
        return list(self._awaiting_grammar.values())

    def grammar_ready(self, seq: Sequence) -> None:
        """Every rank has bound this request's grammar: it may be scheduled from now on."""
        del self._awaiting_grammar[seq.request_id]
        seq.status = SequenceStatus.WAITING

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = []
        budget, preempted = self._schedule_running(batch, self.max_num_batched_tokens)
        if not preempted:
            self._schedule_waiting(batch, budget)
        self._advance(batch)
        self._mark_steady(batch)
        return batch

    def _mark_steady(self, batch: ScheduledBatch) -> None:
        """``batch.steady`` (see there): a decode step whose list of sequences is the previous
        decode step's. A sequence loses or changes its blocks only when preempted or finished,
        and either takes it out of the running list (a preempted one is not admitted again in
        the step that preempted it). Drafts move sequences on by what they accept, so
        speculative decoding has no steady steps."""
        decode = bool(batch.seqs) and max(batch.num_new_tokens) == 1
        if not decode or self.config.speculative_method is not None:
            self._decoded = []
            return
        batch.steady = batch.seqs == self._decoded
        self._decoded = batch.seqs

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> tuple[int, bool]:
        """Running sequences first, in order; preempts the newest when the cache is full.
        Returns the budget left and whether anything was preempted."""
        bm, running = self.block_manager, self.running
        block_size = bm.block_size
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            i += 1
            # The device may place this step that much later (speculative decoding only).
            unread = sum(seq.unread_drafts) if seq.unread_drafts else 0
            if seq.num_placeholders and len(seq.token_ids) + unread >= seq.max_len:
                continue  # maybe at its limit once its pending tokens are read: wait for them
            computed = seq.num_computed_tokens
            n = len(seq.token_ids) - computed
            if n > budget:
                n = budget
            drafts = self._drafts(seq, n, budget) if seq.draft_token_ids else []
            n += len(drafts)
            if n > 1 or unread or computed % block_size == 0:  # may need new blocks
                while not bm.can_allocate(seq, computed + n + unread):
                    preempted = True
                    if self._preempt(running.pop()) is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    break
                bm.allocate(seq, computed + n + unread)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.draft_token_ids.append(drafts)
            if drafts:
                batch.has_drafts = True
            budget -= n
        return budget, preempted

    @staticmethod
    def _drafts(seq: Sequence, n: int, budget: int) -> list[int]:
        """The drafts a decode row verifies: as many as fit the token budget and can still be
        emitted (a step emits the accepted drafts plus one token, within the length limit)."""
        drafts = seq.draft_token_ids
        if not drafts or n != 1:
            return []
        room = min(budget - 1, seq.max_len - len(seq.token_ids) - sum(seq.unread_drafts) - 1)
        return drafts[:room] if room > 0 else []

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """Then waiting ones in arrival order, skipping those whose grammar is not ready or
        whose pending token is not known yet."""
        bm = self.block_manager
        i = 0
        while i < len(self.waiting) and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[i]
            if (
                seq.status == SequenceStatus.WAITING_FOR_GRAMMAR
                or seq.num_placeholders
                or self._waits_for_prefix(seq)
            ):
                i += 1
                continue
            if not seq.block_table:
                bm.match_prefix(seq)
                if seq.status == SequenceStatus.WAITING:  # report first-admission hits only
                    seq.num_cached_tokens = seq.num_computed_tokens
            n = min(len(seq) - seq.num_computed_tokens, budget)
            if not bm.can_allocate(seq, seq.num_computed_tokens + n):
                bm.free_blocks(seq)  # give prefix-cache hits back until it can run
                break
            bm.allocate(seq, seq.num_computed_tokens + n)
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.draft_token_ids.append([])
            budget -= n

    def _waits_for_prefix(self, seq: Sequence) -> bool:
        """A parallel sample waits while the sample it shares its prompt with has not yet
        computed the prompt's full blocks: admitted afterwards, it finds them in the prefix
        cache (reference-counted, so the prompt is prefilled once) instead of computing them
        again in the same step. It stops waiting for good once they are there, or once the
        other has finished."""
        source = self.requests.get(seq.prefix_source) if seq.prefix_source else None
        if source is None or not self.block_manager.enable_prefix_caching:
            seq.prefix_source = None
            return False
        shared = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
        if source.num_hashed_blocks >= shared:
            seq.prefix_source = None
            return False
        return True

    def _advance(self, batch: ScheduledBatch) -> None:
        """Count the batch's tokens as computed and append a placeholder per sampled token
        (grammar updates first: they carry only tokens scheduled before this step). Blocks that
        became full of known tokens enter the prefix cache now: a later step that reuses them
        runs after this one on the device, which writes their K/V first."""
        commit, block_size = self.block_manager.commit, self.block_manager.block_size
        starts, sampling = batch.num_computed_before, batch.sampling
        for seq, n, drafts in zip(
            batch.seqs, batch.num_new_tokens, batch.draft_token_ids, strict=True
        ):
            if drafts:  # a draft counts as computed only once accepted (`accept_draft`)
                n -= len(drafts)
            start = seq.num_computed_tokens
            samples = start + n == len(seq.token_ids)
            starts.append(start)
            sampling.append(samples)
            seq.num_computed_tokens = start + n
            if start + n >= (seq.num_hashed_blocks + 1) * block_size:
                commit(seq)  # a block may be full of known tokens: findable at once
            if seq.params.structured_output is not None:
                batch.has_constrained = True
                self._grammar_update(batch, seq)
            if samples:
                seq.append_placeholder()
            if drafts and self.config.async_scheduling:
                seq.unread_drafts.append(len(drafts))

    @staticmethod
    def _grammar_update(batch: ScheduledBatch, seq: Sequence) -> None:
        """Send only the output tokens accepted since the last update: each token is committed
        once, even when a preempted request recomputes it."""
        acked = seq.num_prompt_tokens + seq.num_grammar_acked
        num_new = len(seq.token_ids) - acked
        if num_new == 1 and seq.num_placeholders:  # placeholders trail: the new one is one
            seq.num_grammar_acked += 1
            batch.grammar_placeholders.append((seq.request_id, seq.seq_id))
        elif num_new:
            seq.num_grammar_acked += num_new
            new = seq.token_ids[acked:]
            batch.grammar_updates.append(GrammarUpdate(seq.request_id, new, seq.seq_id))

    def update(
        self,
        batch: ScheduledBatch,
        sampled: dict[int, int],
        more: dict[int, list[int]] | None = None,
    ) -> list[tuple[Sequence, int]]:
        """Replace the batch's placeholders with the sampled tokens (a row without one, e.g. a
        failed one, loses its placeholder); `more`: what a verification emitted after them,
        processed by the caller (`accept_draft`). Returns the (sequence, token) pairs to
        process; sequences that finished meanwhile are skipped: their token is never emitted."""
        got_token, more = [], more or {}
        commit, block_size = self.block_manager.commit, self.block_manager.block_size
        finished, running = SequenceStatus.FINISHED, SequenceStatus.RUNNING
        for seq, samples, drafts in zip(
            batch.seqs, batch.sampling, batch.draft_token_ids, strict=True
        ):
            if seq.status is finished:
                continue
            if drafts and seq.unread_drafts:
                del seq.unread_drafts[0]
            seq.drafts_missed = bool(drafts) and len(more.get(seq.seq_id, ())) < len(drafts)
            token = None
            if samples:
                token = sampled.get(seq.seq_id)
                seq.resolve_placeholder(token)
            if (
                seq.status is running
                and seq.num_computed_tokens >= (seq.num_hashed_blocks + 1) * block_size
            ):
                commit(seq)  # a block may be full of known tokens now
            if token is not None:
                got_token.append((seq, token))
        return got_token

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for the first `num_tokens` positions of a running sequence, if the cache has
        them free (a draft model writes its K/V at positions the next step will compute)."""
        if not self.block_manager.can_allocate(seq, num_tokens):
            return False
        self.block_manager.allocate(seq, num_tokens)
        return True

    def accept_draft(self, seq: Sequence, token: int) -> None:
        """One more token a verification step emitted after its first (an accepted draft, or
        the token after the last accepted one): it joins the known tokens (before the
        placeholder of a later step already scheduled), and the token before it, which the
        step's forward saw, now has valid K/V (unless the sequence was preempted while the
        step was in flight: its cache is gone, and it recomputes them all)."""
        seq.insert_known(token)
        if seq.status != SequenceStatus.RUNNING:
            return
        seq.num_computed_tokens += 1
        if seq.num_computed_tokens >= (seq.num_hashed_blocks + 1) * self.block_manager.block_size:
            self.block_manager.commit(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Terminal transition from any state; frees KV blocks. Idempotent."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free_blocks(seq)
        seq.drop_placeholders()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.requests.pop(seq.request_id, None)
        self._awaiting_grammar.pop(seq.request_id, None)
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
        seq.draft_token_ids = []  # proposed for the cache it just lost
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq
