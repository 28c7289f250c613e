"""One replica's engine: scheduler + executor + output processing.

It can be stepped inline (offline `LLM`) or run as a busy loop in a background thread (server),
fed through an input queue of commands: add, abort and utility calls. A utility call runs a method
of this core on the loop thread, either awaited (a Future) or fire-and-forget.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from atom.config import EngineConfig
from atom.model_engine.block_manager import BlockManager
from atom.model_engine.detokenizer import IncrementalDetokenizer
from atom.model_engine.executor import Executor
from atom.model_engine.output import RequestOutput, TokenLogprob
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import Sequence

logger = logging.getLogger(__name__)

OutputHandler = Callable[[list[RequestOutput]], None]


class SubmissionRejected(ValueError):
    """A rank refused to bind a constrained request at submission; nothing stays bound."""


class GrammarPending(Exception):
    """A grammar evicted since admission is recompiling in a worker's background executor;
    nothing was bound or enqueued: submit again shortly (the engine loop never compiles)."""


@dataclass
class _RequestState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    num_reported: int = 0


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
        self.eos_token_ids = set(eos_token_ids)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.states: dict[str, _RequestState] = {}
        self._pending: list[RequestOutput] = []  # produced outside a step (aborts)
        self._grammar_release: list[str] = []  # finished constrained requests, not yet released
        self._inputs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    # ---- inline API (the owning thread only) ----

    def add_request(self, seq: Sequence) -> None:
        """Accept a request. A constrained one is first bound on every rank (its own matcher, so
        cache eviction after this point cannot matter); a bind failure raises with nothing
        bound and nothing enqueued."""
        constrained = seq.params.structured_output is not None
        if constrained:
            self._bind_structured([seq])
        try:
            self.states[seq.request_id] = _RequestState(
                seq, IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params)
            )
            self.scheduler.add(seq)
        except BaseException:
            self.states.pop(seq.request_id, None)
            if constrained:
                self.release_structured([seq.request_id])
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for seq in self.scheduler.abort(request_ids):
            self._pending.append(self._output(self.states[seq.request_id], []))
        self._flush_grammar_release()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch.seqs and not batch.finished_seq_ids:
            return outputs
        try:
            result = self.executor.execute_model(batch)
        except Exception as e:  # noqa: BLE001 - fail this batch's requests, keep serving
            logger.exception("model step failed")
            for seq in list(batch.seqs):
                self.scheduler.finish(seq, "error")
                outputs.append(self._output(self.states[seq.request_id], [], error=repr(e)))
            self._flush_grammar_release()
            return outputs
        for seq in self.scheduler.update(batch, result.token_ids):
            outputs.append(self._process(seq, result.logprobs.get(seq.seq_id)))
        if result.errors:  # structured-output failures end only their own requests
            for seq in batch.seqs:
                error = result.errors.get(seq.seq_id)
                if error is not None and not seq.is_finished:
                    self.scheduler.finish(seq, "error")
                    outputs.append(self._output(self.states[seq.request_id], [], error=error))
        self._flush_grammar_release()
        return outputs

    def collective_rpc(self, method: str, *args, timeout: float | None = None, **kwargs) -> list:
        return self.executor.collective_rpc(method, *args, timeout=timeout, **kwargs)

    # ---- structured output ownership ----

    def _bind_structured(self, seqs: list[Sequence]) -> None:
        """Bind these constrained requests on every rank through the executor (collective).
        On any failure the locally held list is released on every rank (idempotent there) and
        the submission fails: `GrammarPending` (retry) or `SubmissionRejected`."""
        ids = [s.request_id for s in seqs]
        items = [(s.request_id, s.params.structured_output) for s in seqs]
        try:
            results = self.executor.collective_rpc("structured_output_bind", items)
        except Exception as e:
            self.release_structured(ids)
            raise SubmissionRejected(f"structured output: binding failed: {e!r}") from None
        failed = [r for r in results if r.get("status") != "ok"]
        if not failed and results:
            return
        self.release_structured(ids)
        errors = [r for r in failed if r.get("status") != "pending"]
        if errors or not results:
            r = errors[0] if errors else {"rank": "?", "message": "no rank answered"}
            message = r.get("message") or "structured output: binding failed"
            raise SubmissionRejected(f"{message} (rank {r.get('rank', '?')})")
        raise GrammarPending(ids)

    def release_structured(self, request_ids: list[str]) -> None:
        """Drop these requests' grammar state on every rank (idempotent on the workers)."""
        self.executor.collective_rpc("structured_output_release", request_ids)

    def _flush_grammar_release(self) -> None:
        """Completion cleanup of constrained requests: a fire-and-forget utility command, so the
        thread delivering outputs never waits for its own reply. Ordinary requests send none."""
        if self._grammar_release:
            ids, self._grammar_release = self._grammar_release, []
            self.call_utility("release_structured", ids, wait=False)

    # ---- output processing ----

    def _process(self, seq: Sequence, logprob: TokenLogprob | None) -> RequestOutput:
        state = self.states[seq.request_id]
        token = seq.token_ids[-1]
        stop_str = state.detokenizer.add(token)
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            self.scheduler.finish(seq, "stop")
        elif token in params.stop_token_ids:
            self.scheduler.finish(seq, "stop", token)
        elif stop_str is not None:
            self.scheduler.finish(seq, "stop", stop_str)
        elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.config.max_model_len:
            self.scheduler.finish(seq, "length")
        return self._output(state, [logprob] if logprob is not None else [])

    def _output(
        self, state: _RequestState, logprobs: list[TokenLogprob], error: str | None = None
    ) -> RequestOutput:
        seq = state.seq
        output_ids = seq.output_token_ids
        new_ids = output_ids[state.num_reported :]
        state.num_reported = len(output_ids)
        if seq.is_finished:
            state.detokenizer.flush()
        delta = state.detokenizer.take_delta(seq.is_finished)
        if seq.is_finished:
            del self.states[seq.request_id]
            if seq.params.structured_output is not None:
                self._grammar_release.append(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=output_ids,
            new_token_ids=new_ids,
            text=state.detokenizer.emitted_text,
            delta_text=delta,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=logprobs if seq.params.logprobs is not None else None,
            error=error,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # ---- background busy loop ----

    @property
    def running_in_background(self) -> bool:
        return self._thread is not None

    def start(self, handler: OutputHandler) -> None:
        self._handler = handler
        self._thread = threading.Thread(
            target=self._busy_loop, name="atom-engine-core", daemon=True
        )
        self._thread.start()

    def submit_add(self, seq: Sequence) -> Future | None:
        """Queue a request. A constrained one gets a Future settled once it was bound on every
        rank and enqueued (result None) or refused (`SubmissionRejected` / `GrammarPending`);
        ordinary requests stay fire-and-forget."""
        future: Future | None = None
        if seq.params.structured_output is not None:
            future = Future()
        self._command(("add", seq, future))
        return future

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
            _, seq, future = cmd
            if future is None:
                self.add_request(seq)
            elif future.set_running_or_notify_cancel():  # else the submitter gave up first
                try:
                    self.add_request(seq)
                except Exception as e:  # noqa: BLE001 - reported to the submitter
                    future.set_exception(e)
                else:
                    future.set_result(None)
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
            idle = not self.has_unfinished()
            try:
                cmd = self._inputs.get(block=idle)
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
