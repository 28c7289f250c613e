"""Freezing a process's startup heap, so that full garbage collections stop scanning it.

Everything alive once a process has started serving (modules, the model, the tokenizer, a
grammar process's compiled vocabulary: hundreds of thousands of objects) lives as long as the
process. Python's full (generation 2) collection scans it all anyway, every time the objects a
step allocates add up to the collector's thresholds: a pause of the thread that triggered it,
and of every other thread of the process with it. Frozen, those objects drop out of every
collection; those that die are still freed by reference counting. On this repository's 2-core
CPU a batch of 256 decoding requests spent 12.6% of its decode steps' time in collections,
0.7% once frozen (benchmarks/bench_host_step.py, gc columns).

Frozen objects in reference cycles are never freed, so an engine that shuts down in a process
that goes on (the tests, a notebook, a benchmark that builds several) thaws the heap: otherwise
its model, KV cache and tokenizer stay, 0.5 GB a SmolLM2 engine, until the process ends.
"""

from __future__ import annotations

import atexit
import functools
import gc

__all__ = ["freeze_startup_heap", "thaw_startup_heap"]


def freeze_startup_heap() -> None:
    """Collect what startup left behind, then freeze everything still alive. Called by every
    process of the engine once it is ready: the engine (``LLMEngine``), the API server, each
    rank's process and each grammar process. Calling it again freezes what was added since."""
    _unfreeze_at_exit()
    gc.collect()
    gc.freeze()


@functools.cache
def _unfreeze_at_exit() -> None:
    """Once per process: the heap is unfrozen at exit, so that the interpreter's last collection
    frees its cycles as it would have (extensions such as Triton's report the instances still
    alive when they unload)."""
    atexit.register(gc.unfreeze)


def thaw_startup_heap() -> None:
    """Give everything frozen back to the collector: an engine shutting down calls it, and its
    cycles go at the next collection (the others' objects are alive and stay; an engine started
    later freezes them again)."""
    gc.unfreeze()
