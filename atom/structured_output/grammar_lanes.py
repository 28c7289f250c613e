"""A compiled grammar and its lanes: independently compiled templates of it.

A request's matcher is a ``deep_copy`` of a compiled template. llguidance's copy shares the
template's lexer, behind one lock, with every other copy of it (``Parser`` clones its
``Arc<Mutex<SharedState>>``), so the masks of requests copied from one template are computed one
at a time even on the executor's threads: on the H200's host, 16 threads filled 256 such rows
slower than one thread (benchmarks/bench_grammar_step.py, 2026-12-02). Copies of templates
compiled independently share nothing. So a grammar that more live requests use than it has
templates gets another one, compiled in the background, up to the executor's thread count, and
each request is copied from the template ("lane") that serves the fewest live requests; the
manager hands llguidance's executor the rows ordered by lane, so one thread mostly meets one lane.

Requests that arrive together are bound before the extra lanes exist, all to the first one: a
burst of 64 requests of a new schema put 57 on lane 0. So when a lane is added, the manager moves
requests from crowded lanes to it (``move``: a copy of the new template that replays the
request's committed tokens; ``GrammarState.move_to``), at the start of its next step.

A compile holds the GIL for its whole duration (llguidance 1.9.1), stalling every other thread
of the process, the engine's and the server's included: grammars whose first compile took longer
than ``LANE_COMPILE_LIMIT_S`` get no extra lane. Typical schemas compile in 0.2-2 ms with the
129,280-token DeepSeek vocabulary (the token trie is shared by all compiles).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llguidance import LLMatcher

__all__ = ["LANE_COMPILE_LIMIT_S", "CompiledGrammar"]

# Extra lanes only for grammars that compiled at least this fast the first time.
LANE_COMPILE_LIMIT_S = 0.01


class CompiledGrammar:
    """The templates (lanes) of one cache key, and how many live requests each serves."""

    def __init__(
        self,
        compile: Callable[[], LLMatcher],
        template: LLMatcher,
        compile_s: float,
        free_keys: bool = True,
    ) -> None:
        """``compile``: makes another template exactly like ``template`` (same grammar text
        and limits); ``compile_s``: how long ``template`` took; ``free_keys``: whether its
        answers may hold keys that could repeat (``json_keys.may_repeat_keys``)."""
        self.compile = compile
        self.compile_s = compile_s
        self.free_keys = free_keys
        self.growing = False  # a lane is being compiled
        self._can_grow = compile_s <= LANE_COMPILE_LIMIT_S
        self._lanes = [template]
        self._live = [0]
        self._lock = threading.Lock()

    @property
    def num_lanes(self) -> int:
        return len(self._lanes)

    def bind(self) -> tuple[LLMatcher, int]:
        """A new request's own matcher, copied from the least used lane, and that lane."""
        with self._lock:
            lane = min(range(len(self._lanes)), key=self._live.__getitem__)
            self._live[lane] += 1
            template = self._lanes[lane]
        return template.deep_copy(), lane

    def unbind(self, lane: int) -> None:
        with self._lock:
            self._live[lane] -= 1

    def wants_lane(self, max_lanes: int) -> bool:
        """Should another lane be compiled now (then ``growing`` is set by the caller)?"""
        with self._lock:
            busy = sum(self._live) > len(self._lanes)
        return busy and self._can_grow and not self.growing and len(self._lanes) < max_lanes

    def stop_growing(self) -> None:
        """No more lanes (one failed to compile)."""
        self._can_grow = False

    def add_lane(self, template: LLMatcher) -> None:
        with self._lock:
            self._lanes.append(template)
            self._live.append(0)

    def move(self, lane: int) -> tuple[int, LLMatcher] | None:
        """A request on ``lane`` should move when that lane serves at least two more live
        requests than the least used one: that lane and its template (counted as moved; call
        ``move_back`` if the request cannot go), else None."""
        with self._lock:
            least = min(range(len(self._lanes)), key=self._live.__getitem__)
            if self._live[lane] - self._live[least] < 2:
                return None
            self._live[lane] -= 1
            self._live[least] += 1
            return least, self._lanes[least]

    def move_back(self, moved_to: int, lane: int) -> None:
        """Undo ``move(lane)`` that answered ``moved_to``."""
        with self._lock:
            self._live[moved_to] -= 1
            self._live[lane] += 1
