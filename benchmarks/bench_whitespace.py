"""JSON whitespace modes of structured output on real-world schemas: answer length, answers that
hit the output cap, valid answers and wall time, side by side in one run.

The embedded SmolLM2-135M-Instruct (or --model), greedy, CPU here. Schemas: a fixed, seeded
sample of MaskBench (``../shared/data/maskbench``) from the Github_easy, Glaiveai2K and Snowplow
subsets (the same number from each), drawn in seeded order among the schemas of at most
--max-schema-chars characters (compact JSON; keeps prompts short) that the preflight
(``parse_chat_response_format``) accepts and the worker backend compiles (flexible mode).

For each mode of ``EngineConfig.structured_output_whitespace`` an engine is built with that mode
(the real option: the worker's grammar uses it), every schema is admitted (admission RPC, compile
on the worker), then one chat request per schema is generated, all submitted at once (continuous
batching), greedy, capped at --max-tokens. The prompt asks for a JSON example of the schema and
includes it, on one line or pretty-printed (--prompt-indent). An answer is valid when it finished (EOS) and passes the final validator
(``validate_answer``); a capped answer is ``finish_reason == "length"``.

Reported per mode: tokens per answer (mean, median), whitespace-only tokens per answer (mean),
capped answers, valid answers, grammar errors, per-schema changes against today's flexible mode
(paired: the same schemas), admission time and generation wall time (modes run one after
another: wall times see the machine's load at that moment, token counts do not).

Prints a table; writes benchmarks/results/whitespace.json and whitespace.png
(whitespace_prompt_indentN.* with --prompt-indent N).
    python benchmarks/bench_whitespace.py                     # 60 schemas x 4 modes
    python benchmarks/bench_whitespace.py --prompt-indent 2   # the schema pretty-printed
    python benchmarks/bench_whitespace.py --quick             # 6 schemas, cap 64: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, get_args

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT.parent / "shared" / "data" / "maskbench"
RESULTS = Path(__file__).parent / "results"
SUBSETS = ("Github_easy", "Glaiveai2K", "Snowplow")
PROMPT = (
    "Write one realistic example of a JSON value that matches the JSON Schema below. "
    "Reply with the JSON only.\n\nJSON Schema:\n{schema}"
)
ADMIT_TIMEOUT_S = 300.0


def sample_schemas(tokenizer: Any, per_subset: int, max_chars: int, seed: int) -> list[dict]:
    """``per_subset`` schemas of each subset, in seeded order, that the preflight accepts and
    the worker backend compiles (in a fixed mode, so that the sample never follows the default)."""
    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.structured_output.backend_guidance import GrammarError, GuidanceBackend
    from atom.structured_output.spec import FormatError

    backend = GuidanceBackend(tokenizer, len(tokenizer), whitespace="flexible")
    rng = random.Random(seed)
    chosen = []
    for subset in SUBSETS:
        paths = sorted(DATA.glob(f"{subset}---*.json"))
        rng.shuffle(paths)
        kept = 0
        for path in paths:
            if kept == per_subset:
                break
            schema = json.loads(path.read_text())["schema"]
            if len(json.dumps(schema, separators=(",", ":"))) > max_chars:
                continue
            rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
            try:
                constraint = parse_chat_response_format(rf)
                backend.grammar(constraint.prepared.lowered)
            except (FormatError, GrammarError):
                continue
            chosen.append({"name": path.stem, "schema": schema, "constraint": constraint})
            kept += 1
        if kept < per_subset:
            raise SystemExit(f"{subset}: only {kept} usable schemas")
    return chosen


def admit(engine: Any, spec: Any) -> str | None:
    """The admission RPC, polled like the API does; an error message or None when ready."""
    from atom.structured_output.admission import api_fingerprint

    vocab = engine.hf_config.vocab_size
    fp = api_fingerprint(engine.tokenizer, engine.eos_token_ids, vocab)
    deadline = time.monotonic() + ADMIT_TIMEOUT_S
    while time.monotonic() < deadline:
        (answer,) = engine.collective_rpc("structured_output_admit", spec, fp, vocab)
        if answer["status"] != "pending":
            return None if answer["status"] == "ready" else answer["message"]
        time.sleep(0.02)
    return "admission timed out"


def is_valid(constraint: Any, output: Any) -> bool:
    from atom.structured_output.answer import AnswerValidationError, validate_answer

    if output.finish_reason != "stop":
        return False
    try:
        validate_answer(constraint, output.text)
    except AnswerValidationError:
        return False
    return True


def run_mode(mode: str, items: list[dict], args: argparse.Namespace) -> dict:
    """One engine with this whitespace mode: admit every schema, then generate all answers."""
    from atom.config import EngineConfig
    from atom.llm import LLM
    from atom.sampling_params import SamplingParams
    from atom.structured_output.spec import StructuredOutputSpec

    config = EngineConfig(
        model=args.model,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=len(items),
        structured_output_whitespace=mode,
    )
    llm = LLM(config=config)
    tok = llm.tokenizer
    t0 = time.perf_counter()
    specs, errors = [], {}
    for item in items:
        spec = StructuredOutputSpec.of(item["constraint"], None)
        error = admit(llm.engine, spec)
        if error is None:
            specs.append((item, spec))
        else:
            errors[item["name"]] = error
    admit_s = time.perf_counter() - t0
    chats = [
        [
            {
                "role": "user",
                "content": PROMPT.format(
                    schema=json.dumps(item["schema"], indent=args.prompt_indent)
                ),
            }
        ]
        for item, _ in specs
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_output=spec)
        for _, spec in specs
    ]
    t0 = time.perf_counter()
    outputs = llm.chat(chats, params)
    wall_s = time.perf_counter() - t0
    llm.engine.shutdown()
    answers = {
        item["name"]: {
            "tokens": len(out.output_token_ids),
            "whitespace_tokens": sum(not tok.decode([t]).strip() for t in out.output_token_ids),
            "finish": out.finish_reason,
            "valid": is_valid(item["constraint"], out),
            "text": out.text,
        }
        for (item, _), out in zip(specs, outputs, strict=True)
    }
    for name, error in errors.items():
        answers[name] = {"finish": "admission error", "valid": False, "text": error}
    load = round(os.getloadavg()[0], 2)
    return {"answers": answers, "admit_s": admit_s, "wall_s": wall_s, "loadavg_1m_end": load}


def changes(run: dict, base: dict | None, good: Any) -> list[int] | None:
    """Paired with the same schemas' answers in ``base``: [became good, stopped being good]."""
    if base is None:
        return None
    pairs = [(good(a), good(base["answers"][n])) for n, a in run["answers"].items()]
    return [sum(now and not was for now, was in pairs), sum(was and not now for now, was in pairs)]


def summarize(run: dict, base: dict | None, max_tokens: int) -> dict:
    """One mode's numbers; ``base`` (today's flexible mode) for paired per-schema changes."""
    answers = run["answers"].values()
    generated = [a for a in answers if "tokens" in a]  # not refused at admission
    tokens = [a["tokens"] for a in generated]
    return {
        "answers": len(answers),
        "tokens_mean": statistics.fmean(tokens),
        "tokens_median": statistics.median(tokens),
        "whitespace_tokens_mean": statistics.fmean(a["whitespace_tokens"] for a in generated),
        "capped": sum(a["finish"] == "length" for a in answers),
        "valid": sum(a["valid"] for a in answers),
        "errors": sum(a["finish"] not in ("stop", "length") for a in answers),
        "uncapped_vs_flexible": changes(run, base, lambda a: a["finish"] != "length"),
        "valid_vs_flexible": changes(run, base, lambda a: a["valid"]),
        "tokens_total": sum(tokens),
        "admit_s": round(run["admit_s"], 2),
        "wall_s": round(run["wall_s"], 1),
        "loadavg_1m_end": run["loadavg_1m_end"],
        "max_tokens": max_tokens,
    }


def print_table(summary: dict[str, dict]) -> None:
    cols = ("mode", "tok mean", "tok median", "ws tok", "capped", "valid", "errors")
    cols += ("cap -/+", "valid +/-", "wall s", "load")
    print(" ".join(f"{c:>10}" for c in cols))
    for mode, s in summary.items():
        cells = (
            mode,
            f"{s['tokens_mean']:.1f}",
            f"{s['tokens_median']:.0f}",
            f"{s['whitespace_tokens_mean']:.1f}",
            f"{s['capped']}/{s['answers']}",
            f"{s['valid']}/{s['answers']}",
            str(s["errors"]),
            "{}/{}".format(*s["uncapped_vs_flexible"] or ("-", "-")),
            "{}/{}".format(*s["valid_vs_flexible"] or ("-", "-")),
            f"{s['wall_s']:.1f}",
            f"{s['loadavg_1m_end']:.1f}",
        )
        print(" ".join(f"{c:>10}" for c in cells))


def prompt_style(result: dict) -> str:
    indent = result["prompt_indent"]
    return "one line" if indent is None else f"indent {indent}"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["summary"])
    summary = result["summary"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4.2))
    tokens = [
        [a["tokens"] for a in result["runs"][m]["answers"].values() if "tokens" in a] for m in modes
    ]
    ax1.boxplot(tokens, showmeans=True)
    ax1.set_xticks(range(1, len(modes) + 1), modes)
    ax1.axhline(result["max_tokens"], color="r", lw=0.8, ls="--", label="output cap")
    ax1.set_ylabel("tokens per answer")
    ax1.set_title("answer length (triangle: mean)")
    ax1.legend(fontsize=8)
    width = 0.27
    for j, (key, color) in enumerate((("valid", "#4a7"), ("capped", "#d73"), ("errors", "#999"))):
        xs = [i + (j - 1) * width for i in range(len(modes))]
        ys = [summary[m][key] for m in modes]
        ax2.bar(xs, ys, width, color=color, label=key)
        for x, y in zip(xs, ys, strict=True):
            ax2.text(x, y, str(y), ha="center", va="bottom", fontsize=7)
    ax2.set_xticks(range(len(modes)), modes)
    ax2.set_ylabel(f"answers (of {result['num_schemas']})")
    ax2.set_title("valid, capped and failed answers")
    ax2.set_ylim(0, result["num_schemas"])
    ax2.legend(fontsize=8)
    ax3.bar(modes, [summary[m]["wall_s"] for m in modes], color="#48c")
    ax3.set_ylabel("generation wall time (s; machine load varies)")
    ax3.set_title("all answers of a mode, batched")
    fig.suptitle(
        f"JSON whitespace modes, {result['model']}, {result['num_schemas']} MaskBench schemas, "
        f"greedy, cap {result['max_tokens']}, schema in prompt: {prompt_style(result)}, "
        f"{result['device']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from atom.config import EngineConfig, StructuredOutputWhitespace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: embedded SmolLM2)")
    ap.add_argument("--modes", nargs="+", default=list(get_args(StructuredOutputWhitespace)))
    ap.add_argument("--per-subset", type=int, default=20, help="schemas from each subset")
    ap.add_argument("--max-schema-chars", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=384, help="output cap per answer")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-bytes", type=int, default=1536 << 20)
    ap.add_argument("--seed", type=int, default=0, help="schema sample seed")
    ap.add_argument(
        "--prompt-indent",
        type=int,
        default=None,
        help="pretty-print the schema in the prompt with this indent (default: one line); "
        "results go to whitespace_prompt_indentN.*",
    )
    ap.add_argument("--quick", action="store_true", help="2 schemas per subset, cap 64")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.per_subset, args.max_tokens = 2, 64
    if not DATA.is_dir():
        print(f"bench_whitespace: skipped, no MaskBench data at {DATA}")
        return

    import torch
    from tqdm import tqdm

    from atom.model_engine.llm_engine import load_tokenizer
    from atom.model_loader import resolve_model

    args.model = args.model or str(resolve_model(EngineConfig()))
    load_start = round(os.getloadavg()[0], 2)
    if load_start > 0.5:
        print(f"warning: 1-minute load average {load_start}: the machine is busy", flush=True)
    items = sample_schemas(
        load_tokenizer(args.model), args.per_subset, args.max_schema_chars, args.seed
    )
    runs = {}
    for mode in tqdm(args.modes, desc="modes", unit="mode"):
        runs[mode] = run_mode(mode, items, args)
    base = runs.get("flexible")
    summary = {mode: summarize(run, base, args.max_tokens) for mode, run in runs.items()}
    result = {
        "command": " ".join(["python", "benchmarks/bench_whitespace.py", *sys.argv[1:]]),
        "device": f"CPU, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads",
        "model": Path(args.model).name,
        "num_schemas": len(items),
        "schemas": [item["name"] for item in items],
        "max_tokens": args.max_tokens,
        "prompt": PROMPT,
        "prompt_indent": args.prompt_indent,
        "summary": summary,
        "runs": runs,
        "loadavg_1m_start_end": [load_start, round(os.getloadavg()[0], 2)],
    }
    print()
    print(
        f"{len(items)} MaskBench schemas ({', '.join(SUBSETS)}), greedy, cap {args.max_tokens}, "
        f"schema in prompt: {prompt_style(result)}; ws tok: whitespace-only tokens per answer"
    )
    print_table(summary)
    print(
        "paired with flexible on the same schemas: cap -/+ = no longer / newly capped, "
        "valid +/- = newly / no longer valid; load: 1-minute load average after the mode"
    )
    stem = (
        "whitespace"
        if args.prompt_indent is None
        else f"whitespace_prompt_indent{args.prompt_indent}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.json and .png")


if __name__ == "__main__":
    main()
