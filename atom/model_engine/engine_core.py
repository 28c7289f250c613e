"""One replica's engine: scheduler + executor + output processing.

It can be stepped inline (offline `LLM`) or run as a busy loop in a background thread (server),
fed through an input queue of commands: add, abort and utility calls. A utility call runs a method
of this core on the loop thread, either awaited (a Future) or fire-and-forget.

Asynchronous scheduling (`EngineConfig.async_scheduling`): a step schedules and submits the next
batch, then reads the output of the batch submitted one step earlier, so the device computes
while the host processes outputs and builds the next inputs. A batch with constrained requests
has its grammar rows filled on the rank's grammar thread meanwhile; the rank queues its sampling
when the next batch is submitted, once that batch's inputs are built (`ModelRunner`). The next
batch's inputs take the previous one's sampled ids on the device (`deferred_output`). A request
that stops on a token the host sees only in the output has one more token in flight: it is
dropped, never emitted.
Synchronous scheduling reads each batch's output right after submitting it.

Speculative decoding with asynchronous scheduling (n-gram drafts): once a batch is queued, the
next drafts of its sequences are proposed as if it accepted all of its drafts; the next batch is
scheduled as if it accepted none (`Sequence.unread_drafts` reserves blocks for the rest), and
the model runner moves each sequence's rows on by what it did accept, on the device. Reading it
then inserts its emitted tokens before the next batch's placeholder.

Structured output: a constrained request waits in the scheduler until every rank has bound its
grammar. Each step, while such requests wait, one collective RPC (`structured_output_prepare`)
asks the ranks; a rank binds a request's own matcher as soon as its grammar is compiled (in that
rank's background executor, never on this loop) and answers ready, pending or an error. An error
on any rank ends the request with finish reason "error"; its grammar state is released on every
rank, as on every other terminal path.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from atom.config import EngineConfig
from atom.model_engine.block_manager import BlockManager
from atom.model_engine.detokenizer import IncrementalDetokenizer
from atom.model_engine.errors import EngineDeadError
from atom.model_engine.executor import Executor
from atom.model_engine.output import RequestOutput, TokenIdsPrefix, TokenLogprob
from atom.model_engine.scheduler import ScheduledBatch, Scheduler
from atom.model_engine.sequence import Sequence

if TYPE_CHECKING:
    from atom.structured_output.manager import AdmissionResult

logger = logging.getLogger(__name__)

OutputHandler = Callable[[list[RequestOutput]], None]

# The busy loop's pause between grammar polls while nothing else can run.
GRAMMAR_POLL_S = 0.005


def _failure(e: Exception) -> str:
    """A failed step's message for its requests: a dead engine says so plainly (the API answers
    503 for it), anything else with its type."""
    return str(e) if isinstance(e, EngineDeadError) else repr(e)


@dataclass
class _RequestState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    # The token ids that end it: EOS (unless ignored) and its stop token ids.
    stop_ids: frozenset[int]
    num_reported: int = 0
    # `final_only`: logprobs of the tokens read so far, reported with the final output, and
    # when the first token was read (`RequestOutput.first_token_time`).
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    first_token_time: float | None = None


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        tokenizer,
        eos_token_ids: list[int],
        num_blocks: int,
    ):
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.states: dict[str, _RequestState] = {}
        self._pending: list[RequestOutput] = []  # produced outside a step (aborts)
        self._grammar_release: list[str] = []  # finished constrained requests, not yet released
        self._in_flight: ScheduledBatch | None = None  # submitted, output not read yet (async)
        # Speculative decoding: drafts proposed, and accepted by a verification step.
        self.num_proposed_drafts = 0
        self.num_accepted_drafts = 0
        self._inputs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    # ---- inline API (the owning thread only) ----

    def add_request(self, seq: Sequence) -> None:
        """Accept a request (a constrained one waits in the scheduler for its grammar)."""
        params = seq.params
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        stop_ids = eos | frozenset(params.stop_token_ids)
        if params.min_tokens and not params.min_tokens_stop_ids:
            seq.params = dataclasses.replace(params, min_tokens_stop_ids=tuple(sorted(stop_ids)))
        self.states[seq.request_id] = _RequestState(
            seq, IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params), stop_ids
        )
        self.scheduler.add(seq)

    def abort_requests(self, request_ids: list[str]) -> None:
        for seq in self.scheduler.abort(request_ids):
            self._pending.append(self._output(self.states[seq.request_id]))
        self._flush_grammar_release()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.scheduler.num_waiting_for_grammar:
            outputs += self._poll_grammars()
        batch = self.scheduler.schedule()
        submitted = False
        if batch.seqs or batch.finished_seq_ids:
            submitted, failed = self._submit(batch)
            outputs += failed
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            outputs += self._read(previous)
        if submitted and self.config.async_scheduling:
            self._in_flight = batch
            if self.config.speculative_method is not None:
                outputs += self._propose(batch)
        elif submitted:
            outputs += self._read(batch)
            if self.config.speculative_method is not None:
                outputs += self._propose(batch)
        if self._in_flight is not None and not self.scheduler.has_unfinished():
            # Every request ended: what is left in flight belongs to finished requests only.
            # Reading it now lets the engine report idle at once.
            outputs += self._read(self._in_flight)
            self._in_flight = None
        if self.executor.dead_reason is not None:
            outputs += self._fail_all(self.executor.dead_reason)
        self._flush_grammar_release()
        return outputs

    def _fail_all(self, reason: str) -> list[RequestOutput]:
        """The ranks are gone: every request of this replica ends with an error (a batch in
        flight has no output to read any more)."""
        self._in_flight = None
        return [self._fail(seq, reason) for seq in list(self.scheduler.requests.values())]

    def _submit(self, batch: ScheduledBatch) -> tuple[bool, list[RequestOutput]]:
        """Queue one batch on the ranks; on failure its requests end with an error."""
        try:
            self.executor.submit_model(batch)
        except Exception as e:  # noqa: BLE001 - fail this batch's requests, keep serving
            logger.exception("model step failed")
            return False, [self._fail(seq, _failure(e)) for seq in list(batch.seqs)]
        return True, []

    def _read(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Read a submitted batch's output and process what it sampled."""
        self._decode_while_waiting()
        try:
            result = self.executor.take_output()
        except Exception as e:  # noqa: BLE001 - fail this batch's requests, keep serving
            logger.exception("model step failed")
            return [self._fail(seq, _failure(e)) for seq in batch.seqs if not seq.is_finished]
        more = result.more_token_ids
        processed = [
            self._process(seq, token, result.logprobs.get(seq.seq_id), more.get(seq.seq_id))
            for seq, token in self.scheduler.update(batch, result.token_ids, more)
        ]
        outputs = [out for out in processed if out is not None]
        if result.errors:  # structured-output failures end only their own requests
            for seq in batch.seqs:
                error = result.errors.get(seq.seq_id)
                if error is not None and not seq.is_finished:
                    outputs.append(self._fail(seq, error))
        return outputs

    def _decode_while_waiting(self) -> None:
        """Lazy text (`IncrementalDetokenizer`): until the device has the output about to be
        read, decode the tokens requests kept. That host time would otherwise go to waiting,
        and whatever is decoded here is not left for the final output, which decodes the rest
        at once on this thread (all of it for a final-only request)."""
        ready = self.executor.output_ready
        for i, state in enumerate(self.states.values()):
            if i % 4 == 0 and ready():
                return
            state.detokenizer.catch_up()

    def _propose(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Speculative decoding: the next drafts of the batch's sequences that sampled (with
        asynchronous scheduling the batch is still in flight: drafts for the step after it)."""
        rows = [
            (s, d)
            for s, samples, d in zip(batch.seqs, batch.sampling, batch.draft_token_ids, strict=True)
            if samples and not s.is_finished
        ]
        seqs = [s for s, _ in rows]
        in_flight = None
        if self.config.async_scheduling:  # drafts that follow a rejected one: likely wrong
            in_flight = [[] if s.drafts_missed else d for s, d in rows]
        max_drafts = [self.config.num_speculative_tokens] * len(seqs)
        if self.config.speculative_method == "draft":
            seqs, max_drafts = self._reserve_draft_slots(seqs)
        if not seqs:
            return []
        try:
            drafts = self.executor.propose_drafts(seqs, max_drafts, in_flight)
        except Exception as e:  # noqa: BLE001 - fail these requests, keep serving
            logger.exception("draft proposal failed")
            return [self._fail(seq, repr(e)) for seq in seqs]
        for seq in seqs:
            seq.draft_token_ids = drafts.get(seq.seq_id, [])
            self.num_proposed_drafts += len(seq.draft_token_ids)
        return []

    def _reserve_draft_slots(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """Blocks for the positions a draft model writes (`spec_decode/draft_model.py`): up to
        its last draft but one where the cache has them, else up to its last known token (no
        drafts: it only catches up); a sequence without even that sits this proposal out."""
        k = self.config.num_speculative_tokens
        kept, max_drafts = [], []
        for seq in seqs:
            known = seq.num_known_tokens
            if self.scheduler.reserve(seq, known + k - 1):
                kept.append(seq)
                max_drafts.append(k)
            elif self.scheduler.reserve(seq, known):
                kept.append(seq)
                max_drafts.append(0)
        return kept, max_drafts

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        self.scheduler.finish(seq, "error")
        return self._output(self.states[seq.request_id], error=error)

    def collective_rpc(self, method: str, *args, timeout: float | None = None, **kwargs) -> list:
        return self.executor.collective_rpc(method, *args, timeout=timeout, **kwargs)

    # ---- structured output ownership ----

    def _poll_grammars(self) -> list[RequestOutput]:
        """Ask every rank about the requests waiting for their grammar (see the module
        docstring): ready on every rank -> schedulable; an error on any rank -> finished with
        "error" (released on every rank with the other finished requests of this step)."""
        seqs = self.scheduler.waiting_for_grammar()
        items = [(s.request_id, s.params.structured_output) for s in seqs]
        try:
            per_rank: list[dict[str, AdmissionResult]] = self.executor.collective_rpc(
                "structured_output_prepare", items
            )
        except Exception as e:  # noqa: BLE001 - these requests fail, the engine keeps serving
            logger.exception("structured output: grammar preparation failed")
            return [self._fail(s, f"structured output: binding failed: {e!r}") for s in seqs]
        outputs = []
        for seq in seqs:
            answers = [rank_answers[seq.request_id] for rank_answers in per_rank]
            errors = [
                f"{a.message} (rank {i})" for i, a in enumerate(answers) if a.status == "error"
            ]
            if errors:
                outputs.append(self._fail(seq, f"structured output: {errors[0]}"))
            elif answers and all(a.status == "ready" for a in answers):
                self.scheduler.grammar_ready(seq)
        return outputs

    def release_structured(self, request_ids: list[str]) -> None:
        """Drop these requests' grammar state on every rank (idempotent on the workers; dead
        ranks hold nothing any more)."""
        if self.executor.dead_reason is None:
            self.executor.collective_rpc("structured_output_release", request_ids)

    def _flush_grammar_release(self) -> None:
        """Completion cleanup of constrained requests: a fire-and-forget utility command, so the
        thread delivering outputs never waits for its own reply. Ordinary requests send none."""
        if self._grammar_release:
            ids, self._grammar_release = self._grammar_release, []
            self.call_utility("release_structured", ids, wait=False)

    # ---- output processing ----

    def _process(
        self,
        seq: Sequence,
        token: int,
        logprob: TokenLogprob | None,
        more: list[int] | None = None,
    ) -> RequestOutput | None:
        """Detokenize a sequence's new token (and, after a verification step, the `more` it
        emitted, up to the first that stops it) and apply its stop conditions; its output, or
        None when only the final one is wanted (`SamplingParams.final_only`) and this is not
        it."""
        state = self.states[seq.request_id]
        self._stop_check(seq, state, token)
        if more:
            for extra in more:
                if seq.is_finished:
                    break
                self.scheduler.accept_draft(seq, extra)
                self.num_accepted_drafts += 1
                self._stop_check(seq, state, extra)
        if logprob is not None:
            state.logprobs.append(logprob)
        if seq.params.final_only:
            if state.first_token_time is None:
                state.first_token_time = time.perf_counter()
            if not seq.is_finished:
                return None
            out = self._output(state)
            out.first_token_time = state.first_token_time
            return out
        return self._output(state)

    def _stop_check(self, seq: Sequence, state: _RequestState, token: int) -> None:
        stop_str = state.detokenizer.push(token)
        if token in state.stop_ids:  # EOS, or one of its stop token ids
            eos = token in self.eos_token_ids and not seq.params.ignore_eos
            stop_token = None if eos else token
            self.scheduler.finish(seq, "stop", stop_token)
        elif stop_str is not None:
            self.scheduler.finish(seq, "stop", stop_str)
        elif seq.num_known_tokens >= seq.max_len:
            self.scheduler.finish(seq, "length")

    def _output(self, state: _RequestState, error: str | None = None) -> RequestOutput:
        """The request's output since its previous one (new tokens, text, logprobs)."""
        seq, detokenizer = state.seq, state.detokenizer
        finished = seq.is_finished
        start, end = seq.num_prompt_tokens, seq.num_known_tokens
        new_ids = seq.token_ids[start + state.num_reported : end]
        state.num_reported = end - start
        if finished:
            del self.states[seq.request_id]
            if seq.params.structured_output is not None:
                self._grammar_release.append(seq.request_id)
        text, delta = detokenizer.report(finished)
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs, state.logprobs = state.logprobs, []
        # Positional, in field order: keyword arguments cost three times as much, per request
        # per step.
        return RequestOutput(
            seq.request_id,
            seq.prompt_token_ids,
            TokenIdsPrefix(seq.token_ids, start, end),  # the output so far, copied when read
            new_ids,
            text,
            delta,
            finished,
            seq.finish_reason,
            seq.stop_reason,
            logprobs,
            error,
            seq.num_cached_tokens,
        )

    # ---- background busy loop ----

    @property
    def running_in_background(self) -> bool:
        return self._thread is not None

    @property
    def loop_alive(self) -> bool:
        """False once a started busy loop has ended (a bug, or shut down)."""
        return self._thread is None or self._thread.is_alive()

    def start(self, handler: OutputHandler) -> None:
        self._handler = handler
        self._thread = threading.Thread(
            target=self._busy_loop, name="atom-engine-core", daemon=True
        )
        self._thread.start()

    def submit_add(self, seq: Sequence) -> None:
        """Queue a request (fire-and-forget: whatever happens to it later is one of its
        outputs)."""
        self._command(("add", seq))

    def submit_abort(self, request_ids: list[str]) -> None:
        self._command(("abort", request_ids))

    def call_utility(self, method: str, *args, wait: bool = True, **kwargs) -> Future | None:
        """Run `self.<method>(*args, **kwargs)` on the loop thread. wait=True returns a Future
        with the result; wait=False is fire-and-forget."""
        future: Future | None = Future() if wait else None
        self._command(("utility", method, args, kwargs, future))
        return future

    def shutdown(self) -> None:
        if self._thread is not None:
            self._inputs.put(("shutdown",))
            self._thread.join(timeout=10)
            self._thread = None

    def _command(self, cmd: tuple) -> None:
        if self._thread is None:
            self._handle(cmd)  # inline mode: no loop thread to hand it to
        else:
            self._inputs.put(cmd)

    def _handle(self, cmd: tuple) -> bool:
        kind = cmd[0]
        if kind == "add":
            self.add_request(cmd[1])
        elif kind == "abort":
            self.abort_requests(cmd[1])
        elif kind == "utility":
            _, method, args, kwargs, future = cmd
            if future is not None and not future.set_running_or_notify_cancel():
                return True  # the caller gave up before it ran
            try:
                result = getattr(self, method)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - reported to the caller
                if future is None:
                    logger.exception("utility command %s failed", method)
                else:
                    future.set_exception(e)
            else:
                if future is not None:
                    future.set_result(result)
        return kind != "shutdown"

    def _busy_loop(self) -> None:
        while True:
            try:
                cmd = self._next_command()
                while True:
                    if not self._handle(cmd):
                        return
                    cmd = self._inputs.get_nowait()
            except queue.Empty:
                pass
            try:
                outputs = self.step()
            except Exception:  # noqa: BLE001 - the loop must survive; step already fails requests
                logger.exception("engine step failed")
                continue
            if outputs:
                self._handler(outputs)

    def _next_command(self) -> tuple:
        """Block while idle; pause between grammar polls while nothing else can run; else do
        not wait (raises `queue.Empty`)."""
        if not self.has_unfinished():
            return self._inputs.get()
        if (
            not self._pending
            and self._in_flight is None
            and self.scheduler.only_waiting_for_grammar()
        ):
            return self._inputs.get(timeout=GRAMMAR_POLL_S)
        return self._inputs.get_nowait()
