"""Per-worker structured-output state: admission, cached compilation, per-request grammar state.

A request's life on a rank (``worker.StructuredOutputWorker`` does the wiring):

1. ``admit(spec, ...)`` before it is enqueued: compatibility checks, compilation started;
2. ``prepare(request_id, spec)`` while it waits in the scheduler: its own matcher once the
   grammar is compiled;
3. per decoding step, ``fill_masks(rows, batch)``: for each request its committed-state row (the
   rows of all requests at once, on llguidance's executor threads), then one row per draft
   prefix (drafts are consumed speculatively and rolled back in a ``finally``); the worker
   applies the rows to the target/bonus logits (``utils.MaskBuffers``);
4. ``commit(request_id, new_token_ids)`` (``commit_many`` for a step) once the scheduler
   acknowledges sampled tokens;
5. ``release(request_id)`` on any terminal path.

Compilation runs in a background thread; the ready-cache lock is held only for dictionary
updates, never across compilation. A request's matcher is a ``deep_copy`` of a compiled
template (of the grammar's least used lane: ``grammar_lanes``), so it keeps the grammar after
cache eviction. A grammar failure marks only its request.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from atom.config import EngineConfig, StructuredOutputWhitespace, default_grammar_threads
from atom.structured_output.backend_guidance import GrammarError, GuidanceBackend
from atom.structured_output.grammar_lanes import CompiledGrammar
from atom.structured_output.json_keys import KeyTokenIndex, KeyTracker, may_repeat_keys

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher

__all__ = ["AdmissionResult", "GrammarState", "StructuredOutputManager", "new_mask_executor"]

JSON_WHITESPACE = b" \t\r\n"
REJECTED = "structured output: the grammar rejected a generated token"
REPEATED = "structured output: the answer repeats an object key"
# A request moves to a new grammar lane only while its replay stays short: a move replays the
# committed tokens on the grammar thread, in the step that moves it.
MAX_REPLAY_TOKENS = 512


@dataclass(frozen=True)
class AdmissionResult:
    status: Literal["ready", "pending", "error"]
    message: str = ""


@dataclass(frozen=True)
class _Failed:
    message: str


def new_mask_executor(threads: int) -> LLExecutor | None:
    """An llguidance executor of ``threads`` threads that fills and commits the rows of
    different requests at once; None for one thread (the caller's thread does it)."""
    from llguidance import LLExecutor

    return LLExecutor(threads) if threads > 1 else None


def _grammar_source(spec: Any) -> tuple[str, dict | bool | str]:
    """(cache key, lowered schema) of a ``PreparedSchema`` or an ``OutputConstraint``."""
    prepared = getattr(spec, "prepared", spec)
    return prepared.key, prepared.lowered


class _NoKeys:
    """The key tracker of an answer that is not JSON: nothing to watch, nothing repeated."""

    repeated = False
    guard = False

    def feed(self, data: bytes) -> None:
        return None

    def copy(self) -> _NoKeys:
        return self


_NO_KEYS = _NoKeys()


class GrammarState:
    """One request's grammar: its own matcher plus the reasoning-activation state.

    With an ``end_marker`` the state starts inactive (unconstrained) and watches the output bytes;
    once the marker text has fully appeared, whether as one token or as byte pieces, the grammar
    is active. Bytes after the marker inside the same token are fed to the matcher (leading JSON
    whitespace is dropped: it is insignificant to the answer, and llguidance's JSON grammar does
    not start with whitespace).

    The bytes the matcher consumes also feed a ``KeyTracker``: the mask forbids tokens that would
    repeat a key in an object (llguidance allows it where keys are free), see ``json_keys``.
    """

    def __init__(
        self,
        request_id: str,
        matcher: LLMatcher,
        backend: GuidanceBackend,
        masks: dict[str, torch.Tensor],
        end_marker: bytes | None,
        key_index: KeyTokenIndex,
        json_answer: bool = True,
        free_keys: bool = True,
    ) -> None:
        self.request_id = request_id
        self.error: str | None = None
        self.lane = 0  # the grammar lane its matcher was copied from (``grammar_lanes``)
        self._use(matcher)
        # The tokens the matcher consumed for committed ones, in order: ``move_to`` replays them.
        self._matcher_tokens: list[int] = []
        self._backend = backend
        # Rows are written through ``uint32`` views: no torch indexing per row.
        self._stop_words = masks["stop"].numpy().view(np.uint32)
        self._free_words = masks["free"].numpy().view(np.uint32)
        self._token_bytes = backend.token_bytes
        self._marker = end_marker or b""
        self.active = not self._marker
        self._tail = b""
        self._key_index = key_index
        # Only a JSON answer has keys (a text constraint's, ``text_constraints``, never does),
        # and only free ones can repeat (``free_keys``: ``json_keys.may_repeat_keys``).
        self._json = json_answer
        self._tracks_keys = json_answer and free_keys
        self.keys = KeyTracker(key_index.watched) if self._tracks_keys else _NO_KEYS
        # The bytes the matcher consumed while keys are tracked: rollback replays ``keys``.
        self._answer = bytearray()
        # Per committed token: (matcher tokens consumed, active, tail, answer length) before it.
        self._history: list[tuple[int, bool, bytes, int]] = []

    def _use(self, matcher: LLMatcher) -> None:
        self.matcher = matcher
        # Bound methods of the per-token paths, looked up once (see ``wants_mask``, ``commit``).
        self._compute_mask_ptr = matcher.unsafe_compute_mask_ptr
        self._is_stopped = matcher.is_stopped
        self._is_error = matcher.is_error
        self._consume_token = matcher.consume_token

    @property
    def movable(self) -> bool:
        """Whether ``move_to`` may take this state: not failed, its grammar not finished
        (llguidance 1.9.1 replays no EOS after a stop), at most ``MAX_REPLAY_TOKENS`` to
        replay."""
        return (
            self.error is None
            and len(self._matcher_tokens) <= MAX_REPLAY_TOKENS
            and not self._is_stopped()
        )

    def move_to(self, template: LLMatcher, lane: int) -> bool:
        """Go on with a copy of ``template`` (another lane of this state's grammar) that has
        consumed what this state's matcher consumed; False, and nothing changed, if the copy
        refuses it. Only for a ``movable`` state between steps (no draft consumed)."""
        matcher = template.deep_copy()
        if self._matcher_tokens and not matcher.consume_tokens(self._matcher_tokens):
            return False
        self._use(matcher)
        self.lane = lane
        return True

    @property
    def finished(self) -> bool:
        """The grammar accepted EOS (or can take nothing but EOS)."""
        return self.active and self.matcher.is_stopped() and not self.matcher.is_error()

    def _consume(self, tokens: Sequence[int], speculative: bool) -> bool:
        if not tokens:
            return True
        if speculative:  # never drive the committed matcher into its sticky error state
            return self.matcher.try_consume_tokens(list(tokens)) == len(tokens)
        # One at a time: llguidance 1.9.1 accepts EOS after a stop only through consume_token.
        ok = all(self._consume_token(t) for t in tokens)
        if ok:
            self._matcher_tokens += tokens
        return ok

    def _feed(self, data: bytes) -> None:
        if self._tracks_keys:
            self.keys.feed(data)
            self._answer += data

    def _advance(self, token: int, speculative: bool) -> tuple[bool, int]:
        """Feed one output token; returns (accepted, matcher tokens consumed)."""
        if self.active:  # the common case: one matcher call, then the token's bytes
            if speculative:
                ok = self.matcher.try_consume_tokens([token]) == 1
            else:
                ok = self._consume_token(token)
                if ok:
                    self._matcher_tokens.append(token)
            if ok:
                self._feed(self._token_bytes(token))
            return ok, int(ok)
        data = self._tail + self._token_bytes(token)
        at = data.find(self._marker)
        if at < 0:
            self._tail = data[len(data) - len(self._marker) + 1 :]
            return True, 0
        self.active, self._tail = True, b""
        rest = data[at + len(self._marker) :]
        rest = rest.lstrip(JSON_WHITESPACE) if self._json else rest
        if not rest:
            return True, 0
        extra = self._backend.tokenize_bytes(rest)
        if not speculative:
            ok = self._consume(extra, speculative=False)
            if ok:
                self._feed(rest)
            return ok, len(extra)
        consumed = self.matcher.try_consume_tokens(extra)
        if consumed == len(extra):
            self._feed(rest)
            return True, consumed
        if consumed:
            self.matcher.rollback(consumed)
        return False, 0

    def commit(self, tokens: Sequence[int]) -> bool:
        """Advance the committed state; a rejected token marks this request failed."""
        for token in tokens:
            if self.error is not None:
                return False
            before = (self.active, self._tail, len(self._answer))
            ok, consumed = self._advance(token, speculative=False)
            if not ok:
                self.error = REJECTED
                return False
            self._history.append((consumed, *before))
            if self.keys.repeated:  # only a token the mask never saw (after the end marker)
                self.error = REPEATED
        return self.error is None

    def consumed(self, token: int, ok: bool) -> None:
        """``commit([token])`` of an active state without error, once its matcher was given
        ``token`` (``ok``: accepted) with other requests' on llguidance's executor
        (``StructuredOutputManager.commit_many``): the same steps, inlined."""
        if not ok:
            self.error = REJECTED
            return
        self._history.append((1, self.active, self._tail, len(self._answer)))
        self._matcher_tokens.append(token)
        if self._tracks_keys:
            data = self._token_bytes(token)
            self.keys.feed(data)
            self._answer += data
            if self.keys.repeated:
                self.error = REPEATED

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` commits (replay of unacknowledged tokens)."""
        if num_tokens > len(self._history):
            raise ValueError("cannot roll back more tokens than were committed")
        undo = self._history[len(self._history) - num_tokens :]
        del self._history[len(self._history) - num_tokens :]
        consumed = sum(n for n, _, _, _ in undo)
        if consumed and not self.matcher.rollback(consumed):
            self.error = "structured output: grammar rollback failed"
        del self._matcher_tokens[len(self._matcher_tokens) - consumed :]
        if undo:
            _, self.active, self._tail, answer_length = undo[0]
            del self._answer[answer_length:]
            if self._tracks_keys:
                self.keys = KeyTracker.replay(bytes(self._answer), self._key_index.watched)

    def wants_mask(self, words: np.ndarray, row: int) -> bool:
        """Whether ``row`` needs llguidance's mask (then ``check_row`` once it is written);
        otherwise the row gets its mask here: stop when the grammar terminated (only EOS
        remains) or failed, free while still reasoning (unconstrained until the end marker)."""
        if self.active and self.error is None and not self._is_stopped():
            return True
        words[row] = self._stop_words if self.active or self.error is not None else self._free_words
        return False

    def check_row(self, words: np.ndarray, row: int, speculative: bool = False) -> None:
        """After llguidance wrote ``row``: a matcher that failed computing it fails the request
        (stop mask); only a state that might write a repeated key (``KeyTracker.guard``) has
        its row filtered. ``speculative``: the state after draft tokens (see
        ``_forbid_repeated_keys``)."""
        if self._is_error():
            self.error = "structured output: grammar failure"
            words[row] = self._stop_words
        elif self.keys.guard:
            self._forbid_repeated_keys(words[row], speculative)

    def fill_row(
        self, words: np.ndarray, row: int, base: int, row_bytes: int, speculative: bool = False
    ) -> None:
        """Write this state's next-token mask into row ``row`` of a buffer the manager
        validated (``base``: its data pointer, ``row_bytes`` per row, ``words``: its ``uint32``
        view), on the caller's thread."""
        if self.wants_mask(words, row):
            self._compute_mask_ptr(base + row * row_bytes, row_bytes)
            self.check_row(words, row, speculative)

    def _forbid_repeated_keys(self, words: np.ndarray, speculative: bool) -> None:
        """Clear from an llguidance row (a ``uint32`` view) the tokens that would repeat a key.

        If nothing is left (every continuation repeats a key), the row gets the stop mask, so a
        forbidden token is never sampled, and the request fails with a grammar error; after
        draft tokens (``speculative``) only the row does, as the drafts may not be accepted.
        """
        if self._key_index.forbid(self.keys, words) and not words.any():
            words[:] = self._stop_words
            if not speculative:
                self.error = "structured output: every continuation repeats an object key"

    def fill_draft_rows(
        self, words: np.ndarray, row: int, drafts: Sequence[int], base: int, row_bytes: int
    ) -> None:
        """Rows ``row + 1 .. row + len(drafts)``: the mask after each draft prefix, one after
        the other (row ``row``, the committed state's, is already filled); state unchanged.

        Rows after a draft the grammar rejects, or after a failure, are unreachable and get the
        stop mask. ``words``, ``base``, ``row_bytes``: see ``fill_row``.
        """
        saved = (self.active, self._tail, self.keys, len(self._answer))
        self.keys = self.keys.copy()
        consumed = 0
        try:
            for j, draft in enumerate(drafts, start=1):
                ok = self.error is None
                if ok:
                    ok, n = self._advance(draft, speculative=True)
                    consumed += n
                if not ok or self.keys.repeated:  # a repeated key: the mask forbade this draft
                    words[row + j : row + len(drafts) + 1] = self._stop_words
                    break
                self.fill_row(words, row + j, base, row_bytes, speculative=True)
        finally:
            if consumed:
                self.matcher.rollback(consumed)
            self.active, self._tail, self.keys, answer_length = saved
            del self._answer[answer_length:]


class StructuredOutputManager:
    """One per worker (rank): admission, a bounded compile cache, live request states."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        vocab_size: int,
        lm_head_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_size: int = 64,
        compile_threads: int = 1,
        threads: int | None = None,
        whitespace: StructuredOutputWhitespace = EngineConfig.structured_output_whitespace,
    ) -> None:
        """``threads``: llguidance executor threads filling the rows of different requests at
        once (``EngineConfig.structured_output_threads``; default ``default_grammar_threads()``);
        1 fills them one by one on the caller's thread."""
        from atom.structured_output.backend_guidance import tokenizer_fingerprint

        self.threads = default_grammar_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError("structured output needs at least one mask thread")

        self.vocab_size = vocab_size
        self.lm_head_size = lm_head_size or vocab_size
        if self.lm_head_size < vocab_size:
            raise ValueError("the LM head is smaller than the configured vocabulary")
        self.backend = GuidanceBackend(hf_tokenizer, self.lm_head_size, stop_token_ids, whitespace)
        self.fingerprint = tokenizer_fingerprint(
            hf_tokenizer, self.backend.stop_token_ids, vocab_size
        )
        real = range(self.backend.tokenizer_size)
        self.masks = {
            "stop": torch.from_numpy(self.backend.token_mask(self.backend.stop_token_ids)),
            "free": torch.from_numpy(self.backend.token_mask(real)),
        }
        self.key_index = KeyTokenIndex(self.backend.token_table[: len(real)])
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ready: OrderedDict[str, CompiledGrammar | _Failed] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._states: dict[str, GrammarState] = {}
        self._grammars: dict[str, CompiledGrammar] = {}  # the grammar each live state is bound to
        # Requests waiting for a compile, by id: the future holds the result, so a grammar
        # evicted from the cache before the request's next ``prepare`` is not compiled again.
        self._waiting: dict[str, Future] = {}
        # The last mask buffer given to ``fill_masks``, its validated geometry and uint32 view.
        self._mask_geometry: tuple[torch.Tensor, int, int, int, np.ndarray] | None = None
        self._executor = ThreadPoolExecutor(compile_threads, thread_name_prefix="atom-grammar")
        self._lane_executor = ThreadPoolExecutor(1, thread_name_prefix="atom-grammar-lanes")
        # What fills and commits the rows of different requests at once (None: one by one on
        # the caller's thread). A grammar process replaces it gate by gate: one over every spare
        # core when no other process has rows in the gate, else one over its own share.
        self.mask_executor: LLExecutor | None = new_mask_executor(self.threads)
        self._lane_added = False  # since the last ``_spread_lanes``

    # ---- admission ---------------------------------------------------------------------------

    def admit(
        self, spec: Any, api_fingerprint: str, vocab_size: int, wait_s: float = 0.0
    ) -> AdmissionResult:
        """Check compatibility, then report the grammar ready, pending (compiling) or an error.

        Admission RPCs poll: the first call starts a background compile and usually answers
        ``pending``; ``wait_s`` bounds how long this call may wait for it (outside the lock).
        """
        from atom import envs

        if envs.enable_relaxed_mtp():
            return AdmissionResult("error", "structured output is disabled with relaxed MTP")
        if api_fingerprint != self.fingerprint:
            return AdmissionResult(
                "error", "the API tokenizer or stop tokens differ from the worker's"
            )
        if vocab_size != self.vocab_size:
            return AdmissionResult(
                "error",
                f"configured vocabulary {vocab_size} does not match the LM head "
                f"({self.vocab_size})",
            )
        found = self._lookup(*_grammar_source(spec))
        if isinstance(found, Future):
            if wait_s > 0:
                wait_futures([found], timeout=wait_s)
            if not found.done():
                return AdmissionResult("pending")
            found = found.result()
        return self._result(found)

    def _lookup(self, key: str, lowered: dict | bool | str) -> CompiledGrammar | _Failed | Future:
        """The cached entry of ``key``, else the future of its compile (started if needed)."""
        with self._lock:
            entry = self._ready.get(key)
            if entry is not None:
                self._ready.move_to_end(key)
                return entry
            future = self._pending.get(key)
            if future is None:
                future = self._executor.submit(self._compile, key, lowered)
                self._pending[key] = future
            return future

    @staticmethod
    def _result(entry: CompiledGrammar | _Failed) -> AdmissionResult:
        if isinstance(entry, _Failed):
            return AdmissionResult("error", entry.message)
        return AdmissionResult("ready")

    def _compile(self, key: str, lowered: dict | bool | str) -> CompiledGrammar | _Failed:
        """Background thread: compile without the lock, then publish under it."""
        try:
            compile_again = self.backend.compiler(lowered)
            start = time.perf_counter()
            template = compile_again()
            entry: CompiledGrammar | _Failed = CompiledGrammar(
                compile_again, template, time.perf_counter() - start, may_repeat_keys(lowered)
            )
        except GrammarError as exc:
            entry = _Failed(f"schema not supported: {exc}")
        except Exception as exc:  # noqa: BLE001 - any compiler failure is this schema's error
            entry = _Failed(f"grammar compilation failed: {type(exc).__name__}")
        with self._lock:
            self._pending.pop(key, None)
            self._ready[key] = entry
            self._ready.move_to_end(key)
            while len(self._ready) > self.cache_size:
                self._ready.popitem(last=False)
        return entry

    # ---- request states ----------------------------------------------------------------------

    def prepare(self, request_id: str, spec: Any) -> AdmissionResult:
        """Give a request its own matcher once its grammar is compiled; never waits.

        Polled while the request waits in the scheduler: ``ready`` once bound (and on every
        later call), ``pending`` while the grammar compiles in the background (a grammar
        evicted since admission is compiled again there, never on the caller's thread), or
        ``error`` when it cannot compile. ``spec``: what ``admit`` takes, usually a
        ``spec.StructuredOutputSpec`` (its ``end_marker`` delays the grammar past reasoning).
        """
        if request_id in self._states:
            return AdmissionResult("ready")
        found = self._waiting.pop(request_id, None) or self._lookup(*_grammar_source(spec))
        if isinstance(found, Future):
            if not found.done():
                self._waiting[request_id] = found
                return AdmissionResult("pending")
            found = found.result()
        if isinstance(found, _Failed):
            return AdmissionResult("error", found.message)
        matcher, lane = found.bind()
        state = GrammarState(
            request_id,
            matcher,
            self.backend,
            self.masks,
            getattr(spec, "end_marker", None),
            self.key_index,
            json_answer=not isinstance(_grammar_source(spec)[1], str),
            free_keys=found.free_keys,
        )
        state.lane = lane
        with self._lock:
            self._states[request_id] = state
            self._grammars[request_id] = found
        self._grow(found)
        return AdmissionResult("ready")

    def _grow(self, grammar: CompiledGrammar) -> None:
        """Compile another lane of ``grammar`` in the background if it wants one."""
        if grammar.wants_lane(self.threads):
            grammar.growing = True
            self._lane_executor.submit(self._add_lane, grammar)

    def _add_lane(self, grammar: CompiledGrammar) -> None:
        """Background thread: one more independently compiled template (``grammar_lanes``),
        then another while the grammar's live requests still outnumber its lanes."""
        try:
            grammar.add_lane(grammar.compile())
            self._lane_added = True
        except Exception:  # noqa: BLE001 - it compiled once; without a lane it only runs slower
            grammar.stop_growing()
        finally:
            grammar.growing = False
        self._grow(grammar)

    def _spread_lanes(self) -> None:
        """Move live requests from crowded lanes to lanes added since the last call (requests
        bound together all went to the lanes that existed then: ``grammar_lanes``)."""
        self._lane_added = False
        for request_id, grammar in list(self._grammars.items()):
            state = self._states.get(request_id)
            if state is None or not state.movable:
                continue
            lane = state.lane
            moved = grammar.move(lane)
            if moved is not None and not state.move_to(moved[1], moved[0]):
                grammar.move_back(moved[0], lane)

    def state(self, request_id: str) -> GrammarState | None:
        return self._states.get(request_id)

    def release(self, request_id: str) -> None:
        """Drop a request's state; idempotent (every terminal path may call it)."""
        with self._lock:
            state = self._states.pop(request_id, None)
            grammar = self._grammars.pop(request_id, None)
        self._waiting.pop(request_id, None)
        if state is not None and grammar is not None:
            grammar.unbind(state.lane)

    def commit(self, request_id: str, new_token_ids: Sequence[int]) -> bool:
        """Advance the committed state; False (and ``error(request_id)``) on a grammar failure."""
        return self._states[request_id].commit(new_token_ids)

    def commit_many(self, updates: Iterable[tuple[str, Sequence[int]]]) -> None:
        """A step's ``commit``s in one call, skipping requests without a state here (the mask
        fails those); a rejected token marks only its request (``error``).

        The matchers of active requests that commit one token (a decode step) consume it at
        once on llguidance's executor (``consume_token_par``: ``consume_token`` on each, in
        parallel); any other commit (several tokens, reasoning, a failed request) runs as
        ``commit``, as does everything when a request is listed twice (order matters then).
        On 7 cores of the H200's host the executor took 0.49 ms for 128 integer-array rows
        where consuming in turn took 0.70 (``bench_grammar_step.py``'s consume columns,
        benchmarks/results/h200_2026-12-04k); on this repo's 2-core CPU machine they tie.
        """
        updates, states, executor = list(updates), self._states, self.mask_executor
        if executor is None or len({request_id for request_id, _ in updates}) < len(updates):
            for request_id, tokens in updates:
                if request_id in states:
                    states[request_id].commit(tokens)
            return
        single: list[tuple[GrammarState, int]] = []
        for request_id, tokens in updates:
            state = states.get(request_id)
            if state is None:
                continue
            if len(tokens) == 1 and state.active and state.error is None:
                single.append((state, tokens[0]))
            else:
                state.commit(tokens)
        if not single:  # llguidance 1.9.1 refuses an empty call
            return
        single.sort(key=lambda job: job[0].lane)  # one lane per thread, mostly: grammar_lanes
        accepted = executor.consume_token_par([(state.matcher, t) for state, t in single])
        for (state, token), ok in zip(single, accepted, strict=True):
            state.consumed(token, ok)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        self._states[request_id].rollback(num_tokens)

    def error(self, request_id: str) -> str | None:
        state = self._states.get(request_id)
        return None if state is None else state.error

    def fill_masks(self, bitmask: torch.Tensor, batch: Sequence[tuple[str, Sequence[int]]]) -> int:
        """Fill consecutive rows from row 0: per request, ``1 + len(drafts)`` rows in order.

        Returns the number of rows filled. ``bitmask`` is validated when it is first seen (a
        buffer must not be resized or re-pointed in place afterwards; ``MaskBuffers`` never
        does). The committed-state rows of all requests are computed by llguidance at once,
        on its executor's threads (``threads``), writing straight into the rows; then each is
        checked (``GrammarState.check_row``: one matcher call, plus the repeated-key filter
        only where a key could be repeated); draft rows follow, one request's after another.
        First, requests move to lanes added since the last step (``_spread_lanes``).
        """
        if self._lane_added:
            self._spread_lanes()
        geometry = self._mask_geometry
        if geometry is None or geometry[0] is not bitmask:
            geometry = self._mask_geometry = self._validate_mask(bitmask)
        _, base, num_rows, row_bytes, words = geometry
        if len(batch) > num_rows:
            raise IndexError(f"{len(batch)} rows exceed a {num_rows}-row mask")
        jobs: list[tuple[LLMatcher, int]] = []  # what llguidance computes: (matcher, row)
        computed: list[GrammarState] = []  # the state of each job
        drafted: list[tuple[GrammarState, int, Sequence[int]]] = []
        states, extra = self._states, 0  # extra: draft rows so far (request i: row i + extra)
        for i, (request_id, drafts) in enumerate(batch):
            state, row = states[request_id], i + extra
            if drafts:
                needed = len(batch) + extra + len(drafts)
                if needed > num_rows:
                    raise IndexError(f"{needed} rows exceed a {num_rows}-row mask")
                drafted.append((state, row, drafts))
                extra += len(drafts)
            if state.wants_mask(words, row):
                jobs.append((state.matcher, row))
                computed.append(state)
        if self.mask_executor is not None and len(jobs) > 1:  # one lane per thread, mostly
            order = sorted(range(len(jobs)), key=lambda k: computed[k].lane)
            jobs, computed = [jobs[k] for k in order], [computed[k] for k in order]
        self._compute_rows(jobs, base, row_bytes, num_rows)
        for state, (_, job_row) in zip(computed, jobs, strict=True):
            state.check_row(words, job_row)
        for state, first, drafts in drafted:
            state.fill_draft_rows(words, first, drafts, base, row_bytes)
        return len(batch) + extra

    def _compute_rows(
        self, jobs: list[tuple[LLMatcher, int]], base: int, row_bytes: int, num_rows: int
    ) -> None:
        """llguidance's mask of each (matcher, row), written through the buffer's pointer."""
        if self.mask_executor is not None and len(jobs) > 1:
            try:
                self.mask_executor.unsafe_compute_mask_ptr(jobs, base, row_bytes, num_rows)
                return
            except RuntimeError:  # "Already borrowed": one request listed twice; one by one
                pass
        for matcher, row in jobs:
            matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)

    def _validate_mask(
        self, bitmask: torch.Tensor
    ) -> tuple[torch.Tensor, int, int, int, np.ndarray]:
        """(bitmask, data pointer, rows, bytes per row, ``uint32`` view) of a buffer llguidance
        may write into."""
        if (
            bitmask.dtype is not torch.int32
            or not bitmask.is_cpu
            or bitmask.dim() != 2
            or not bitmask.is_contiguous()
        ):
            raise ValueError("bitmask must be a contiguous 2-D int32 CPU tensor")
        num_rows, words = bitmask.shape
        if words * 32 < self.lm_head_size:
            raise ValueError(f"bitmask rows of {words} words are too short for the vocabulary")
        return bitmask, bitmask.data_ptr(), num_rows, words * 4, bitmask.numpy().view(np.uint32)

    # ---- counters and shutdown ---------------------------------------------------------------

    @property
    def num_live_states(self) -> int:
        return len(self._states)

    @property
    def num_cached_grammars(self) -> int:
        return len(self._ready)

    @property
    def num_lanes(self) -> int:
        """Compiled templates of the cached grammars (``grammar_lanes``)."""
        with self._lock:
            entries = list(self._ready.values())
        return sum(e.num_lanes for e in entries if isinstance(e, CompiledGrammar))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._lane_executor.shutdown(wait=False, cancel_futures=True)
