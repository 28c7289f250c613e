"""One rank's structured output: everything a worker does for constrained requests.

The model runner creates one of these on the first structured-output RPC and forwards those RPCs
here; for a batch with constrained requests it calls ``start_step`` once the forward is queued
and ``finish_step`` before sampling, and it never touches anything else of this package. A
request's life on a rank:

- ``admit`` (the API, before enqueue): this rank can enforce the spec; compilation starts in
  the background. The first call also starts this rank's lazy initialization (tokenizer and
  grammar tokenizer, seconds for a large vocabulary) in a thread, answering ``pending``.
- ``prepare`` (the engine core, while the request waits in the scheduler): binds the request's
  own matcher as soon as its grammar is compiled, and says so; never waits for a compile.
- every step it is scheduled, on this rank's grammar thread (``start_step``): commit the
  acknowledged tokens, fill its mask row with llguidance (the rows of different requests at
  once on ``EngineConfig.structured_output_threads`` threads) and apply the rows to the step's
  logits (the Triton kernel, queued on the step's stream, on GPU; the reference on CPU), while
  the engine thread reads the previous step's output and builds the next step's inputs; the
  engine thread waits for it (``finish_step``) before it queues the sampling.
- ``release`` on any terminal path, idempotently.

With a grammar process (``EngineConfig.grammar_process``: on CUDA by default) the states live in
a process of their own (``grammar_process``), or are split over several (``grammar_pool``): the
same steps run there, on their own interpreters, and write the rows into memory each shares with
this process. Without speculative decoding the steps are gates (``gate_send``, ``gate_mask``,
``grammar_board``): the stream, not this thread, waits for the rows, so the engine thread only
sends a step and reads its errors with its output; and while gates are in flight ``prepare``
asks without waiting and answers at a later poll.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from atom import envs
from atom.config import EngineConfig
from atom.model_engine.tokenizer import eos_token_ids, load_tokenizer
from atom.model_ops.embed_head import ParallelLMHead
from atom.structured_output.grammar_board import (
    COPIED,
    DONE,
    TOKENS,
    GrammarBoard,
    GrammarBoardTimeout,
    stamp_of,
)
from atom.structured_output.grammar_pool import GrammarPool
from atom.structured_output.grammar_process import GrammarProcess, GrammarProcessError
from atom.structured_output.grammar_rows import GrammarRows, RowJob, fill_rows
from atom.structured_output.manager import AdmissionResult, StructuredOutputManager
from atom.structured_output.stream_flags import current_stream_handle, stream_wait, stream_write
from atom.structured_output.utils import MaskBuffers, num_mask_words

if TYPE_CHECKING:
    from atom.model_engine.scheduler import GrammarUpdate
    from atom.model_engine.sequence import Sequence

__all__ = ["GateCommit", "StructuredOutputWorker"]

# A request's acknowledged tokens for a gate: (request id, tokens, source), where a placeholder
# in tokens is the sampled id at ``source`` = (gates back, row) of the board's ring: the row of
# the gate that many gates before this one (1 while the batch keeps decoding: a steady batch
# sends none, the child makes them from the last gate's jobs; ``repeat_gate``).
GateCommit = tuple[str, list[int], tuple[int, int] | None]

logger = logging.getLogger(__name__)

# The interpreter's thread switch interval while a step's grammar work runs (Python's default is
# 5 ms, restored after it). The grammar thread needs the GIL for a moment between its llguidance
# calls, which release it; with the default it would wait for the engine thread's output
# processing to finish, and the two would run one after the other instead of at once.
SWITCH_INTERVAL_S = 1e-4
# Steps with at most this many constrained rows do their grammar work on the caller's thread,
# right after the forward is queued: the handoff to the grammar thread costs more than the little
# output processing it would overlap (H200, batch 1: 1.02x enabled-request overhead inline,
# 1.06-1.15x on the thread; batch 16: 1.7x on the thread, 2.4-2.9x inline).
INLINE_ROWS = 4


class StructuredOutputWorker:
    """Owns a rank's grammar manager (built lazily), its mask buffers and its RPC answers."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        hf_config: Any,
        model: torch.nn.Module,
        device: torch.device,
        rank: int,
    ) -> None:
        self.config = config
        self.model_path = model_path
        self.hf_config = hf_config
        self.model = model
        self.device = device
        self.rank = rank
        # Set by the initialization thread: the grammar states, in this process or in
        # processes of their own (``grammar_pool``).
        self.manager: StructuredOutputManager | None = None
        self.pool: GrammarPool | None = None
        self._init_thread: threading.Thread | None = None
        self._init_error: str | None = None
        self._mask_buffers: MaskBuffers | None = None  # allocated by the first mask
        self._gate = 0  # the last gate sent to the grammar processes
        # CUDA: per grammar process, a device buffer its gates' areas are copied into.
        self._gate_areas: list[torch.Tensor] = []
        self._stream: int | None = None  # CUDA: the last gate's stream (its driver handle)
        self._stream_flags: bool | None = None  # whether the stream waits work (``gates``)
        # Per gate in flight: the grammar processes it went to, each with its jobs and whether
        # the message reached it.
        self._gate_jobs: dict[int, list[tuple[int, list[RowJob], bool]]] = {}
        # The last gate's sampling sequences, their ids and its members (``repeat_gate``).
        self._last_gate: (
            tuple[list[Sequence], list[int], list[tuple[int, list[RowJob], bool]]] | None
        ) = None
        self._repeated = 0  # gates that repeated the last one
        # CUDA, per (grammar process, area, rows): the views a gate's copy and kernel take.
        self._area_views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        # Steps run one at a time on this thread; the lock keeps RPCs from touching grammar
        # states while one runs (the engine never overlaps them, this makes sure of it).
        self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="atom-grammar-step")
        self._lock = threading.Lock()
        self._switch_interval = sys.getswitchinterval()  # restored after each step

    # ---- RPCs ----------------------------------------------------------------------------------

    def admit(self, spec: Any, api_fingerprint: str, vocab_size: int, wait_s: float = 0.0) -> dict:
        """Admission: can this rank enforce `spec`? Compiles it in the background.

        Answers {"status": "ready" | "pending" | "error", "message", "rank"} without waiting for
        a compile (wait_s=0 from the API): the engine loop is never held by compilation.
        """
        refusal = self._refusal()
        if refusal is not None:
            return self._answer("error", refusal)
        if not self._initialized:
            self._start_init()
            return self._answer("pending")
        if self.pool is not None:
            result = self.pool.admit(spec, api_fingerprint, vocab_size, wait_s)
        else:
            result = self.manager.admit(spec, api_fingerprint, vocab_size, wait_s)
        return self._answer(result.status, result.message)

    def prepare(self, items: list[tuple[str, Any]]) -> dict[str, AdmissionResult]:
        """Readiness of `(request_id, spec)` pairs waiting in the scheduler, by request id.

        "ready" once the request's own matcher is bound on this rank (it keeps its compiled
        grammar after cache eviction), "pending" while the grammar compiles in the background,
        "error" when it cannot compile here. Polled by the engine core; never waits.
        """
        refusal = self._refusal()
        if refusal is None and not self._initialized:
            self._start_init()  # a request that skipped admission (direct engine use)
            return {rid: AdmissionResult("pending") for rid, _ in items}
        if refusal is not None:
            return {rid: AdmissionResult("error", refusal) for rid, _ in items}
        if self.pool is not None:
            return self.pool.prepare(items)
        with self._lock:
            return {rid: self.manager.prepare(rid, spec) for rid, spec in items}

    def release(self, request_ids: list[str]) -> None:
        """Drop these requests' grammar state; idempotent (every terminal path may call it)."""
        if self.pool is not None:
            self.pool.release(request_ids)  # in order behind the gates, unanswered
        elif self.manager is not None:
            with self._lock:
                for rid in request_ids:
                    self.manager.release(rid)

    def stats(self) -> dict[str, int]:
        live, cached = 0, 0
        if self.pool is not None:
            live, cached = self.pool.counts()
        elif self.manager is not None:
            live, cached = self.manager.num_live_states, self.manager.num_cached_grammars
        return {
            "live_grammar_states": live,
            "cached_grammars": cached,
            "gates": self._gate,
            "repeated_gates": self._repeated,
        }

    def shutdown(self) -> None:
        self._step_thread.shutdown(wait=True)
        if self.manager is not None:
            self.manager.shutdown()
        if self.pool is not None:
            self.pool.shutdown()

    @property
    def _initialized(self) -> bool:
        return self.manager is not None or self.pool is not None

    # ---- per step: commit and fill on the grammar thread, apply on the caller's ------------------

    def start_step(
        self,
        updates: Callable[[], list[GrammarUpdate]],
        seqs: list[Sequence],
        logits: torch.Tensor | None,
        drafts: list[list[int]] | None = None,
    ) -> Future[dict[int, str]]:
        """Start one step's host grammar work on this rank's grammar thread and return at once
        (a step with at most ``INLINE_ROWS`` constrained rows does it here, before returning).

        There, ``updates()`` (which may wait for the previous step's sampled ids) is committed,
        the rows of the constrained requests among ``seqs`` (the step's sampling sequences, in
        ``logits`` row order; after raw logprobs were taken) are filled, and ``logits`` are
        masked with them in place: on CUDA the H2D copy and the kernel are queued on the stream
        current here, as soon as the rows are ready, while the caller's thread goes on with
        other work (reading the previous step's output, building the next inputs). Nothing may
        read ``logits`` before ``finish_step``. ``drafts`` (speculative decoding): per sequence
        its draft tokens, whose ``1 + len`` logits rows get the masks after each draft prefix.
        """
        self._switch_interval = sys.getswitchinterval()
        constrained = sum(s.params.structured_output is not None for s in seqs)
        drafts = drafts if drafts is not None else [[]] * len(seqs)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        args = (updates, seqs, logits, drafts, stream)
        if constrained <= INLINE_ROWS:
            done: Future[dict[int, str]] = Future()
            try:
                done.set_result(self._step(*args))
            except Exception as e:  # noqa: BLE001 - raised by finish_step, as from the thread
                done.set_exception(e)
            return done
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        return self._step_thread.submit(self._step, *args)

    def finish_step(self, step: Future[dict[int, str]]) -> dict[int, str]:
        """Wait for a step's grammar work: its logits are masked (or, on CUDA, their mask is
        queued) once this returns. Returns structured-output errors by sequence id: those
        requests end with "error" and their sampled token is dropped."""
        try:
            return step.result()
        finally:
            sys.setswitchinterval(self._switch_interval)

    @torch.inference_mode()
    def _step(
        self,
        updates: Callable[[], list[GrammarUpdate]],
        seqs: list[Sequence],
        logits: torch.Tensor | None,
        drafts: list[list[int]],
        stream: torch.cuda.Stream | None,
    ) -> dict[int, str]:
        """Commit the acknowledged tokens (a rejected one marks only its request; one without a
        state on this rank is failed by ``fill_rows``), fill the step's rows, mask ``logits``
        (on ``stream``, the engine thread's) with them; the errors by sequence id."""
        rows = self._fill(updates, self._jobs(seqs, drafts))
        if rows.num_rows:
            assert self._mask_buffers is not None and logits is not None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._mask_buffers.apply(logits, rows.num_rows, rows.logits_rows)
        return rows.errors

    def _fill(self, updates: Callable[[], list[GrammarUpdate]], jobs: list[RowJob]) -> GrammarRows:
        """Commit the acknowledged tokens and fill the rows of ``jobs``, in this process or in
        the grammar process."""
        commits = [(u.request_id, u.new_token_ids) for u in updates()]
        self._ensure_mask_buffers()
        if self.pool is not None:  # one grammar process without gates (``_initialize``)
            self._mask_buffers.wait_host_free()  # the child writes into the rows the copy reads
            return self.pool.processes[0].call("step", commits, jobs)
        with self._lock:
            if self.manager is not None and commits:
                self.manager.commit_many(commits)
            return fill_rows(self.manager, self._mask_buffers.host_rows, jobs)

    def _ensure_mask_buffers(self) -> None:
        """Make the mask rows once, sized by the model's vocabulary (never by a step's logits:
        a step that samples nothing has none), under the lock: the grammar thread (``_fill``)
        and the engine thread (``gate_send``) may both come first."""
        if self._mask_buffers is None:
            with self._lock:
                if self._mask_buffers is None:
                    vocab_size = self.model.lm_head.org_vocab_size
                    self._mask_buffers = self._new_mask_buffers(vocab_size)

    def _new_mask_buffers(self, vocab_size: int) -> MaskBuffers:
        """In-process rows grow on demand; a grammar process's are mapped once (its board),
        for the most rows a step can have (the first process's are the rows of steps that
        wait for them)."""
        if self.pool is None:
            return MaskBuffers(vocab_size, self.device)
        most = self.config.max_num_seqs * (1 + self.config.num_speculative_tokens)
        boards = [
            p.map_board(most, num_mask_words(vocab_size), self.device) for p in self.pool.processes
        ]
        if self.device.type == "cuda":
            area = boards[0].area(0, most)
            self._gate_areas = [torch.empty_like(area, device=self.device) for _ in boards]
        return MaskBuffers(vocab_size, self.device, host=boards[0].rows(0))

    # ---- per step with a grammar process: gates, nothing waits on this thread --------------------

    @property
    def gates(self) -> bool:
        """Whether constrained steps go through gates (``grammar_board``): with a grammar
        process, without speculative decoding (whose steps wait for their rows), and on CUDA
        where the driver has stream memory operations."""
        return self.pool is not None and self._can_gate()

    def _can_gate(self) -> bool:
        """Gates but for the grammar process: no speculative decoding, stream memory
        operations on CUDA."""
        if self.config.speculative_method is not None:
            return False
        if self._stream_flags is None:
            self._stream_flags = self.device.type != "cuda" or _stream_flags_work(self.device)
        return self._stream_flags

    @property
    def gates_sent(self) -> int:
        """Constrained steps sent through gates so far."""
        return self._gate

    @property
    def next_gate(self) -> int:
        """The number the next ``gate_send`` gets (``GateCommit`` sources count back from it)."""
        return self._gate + 1

    def gate_send(self, commits: list[GateCommit], seqs: list[Sequence]) -> int:
        """Send a step's grammar work to the grammar processes that own its constrained
        requests; returns the step's gate. ``commits``: the acknowledged tokens per request, a
        placeholder's source a ``(gates back, row)`` of the ring (``publish``); ``seqs``: the
        step's sampling sequences, in logits row order.

        Called as soon as the step is scheduled, before its inputs are built and its forward
        launched: the children fill while this thread does that. ``gate_mask`` then queues the
        masking of the step's logits behind their rows."""
        self._ensure_mask_buffers()
        parts = [(child, c, jobs) for child, (c, jobs) in self._split(commits, self._jobs(seqs))]
        gate, members = self._send(parts)
        self._last_gate = seqs, [s.seq_id for s in seqs], members
        return gate

    def repeats_last_gate(self, seqs: list[Sequence], num_placeholders: int) -> bool:
        """Whether a step is the last gate again (a batch that keeps decoding): the same
        sampling sequences in the same rows, and each constrained one commits only its
        placeholder (``num_placeholders`` of them), which the last gate sampled. Then
        ``repeat_gate`` sends it, with no commits or jobs to build, split or compare."""
        if self._last_gate is None:
            return False
        last_seqs, last_ids, members = self._last_gate
        if num_placeholders != sum(len(jobs) for _, jobs, _ in members):
            return False
        # The same objects, compared by identity in C; a rank process rebuilds its sequences
        # every step (``step_transport``), whose ids then say it.
        return seqs == last_seqs or [s.seq_id for s in seqs] == last_ids

    def repeat_gate(self) -> int:
        """Send the last gate's work again as a new gate (``repeats_last_gate``): each grammar
        process commits the ids the last one sampled in its rows, then fills the same rows."""
        assert self._last_gate is not None
        last_seqs, last_ids, last_members = self._last_gate
        self._repeated += 1
        gate, members = self._send([(child, None, jobs) for child, jobs, _ in last_members])
        self._last_gate = last_seqs, last_ids, members
        return gate

    def _send(
        self, parts: list[tuple[int, list[GateCommit] | None, list[RowJob]]]
    ) -> tuple[int, list[tuple[int, list[RowJob], bool]]]:
        """A new gate to each ``(child, commits, jobs)`` of ``parts`` (commits None: the
        child's last gate again, alone if it was); the gate and its members, each with whether
        it was sent (a child that failed is reported by ``gate_errors``). A child alone in a
        gate fills it on every spare core (``_Grammars``)."""
        self._gate += 1
        gate, members = self._gate, []
        for child, commits, jobs in parts:
            process = self.pool.processes[child]
            try:
                if commits is None:
                    process.send_repeat_gate(gate)
                else:
                    process.send_gate(gate, commits, jobs, alone=len(parts) == 1)
            except GrammarProcessError:
                members.append((child, jobs, False))
                continue
            members.append((child, jobs, True))
        self._gate_jobs[gate] = members
        return gate, members

    def gate_mask(self, gate: int, logits: torch.Tensor) -> None:
        """Queue the masking of ``logits`` with the rows of ``gate`` (``gate_send``).

        On CUDA the stream waits for each child's rows, copies them, marks them copied and
        masks; the caller queues the sampling next, and nothing here waits. On CPU this waits
        for the rows and masks at once. A child that failed leaves its rows unmasked and fails
        its requests (``gate_errors``)."""
        if self.device.type == "cuda":  # publish's too
            self._stream = current_stream_handle(self.device)
        for child, jobs, sent in self._gate_jobs[gate]:
            if sent:
                self._mask_with(self.pool.processes[child], child, gate, len(jobs), logits)

    def _split(
        self, commits: list[GateCommit], jobs: list[RowJob]
    ) -> list[tuple[int, tuple[list[GateCommit], list[RowJob]]]]:
        """A gate's commits and jobs by the grammar process owning their requests, for those
        with any."""
        if len(self.pool.processes) == 1:
            return [(0, (commits, jobs))]
        owners = self.pool.owners  # a request none holds goes to child 0, which fails its row
        split: dict[int, tuple[list[GateCommit], list[RowJob]]] = {}
        for commit in commits:
            split.setdefault(owners.get(commit[0], 0), ([], []))[0].append(commit)
        for job in jobs:
            split.setdefault(owners.get(job[1], 0), ([], []))[1].append(job)
        return sorted(split.items())

    def _mask_with(
        self, process: GrammarProcess, child: int, gate: int, n: int, logits: torch.Tensor
    ) -> None:
        """Mask ``logits`` with the ``n`` rows ``process`` writes for ``gate``: on CUDA queued
        behind a stream wait for them; on CPU once they are written."""
        from atom.model_ops.triton_structured_output import apply_token_bitmask_inplace

        board = process.board
        if self.device.type != "cuda":
            with contextlib.suppress(GrammarBoardTimeout):  # gate_errors reports the child
                board.wait(DONE, gate, self.config.worker_timeout_s, process.alive)
                index = board.row_index(gate)
                if n and int(index[-1]) == stamp_of(gate):  # not released without its rows
                    apply_token_bitmask_inplace(logits, board.rows(gate)[:n], index[:n])
            board.set(COPIED, gate)
            return
        stream = self._stream
        stream_wait(stream, board.address(DONE), gate)
        host, area, rows, index, stamp = self._views(child, board, gate % 2, n)
        area.copy_(host, non_blocking=True)  # row index, then rows: one copy
        stream_write(stream, board.address(COPIED), gate)
        if n:
            # Rows of a gate released without them (a failed or dead child) are another
            # step's, whose row index may point at an unconstrained neighbour: the kernel then
            # masks nothing, as the area's stamp is not this gate's.
            apply_token_bitmask_inplace(logits, rows, index, (stamp, stamp_of(gate)))

    def _views(
        self, child: int, board: GrammarBoard, area: int, n: int
    ) -> tuple[torch.Tensor, ...]:
        """A gate's tensors for ``n`` rows of ``area`` of ``child``'s board: the host area, its
        device copy, and in that copy the mask rows, their row index and the stamp (made once:
        slicing them took microseconds of the engine thread per gate)."""
        key = (child, area, n)
        views = self._area_views.get(key)
        if views is None:
            device = self._gate_areas[child][: board.index_words + n * board.num_words]
            views = self._area_views[key] = (
                board.area(area, n),
                device,
                device[board.index_words :].view(n, board.num_words),
                device[:n],
                device[board.max_rows : board.max_rows + 1],
            )
        return views

    def publish(self, gate: int, token_ids: torch.Tensor) -> None:
        """Put a gate's sampled ids (int64) into the rings of the grammar processes it went to
        once they are sampled (on the stream of its ``gate_mask``, after the work queued so
        far), for their next gates' commits."""
        for child, _, _ in self._gate_jobs[gate]:
            board = self.pool.processes[child].board
            slot = board.tokens(gate)[: token_ids.numel()]
            if self.device.type != "cuda":
                slot.copy_(token_ids)
                board.set(TOKENS, gate)
                continue
            slot.copy_(token_ids, non_blocking=True)
            stream_write(self._stream, board.address(TOKENS), gate)

    def gate_errors(self, gate: int) -> dict[int, str]:
        """A gate's structured-output errors by sequence id (waits for the children's answers:
        read before the gate's sampled ids, which wait for their rows); the requests of a
        child that failed all fail."""
        errors: dict[int, str] = {}
        for child, jobs, _ in self._gate_jobs.pop(gate, []):
            try:
                errors.update(self.pool.processes[child].answer_of(("gate", gate)))
            except GrammarProcessError as e:
                errors.update((job[0], str(e)) for job in jobs)
        return errors

    def _jobs(self, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> list[RowJob]:
        """The constrained requests among ``seqs`` (in logits row order; sequence i has
        ``1 + len(drafts[i])`` rows, one without ``drafts``), as ``fill_rows`` takes them."""
        if drafts is None:  # one pass: a gate's, every constrained step
            return [
                (s.seq_id, s.request_id, [], i)
                for i, s in enumerate(seqs)
                if s.params.structured_output is not None
            ]
        jobs: list[RowJob] = []
        row = 0  # the logits row of sequence i's first row
        for seq, seq_drafts in zip(seqs, drafts, strict=True):
            if seq.params.structured_output is not None:
                jobs.append((seq.seq_id, seq.request_id, seq_drafts, row))
            row += 1 + len(seq_drafts)
        return jobs

    # ---- initialization ------------------------------------------------------------------------

    def _refusal(self) -> str | None:
        """Why this rank cannot enforce any grammar, or None."""
        if envs.enable_relaxed_mtp():
            return "structured output is disabled with relaxed MTP"
        if not isinstance(getattr(self.model, "lm_head", None), ParallelLMHead):
            return "the target LM head is not a ParallelLMHead"
        if self.pool is not None and self.pool.dead_reason is not None:
            return self.pool.dead_reason
        return self._init_error

    def _start_init(self) -> None:
        if self._init_thread is None:
            self._init_thread = threading.Thread(
                target=self._initialize, name="atom-grammar-init", daemon=True
            )
            self._init_thread.start()

    def _initialize(self) -> None:
        """Background: this rank's tokenizer and grammar tokenizer, then the manager, here or
        in a grammar process (``EngineConfig.grammar_process``)."""
        try:
            tokenizer_path = self.config.tokenizer or self.model_path
            tokenizer = load_tokenizer(tokenizer_path)
            head = self.model.lm_head.org_vocab_size
            options = {
                "vocab_size": head,
                "lm_head_size": head,
                "stop_token_ids": eos_token_ids(self.hf_config, tokenizer),
                "threads": self.config.structured_output_threads,
                "whitespace": self.config.structured_output_whitespace,
            }
            count = self.config.grammar_processes(self.device.type)
            if count:
                if count > 1 and not self._can_gate():
                    count = 1  # steps that wait for their rows take one process's
                timeout_s = self.config.worker_timeout_s
                self.pool = GrammarPool(tokenizer_path, options, timeout_s, count)
            else:
                self.manager = StructuredOutputManager(tokenizer, **options)
        except Exception as e:  # noqa: BLE001 - every later admission reports it
            logger.exception("structured output initialization failed")
            self._init_error = f"structured output initialization failed: {e}"

    def _answer(self, status: str, message: str = "") -> dict:
        return {"status": status, "message": message, "rank": self.rank}


def _stream_flags_work(device: torch.device) -> bool:
    """Whether a stream on ``device`` can write a page-locked host counter (the driver's
    stream memory operations); if not, a grammar process's steps wait for their rows."""
    counter = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    try:
        # A runtime call first: it makes the device's context current on this thread (the
        # initialization thread has none yet), which the driver's stream operations need.
        torch.cuda.synchronize(device)
        stream_write(current_stream_handle(device), counter.data_ptr(), 1)
        torch.cuda.synchronize(device)
    except RuntimeError as e:
        logger.warning(
            "structured output: no stream memory operations (%s); steps wait for rows", e
        )
        return False
    return int(counter.item()) == 1
