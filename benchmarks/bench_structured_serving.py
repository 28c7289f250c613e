"""Structured output in the serving engine: enabled-request overhead and disabled-request
regression, on the same prompts and the real engine (SmolLM2, greedy, CPU here).

One run measures, with the decode-step time of a full batch (every request decoding, first
step excluded) as TPOT, over interleaved repeats (the least-disturbed repeat is the headline,
paired per-repeat ratios are reported too, since CPU machines are often shared):

- `never`: a child process in which `atom.structured_output` is never imported runs the
  unconstrained prompts (it checks `sys.modules`);
- `installed`: this process, after the feature was initialized and used, runs the same
  unconstrained prompts (outputs must equal `never`);
- `constrained`: the same prompts, each with a JSON schema (answers validated);
- `mixed` / `mixed_plain`: half the batch constrained vs. the same batch all unconstrained
  (the unconstrained half's outputs must equal `installed`).

Enabled-request overhead = constrained / installed. Disabled-request regression = installed /
never (feature present, request unconstrained) and mixed / mixed_plain (the cost a batch's
unconstrained requests pay for constrained neighbours). Prints a table, writes
benchmarks/results/bench_structured_serving.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).parent / "results"
TOPICS = ["apples", "rivers", "planets", "violins", "bridges", "volcanoes", "owls", "trains"]
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 16},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10},
        "safe": {"type": "boolean"},
    },
    "required": ["topic", "rating", "safe"],
    "additionalProperties": False,
}


def make_engine(args):
    from atom.config import EngineConfig
    from atom.model_engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=args.model,
            max_model_len=512,
            kv_cache_bytes=128 << 20,
            max_num_seqs=args.n,
            enable_prefix_caching=False,
        )
    )


def prompts_for(engine, n: int) -> list[list[int]]:
    out = []
    for topic in TOPICS[:n]:
        msgs = [
            {
                "role": "user",
                "content": f"Rate {topic} from 1 to 10 and say if they are safe. Answer in JSON.",
            }
        ]
        out.append(
            list(
                engine.tokenizer.apply_chat_template(
                    msgs, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        )
    return out


_run_ids = iter(range(10**9))


def run(engine, prompts, specs, max_tokens: int) -> dict:
    """Run one batch to completion; TPOT = median full-batch decode step time."""
    from atom.sampling_params import SamplingParams

    ids = []
    for prompt, spec in zip(prompts, specs, strict=True):
        rid = f"r{next(_run_ids)}"
        ids.append(rid)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=spec is None)
        params.structured_output = spec
        engine.add_request(rid, prompt, params)
    finals: dict[str, object] = {}
    full_steps: list[float] = []
    first = True
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        decoding = sum(1 for o in outs if o.new_token_ids)
        if not first and decoding == len(prompts):
            full_steps.append(dt)
        first = False
        for o in outs:
            if o.finished:
                finals[o.request_id] = o
    outputs = [finals[r] for r in ids]
    return {
        "tpot_ms": 1000 * statistics.median(full_steps) if full_steps else float("nan"),
        "full_steps": len(full_steps),
        "token_ids": [o.output_token_ids for o in outputs],
        "texts": [o.text for o in outputs],
        "finish": [o.finish_reason for o in outputs],
    }


def child(args) -> None:
    """The `never` side: structured output is never imported in this process. It serves one
    unconstrained run per "run" line on stdin, so the parent can interleave its runs with
    these (the machine's load drifts; interleaving keeps the comparison fair)."""
    engine = make_engine(args)
    prompts = prompts_for(engine, args.n)
    run(engine, prompts[:2], [None, None], 4)  # warm up like the parent
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        r = run(engine, prompts, [None] * args.n, args.max_tokens)
        print(json.dumps({"tpot_ms": r["tpot_ms"], "token_ids": r["token_ids"]}), flush=True)
    leaked = [m for m in sys.modules if m.startswith(("atom.structured_output", "llguidance"))]
    engine.shutdown()
    print(json.dumps({"imported": leaked}), flush=True)


def admit(engine, spec) -> None:
    from atom.structured_output.validation import api_fingerprint

    vocab = engine.hf_config.vocab_size
    fp = api_fingerprint(engine.tokenizer, engine.eos_token_ids, vocab)
    while True:
        (answer,) = engine.collective_rpc("structured_output_admit", spec, fp, vocab)
        if answer["status"] == "ready":
            return
        if answer["status"] == "error":
            raise SystemExit(answer["message"])
        time.sleep(0.02)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["never", "installed", "constrained", "mixed_plain", "mixed"]
    values = [result["tpot_ms"][n] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar(names, values, color=["#999", "#4a7", "#d73", "#4a7", "#d73"])
    for bar, v in zip(bars, values, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom")
    ax.set_ylabel("full-batch decode step (ms)")
    ax.set_title(
        f"structured output, {result['n']} requests, CPU: overhead "
        f"{result['enabled_overhead']:.2f}x, regression {result['disabled_regression']:.2f}x"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: embedded SmolLM2)")
    ap.add_argument("-n", type=int, default=4, help="requests per batch (<= 8)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from atom.config import EngineConfig
        from atom.model_loader import resolve_model

        args.model = str(resolve_model(EngineConfig()))
    if args.child:
        child(args)
        return

    cmd = [sys.executable, __file__, "--child", "--model", args.model, "-n", str(args.n)]
    cmd += ["--max-tokens", str(args.max_tokens)]
    never_proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert never_proc.stdin is not None and never_proc.stdout is not None

    def never_run() -> dict:
        never_proc.stdin.write("run\n")
        never_proc.stdin.flush()
        return json.loads(never_proc.stdout.readline())

    if never_proc.stdout.readline().strip() != "ready":
        raise SystemExit("the `never` process did not start")

    from atom.structured_output.validation import (
        StructuredOutputSpec,
        parse_chat_response_format,
        validate_answer,
    )

    engine = make_engine(args)
    prompts = prompts_for(engine, args.n)
    rf = {"type": "json_schema", "json_schema": {"name": "facts", "schema": SCHEMA}}
    spec = StructuredOutputSpec.of(parse_chat_response_format(rf), None)
    admit(engine, spec)
    run(engine, prompts[:2], [spec, None], 4)  # warm up: bind, masks, kernel import
    half = [spec if i % 2 else None for i in range(args.n)]
    tpots: dict[str, list[float]] = {k: [] for k in ("installed", "constrained", "mixed")}
    tpots["mixed_plain"], tpots["never"] = [], []
    last: dict[str, dict] = {}
    for _ in range(args.repeats):
        last["never"] = never_run()
        tpots["never"].append(last["never"]["tpot_ms"])
        for name, specs in (
            ("installed", [None] * args.n),
            ("constrained", [spec] * args.n),
            ("mixed", half),
        ):
            last[name] = run(engine, prompts, specs, args.max_tokens)
            tpots[name].append(last[name]["tpot_ms"])
        tpots["mixed_plain"].append(tpots["installed"][-1])  # the same batch, all unconstrained
    engine.shutdown()
    never_proc.stdin.write("quit\n")
    never_proc.stdin.flush()
    never = {"token_ids": last["never"]["token_ids"], **json.loads(never_proc.stdout.readline())}
    never_proc.wait(timeout=60)

    valid = 0
    for r in (last["constrained"], last["mixed"]):
        for text, finish, s in zip(r["texts"], r["finish"], [spec] * args.n, strict=True):
            if finish == "stop":
                validate_answer(s.constraint, text)
                valid += 1
    plain_idx = [i for i in range(args.n) if half[i] is None]
    checks = {
        "installed_equals_never": last["installed"]["token_ids"] == never["token_ids"],
        "mixed_plain_half_equals_installed": all(
            last["mixed"]["token_ids"][i] == last["installed"]["token_ids"][i] for i in plain_idx
        ),
        "never_process_imported": never["imported"],
        "constrained_answers_validated": valid,
        "constrained_finish": last["constrained"]["finish"],
    }
    # The machine is shared: the least-disturbed repeat (min) is the headline; ratios of runs
    # taken back to back within one repeat (paired) are reported beside it.
    med = {k: min(v) for k, v in tpots.items()}

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(tpots[a], tpots[b], strict=True))

    result = {
        "n": args.n,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "tpot_ms": med,
        "tpot_ms_runs": tpots,
        "enabled_overhead": med["constrained"] / med["installed"],
        "disabled_regression": med["installed"] / med["never"],
        "neighbour_regression": med["mixed"] / med["mixed_plain"],
        "paired_median_ratios": {
            "enabled_overhead": paired("constrained", "installed"),
            "disabled_regression": paired("installed", "never"),
            "neighbour_regression": paired("mixed", "mixed_plain"),
        },
        "checks": checks,
        "full_batch_steps": {k: last[k].get("full_steps") for k in last if k != "never"},
    }
    print(f"{'run':<14}{'TPOT ms (min)':>18}  runs")
    for k in ("never", "installed", "constrained", "mixed_plain", "mixed"):
        runs = result["tpot_ms_runs"][k]
        print(f"{k:<14}{med[k]:>18.1f}  {', '.join(f'{x:.1f}' for x in runs)}")
    print(f"enabled-request overhead (constrained / installed): {result['enabled_overhead']:.3f}x")
    print(
        f"disabled-request regression (installed / never):   {result['disabled_regression']:.3f}x"
    )
    print(
        f"neighbour regression (mixed / mixed_plain):        {result['neighbour_regression']:.3f}x"
    )
    print("paired (median of per-repeat ratios):", json.dumps(result["paired_median_ratios"]))
    print("checks:", json.dumps(checks))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_structured_serving.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "bench_structured_serving.png")
    print(f"wrote {RESULTS / 'bench_structured_serving.json'} and .png")
    if not (checks["installed_equals_never"] and checks["mixed_plain_half_equals_installed"]):
        raise SystemExit("generated outputs do not match")
    if checks["never_process_imported"]:
        raise SystemExit("the `never` process imported structured output")


if __name__ == "__main__":
    main()
