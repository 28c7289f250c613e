"""Speculative decoding: acceptance rate and TPOT with and without it, constrained and not.

Real engine (`LLMEngine`), greedy, the same prompts in every setting: chat prompts that invite
repetition (lists, counting, code), each request once unconstrained and once constrained by a JSON
schema of its answer's shape. Settings, run back to back in interleaved repeats:

- `plain`: no speculation (the reference: every setting's greedy tokens must equal its own);
- `ngram`: n-gram prompt lookup, `--num-speculative-tokens` drafts;
- `plain-async`, `ngram-async`: the same with asynchronous scheduling (the others schedule
  synchronously; n-gram drafts are then proposed a step ahead, before the step in flight is
  read, and its accepted count moves the next step's positions on the device);
- `draft`: a draft model (`--draft-model`; default: the target itself, which shows the
  machinery's ceiling: nearly every draft is accepted, and a step costs the target's verification
  plus k draft forwards of the same size; `--random-draft`: a random-weight 2-layer model of the
  target's vocabulary, the floor: nearly every draft is rejected).

On the H200 the target is bench_engine's random-weight 1B model (`--model
/tmp/atom-random-llama-1b-129k`, made there if missing): its logits are nearly flat, so in bf16
near-ties flip between kernels and its greedy tokens need not match across settings (the CUDA
test of the same parity runs in float32).

Reported per setting and kind (constrained or not): acceptance rate (accepted / proposed drafts),
tokens per step, TPOT (wall time of the decode divided by output tokens, per request), and for
constrained requests the time the engine thread spent in the grammar hooks per step beside the
unconstrained speculative step (the grammar's cost on verification rows).

Prints a table; writes benchmarks/results/bench_spec_decode.json and .png.
    python benchmarks/bench_spec_decode.py                 # embedded SmolLM2 on CPU, ~5 min
    python benchmarks/bench_spec_decode.py --quick         # one repeat, fewer tokens
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).parent / "results"
QUESTIONS = [
    ("List the numbers from 1 to 20, separated by commas.", {"type": "array"}),
    ("Write the word 'apple' ten times, as a list of strings.", {"type": "array"}),
    (
        "Give a JSON object with keys a, b, c, d, e, each mapped to the number 1.",
        {"type": "object"},
    ),
    ("Write a Python function that adds two numbers, then call it three times.", None),
]
SCHEMAS = {
    "array": {"type": "array", "items": {"type": ["integer", "string"]}, "maxItems": 24},
    "object": {"type": "object", "additionalProperties": {"type": "integer"}},
}


def make_engine(args: argparse.Namespace, setting: str) -> Any:
    from atom.config import EngineConfig
    from atom.model_engine.llm_engine import LLMEngine

    method, _, scheduling = setting.partition("-")
    spec: dict[str, Any] = {}
    if method != "plain":
        spec = {"speculative_method": method, "num_speculative_tokens": args.k}
    if method == "draft":
        spec["speculative_model"] = args.draft_model or args.model
    kw = dict(model=args.model, device=args.device, max_model_len=1024)
    kw["async_scheduling"] = scheduling == "async"
    if args.device == "cuda":  # three engines share one GPU
        kw["kv_cache_bytes"] = 2 << 30
    return LLMEngine(EngineConfig(**kw, **spec))


def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The question as a chat turn, or as plain text where the tokenizer has no chat template
    (the random-weight GPU model)."""
    if not tokenizer.chat_template:
        return tokenizer.encode(question)
    turn = [{"role": "user", "content": question}]
    return list(
        tokenizer.apply_chat_template(
            turn, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def requests_for(engine: Any, args: argparse.Namespace) -> dict[str, tuple]:
    """Every question unconstrained, and (where it has a shape) constrained."""
    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.sampling_params import SamplingParams
    from atom.structured_output.spec import StructuredOutputSpec

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_structured_serving import admit

    out = {}
    for i, (question, shape) in enumerate(QUESTIONS):
        prompt = prompt_ids(engine.tokenizer, question)
        out[f"free-{i}"] = (prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
        if shape is not None:
            schema = SCHEMAS[shape["type"]]
            fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
            spec = StructuredOutputSpec.of(parse_chat_response_format(fmt), None)
            admit(engine, spec)
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
            params.structured_output = spec
            out[f"json-{i}"] = (prompt, params)
    return out


def run(engine: Any, requests: dict[str, tuple], kind: str, hooks: dict) -> dict:
    """The requests of one kind ("free" or "json") to completion, together."""
    core = engine.cores[0]
    proposed, accepted = core.num_proposed_drafts, core.num_accepted_drafts
    chosen = {rid: r for rid, r in requests.items() if rid.startswith(kind)}
    for rid, (prompt, params) in chosen.items():
        engine.add_request(f"{rid}-{time.monotonic_ns()}", prompt, params)
    outs, steps = {}, 0
    hooks["s"] = 0.0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id.rsplit("-", 1)[0]] = out
        steps += 1
    wall = time.perf_counter() - start
    tokens = sum(len(o.output_token_ids) for o in outs.values())
    return {
        "tokens": {rid: list(o.output_token_ids) for rid, o in outs.items()},
        "steps": steps,
        "wall_s": wall,
        "output_tokens": tokens,
        "tpot_ms": 1000 * wall / max(1, tokens / len(outs)),
        "proposed": core.num_proposed_drafts - proposed,
        "accepted": core.num_accepted_drafts - accepted,
        "grammar_ms_per_step": 1000 * hooks["s"] / max(1, steps),
    }


def grammar_timer(engine: Any) -> dict:
    """Wraps the engine thread's grammar hooks (`start_step`, `finish_step`) of this engine's
    structured-output worker; the dict's "s" accumulates their time."""
    (runner,) = engine.executor.workers
    worker = runner.structured_output
    timer = {"s": 0.0}
    for name in ("start_step", "finish_step"):
        fn = getattr(worker, name)

        def timed(*a, _fn=fn, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                timer["s"] += time.perf_counter() - t0

        setattr(worker, name, timed)
    return timer


def summarize(raw: dict[str, dict[str, list[dict]]]) -> dict:
    rows = {}
    for setting, kinds in raw.items():
        for kind, runs in kinds.items():
            proposed = sum(r["proposed"] for r in runs)
            rows[f"{setting}/{kind}"] = {
                "tpot_ms": statistics.median(r["tpot_ms"] for r in runs),
                "tokens_per_step": statistics.median(r["output_tokens"] / r["steps"] for r in runs),
                "acceptance": sum(r["accepted"] for r in runs) / proposed if proposed else None,
                "grammar_ms_per_step": statistics.median(r["grammar_ms_per_step"] for r in runs),
                "same_tokens_as_plain": all(
                    r["tokens"] == p["tokens"]
                    for r, p in zip(runs, raw["plain"][kind], strict=True)
                ),
            }
    return rows


def print_table(rows: dict) -> None:
    print(
        f"{'setting/kind':<18}{'TPOT ms':>9}{'batch tok/step':>16}{'accept':>8}{'grammar ms':>12}  same"
    )
    for name, r in rows.items():
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(
            f"{name:<18}{r['tpot_ms']:>9.1f}{r['tokens_per_step']:>16.2f}{acc:>8}"
            f"{r['grammar_ms_per_step']:>12.2f}  {r['same_tokens_as_plain']}"
        )


def plot(rows: dict, path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].bar(names, [rows[n]["tpot_ms"] for n in names], color="tab:blue")
    axes[0].set_ylabel("TPOT (ms, median)")
    axes[1].bar(names, [rows[n]["tokens_per_step"] for n in names], color="tab:green")
    axes[1].set_ylabel("output tokens per step (whole batch)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(f"speculative decoding, greedy ({device})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: embedded SmolLM2)")
    ap.add_argument("--draft-model", default=None, help="draft model (default: the target)")
    ap.add_argument(
        "--random-draft", action="store_true", help="a random 2-layer draft of the vocabulary"
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--k", type=int, default=4, help="drafts per sequence and step")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", default="", help="suffix of the output files")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.max_tokens = 1, 48
    if args.model is None:
        from atom.config import EngineConfig
        from atom.model_loader import resolve_model

        args.model = str(resolve_model(EngineConfig()))
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engine import make_random_llama_1b

    if args.model.endswith("atom-random-llama-1b-129k"):
        make_random_llama_1b(Path(args.model), args.device)
    if args.random_draft:
        small = {"num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 1536}
        small |= {"num_attention_heads": 8, "num_key_value_heads": 2}
        draft = make_random_llama_1b(Path(args.model + "-draft"), args.device, **small)
        args.draft_model = str(draft)
    from tqdm import tqdm

    settings = ("plain", "plain-async", "ngram", "ngram-async", "draft")
    engines = {s: make_engine(args, s) for s in settings}
    requests = {s: requests_for(e, args) for s, e in engines.items()}
    timers = {s: grammar_timer(e) for s, e in engines.items()}
    raw: dict[str, dict[str, list[dict]]] = {s: {"free": [], "json": []} for s in settings}
    for setting in settings:  # warm-up, untimed: kernels compile once per process, first use
        for kind in ("free", "json"):
            run(engines[setting], requests[setting], kind, timers[setting])
    with tqdm(total=args.repeats * len(settings) * 2, desc="runs") as bar:
        for rep in range(args.repeats):
            order = settings if rep % 2 == 0 else settings[::-1]
            for setting in order:
                for kind in ("free", "json"):
                    result = run(engines[setting], requests[setting], kind, timers[setting])
                    raw[setting][kind].append(result)
                    bar.update()
    rows = summarize(raw)
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_spec_decode{args.tag}.json"
    meta = {"command": " ".join(sys.argv), "model": args.model, "k": args.k, "device": args.device}
    meta["draft_model"] = args.draft_model or args.model
    path.write_text(json.dumps({"meta": meta, "rows": rows, "raw": raw}, indent=1))
    plot(rows, path.with_suffix(".png"), args.device)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
