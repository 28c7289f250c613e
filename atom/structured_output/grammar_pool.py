"""A rank's grammar processes: its constrained requests split over one or more children.

One child's llguidance executor scales poorly past about 8 threads, and its per-row Python runs
on one interpreter: on the H200's 16-core host, one child took 3.05 ms for a step of 256
integer-array rows, two children of 128 rows each on their own half of the cores 1.76 ms beside
each other (benchmarks/results/h200_2026-12-04d), under the 1.75 ms of the decode step they
hide behind. So a rank may start several (``EngineConfig.grammar_processes``), each pinned to its
own share of the cores (``split_cores``), and gives each new request an "owner" when the engine
first prepares it: the first child while it holds fewer than ``SHARE_FROM`` live requests, else
the child with the fewest. A small batch thus stays in one child: each child a gate goes to
costs the engine thread a message, a stream wait and copy and a mask kernel launch, and a few
rows are filled well within the forward they hide behind; a gate only one child takes part in
fills on every spare core, not just that child's share (``_Grammars``: 64 rows in 0.73 ms on 14
threads against 1.00 on 7). Every message about a request goes to
its owner; a grammar is compiled by every child (admission asks them all), so any child can
take its next request at once.

A gate (``grammar_board``) goes to the children that own one of its requests, each with its
share of the commits and rows, writing into its own board; the rank's stream waits for and
copies each child's rows and masks with them (``StructuredOutputWorker.gate_send`` and
``gate_mask``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atom.structured_output.grammar_process import (
    GrammarProcess,
    GrammarProcessError,
    Ticket,
    split_cores,
)
from atom.structured_output.manager import AdmissionResult

__all__ = ["SHARE_FROM", "GrammarPool"]

# Live requests the first child holds before new ones go to the least loaded child. At batch 64
# two children of 32 rows made a step slower than one child of 64 (1.78 against 1.62 ms, H200,
# benchmarks/results/h200_2026-12-04e): the second child's gate costs the engine thread more
# than it saves the child.
SHARE_FROM = 64


class _Asks:
    """``prepare`` of one child while it is busy with gates: asked without waiting, answered at
    a later poll (``GrammarPool.prepare``)."""

    def __init__(self) -> None:
        self.ticket: Ticket | None = None
        self.asked: list[tuple[str, Any]] = []
        self.answered: dict[str, AdmissionResult] = {}


class GrammarPool:
    """The children of a rank, and which one owns each live request."""

    def __init__(
        self, tokenizer: str | Path, manager_options: dict, timeout_s: float, count: int
    ) -> None:
        """Starts ``count`` children (fewer on a host with fewer spare cores), each pinned to
        its share of this process's cores (all of them for a gate it alone takes part in:
        ``StructuredOutputWorker`` says which), all at once."""
        self.processes: list[GrammarProcess] = []
        shares = split_cores(count)
        spare = sorted(core for cores in shares for core in cores or ()) or None
        try:
            for cores in shares:
                self.processes.append(
                    GrammarProcess(
                        tokenizer, manager_options, timeout_s, cores, wait=False, spare=spare
                    )
                )
            for process in self.processes:
                process.wait_started()
        except Exception:
            self.shutdown()
            raise
        self._asks = [_Asks() for _ in self.processes]
        self._owner: dict[str, int] = {}  # request id -> index of the child holding its state
        self._owned = [0] * len(self.processes)  # live requests per child

    @property
    def dead_reason(self) -> str | None:
        """Why a child is gone, if one is (then no new request is admitted)."""
        return next((p.dead_reason for p in self.processes if p.dead_reason), None)

    def owner(self, request_id: str) -> int:
        """The index of the child that holds ``request_id``'s state (0 for one none holds: the
        child then fails its row, having no state for it)."""
        return self._owner.get(request_id, 0)

    @property
    def owners(self) -> dict[str, int]:
        """Request id -> child index, of the requests prepared and not released."""
        return self._owner

    def admit(self, spec: Any, api_fingerprint: str, vocab_size: int, wait_s: float) -> Any:
        """Every child checks and compiles ``spec``, all at once: an error from any, else
        pending while any compiles, else ready."""
        args = (spec, api_fingerprint, vocab_size, wait_s)
        tickets = [p.send("admit", *args) for p in self.processes]
        results = [p.answer_of(t) for p, t in zip(self.processes, tickets, strict=True)]
        return next(
            (r for r in results if r.status == "error"),
            next((r for r in results if r.status == "pending"), results[0]),
        )

    def prepare(self, items: list[tuple[str, Any]]) -> dict[str, AdmissionResult]:
        """Readiness of waiting requests, each asked of its owner (see the module's docstring
        for a new request's); never waits for a busy child."""
        by_child: list[list[tuple[str, Any]]] = [[] for _ in self.processes]
        for rid, spec in items:
            child = self._owner.get(rid)
            if child is None:
                child = 0
                if self._owned[0] >= SHARE_FROM:
                    child = min(range(len(self._owned)), key=self._owned.__getitem__)
                self._owner[rid] = child
                self._owned[child] += 1
            by_child[child].append((rid, spec))
        results: dict[str, AdmissionResult] = {}
        for child, asked in enumerate(by_child):
            if asked:
                results.update(self._prepare_in(child, asked))
        return results

    def _prepare_in(self, child: int, items: list[tuple[str, Any]]) -> dict[str, AdmissionResult]:
        """``prepare`` in one child. With messages in flight (gates) a call would wait for them,
        holding up the engine thread for a step: then the items are sent without waiting, and
        answered at a later poll from what the child said (pending until then; a pending
        answer is asked again)."""
        process, asks = self.processes[child], self._asks[child]
        if not process.busy:
            return process.call("prepare", items)
        if asks.ticket is not None:
            try:
                answers = process.answer_of(asks.ticket, wait=False)
            except GrammarProcessError as e:
                answers = {rid: AdmissionResult("error", str(e)) for rid, _ in asks.asked}
            if answers is not None:
                asks.answered.update(answers)
                asks.ticket, asks.asked = None, []
        results, ask = {}, []
        for rid, spec in items:
            result = asks.answered.pop(rid, None)
            if result is None or result.status == "pending":
                result = AdmissionResult("pending")
                ask.append((rid, spec))
            results[rid] = result
        if ask and asks.ticket is None:
            asks.ticket, asks.asked = process.send("prepare", ask), ask
        return results

    def release(self, request_ids: list[str]) -> None:
        """Drop these requests' states in their owners, in order behind the gates sent so far;
        idempotent."""
        by_child: list[list[str]] = [[] for _ in self.processes]
        for rid in request_ids:
            child = self._owner.pop(rid, None)
            if child is not None:
                self._owned[child] -= 1
                self._asks[child].answered.pop(rid, None)
                by_child[child].append(rid)
        for process, released in zip(self.processes, by_child, strict=True):
            if released and process.dead_reason is None:
                process.cast("release", released)

    def counts(self) -> tuple[int, int]:
        """Live grammar states (all children), cached grammars (the most any child holds: every
        child compiles every admitted grammar)."""
        live, cached = 0, 0
        for process in self.processes:
            if process.dead_reason is None:
                child_live, child_cached = process.call("counts")
                live, cached = live + child_live, max(cached, child_cached)
        return live, cached

    def shutdown(self) -> None:
        for process in self.processes:
            process.shutdown()
