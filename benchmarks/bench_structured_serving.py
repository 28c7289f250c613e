"""Structured output in the serving engine: enabled-request overhead, disabled-request
regression and the neighbour effect, on the same prompts, with matching outputs checked.

Real engine (`LLMEngine`, embedded SmolLM2-135M-Instruct unless --model), greedy, CPU here. For
each batch size n, n distinct prompts ask for exactly one JSON object {"name": str, "age": int};
the constraint is that object's JSON schema (name 1..24 chars, age 0..120, no other keys).

Settings (same prompts, same batch size; all n requests are submitted at once):

- `never`: a child process in which `atom.structured_output` (and llguidance) is never imported
  runs the n prompts unconstrained; it asserts this through `sys.modules` before and after.
- `plain`: this process, after structured output was initialized on the worker (admission RPC,
  grammar compiled) and used by warm-up constrained requests, runs the same prompts
  unconstrained.
- `constrained`: the same prompts, every request carrying the schema.
- `mixed`: the same prompts, odd-indexed requests constrained, even-indexed unconstrained.
- `plain2`: `plain` again, an A/A control: plain2 / plain shows what "no difference" looks like
  on this machine (the noise floor of the ratios below).

Unconstrained requests run with `ignore_eos` and a fixed `--plain-max-tokens`, so they stay in
the batch; constrained requests stop at the end of their JSON object (EOS forced by the grammar)
or at `--max-tokens`.

What is measured (TPOT): the wall time of `LLMEngine.step()` (schedule, forward, grammar commit,
mask fill and apply, sampling, output processing and detokenization) for *decode steps* only:
steps whose scheduled batch has exactly one new token per sequence (no prefill, read from the
scheduler's batch) and holds all n requests (no request finished yet). Every request gets one
token per such step, so step time == TPOT of each request in it. To compare equal work, within a
repeat every setting is cut to the same first K full-batch decode steps, K = the smallest count
among the settings (the constrained runs end the window when their first answer completes).
TPOT of a run = mean over those K steps. Prefill, admission/binding and queueing are excluded.

Repeats are interleaved (the five settings run back to back, in forward then reverse order on
alternate repeats: ABCDE EDCBA ...), so paired settings see the same machine drift. Headline
ratios are the median over repeats of the per-repeat paired ratio, with min and max:

- enabled-request overhead = constrained / plain
- disabled-request regression = plain / never (feature used in-process, request unconstrained)
- neighbour effect = mixed / plain (cost for unconstrained requests of constrained neighbours;
  step time is shared by the whole batch)
- A/A control = plain2 / plain

The model runner's structured-output hooks are also timed inside each step of the parent
process (the rank's `StructuredOutputWorker.commit` and `mask_logits`, wrapped on the instance): their time per window
step, as a share of the plain TPOT, is the part of the overhead the runner's grammar work
accounts for, measured without the run-to-run noise of a shared machine.

Checks (asserted; the run fails otherwise): greedy unconstrained token ids equal across `never`,
`plain`, `plain2` and the unconstrained half of `mixed` in every repeat; `never` never imported
structured output; every constrained answer that finished validates against the schema; no
preemption. Reported: how many constrained answers finished/validated.

Prints a table; writes benchmarks/results/bench_structured_serving.json and .png.
    python benchmarks/bench_structured_serving.py            # full (~5-6 min on 2 idle CPU cores)
    python benchmarks/bench_structured_serving.py --quick    # short smoke run
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
ROLES = [
    "pirate",
    "baker",
    "astronaut",
    "knight",
    "detective",
    "wizard",
    "farmer",
    "pilot",
    "chef",
    "nurse",
    "sailor",
    "painter",
    "teacher",
    "miner",
    "dancer",
    "poet",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SETTINGS = ("never", "plain", "constrained", "mixed", "plain2")
FORBIDDEN = ("atom.structured_output", "llguidance")


def make_engine(args):
    from atom.config import EngineConfig
    from atom.model_engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=args.model,
            max_model_len=512,
            kv_cache_bytes=256 << 20,
            max_num_seqs=max(args.batch_sizes),
            enable_prefix_caching=False,
        )
    )


def prompts_for(engine, n: int) -> list[list[int]]:
    out = []
    for role in ROLES[:n]:
        text = (
            f"Invent a {role}. Reply with only a JSON object with exactly two keys: "
            '"name" (a short string) and "age" (an integer). No other text.'
        )
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        out.append(list(ids))
    return out


class StepTimer:
    """Records, per `engine.step()`, the batch the scheduler built and (with `grammar=True`)
    the time the rank spent in its structured-output hooks (`commit`: accepted tokens;
    `mask_logits`: fill and apply masks). It wraps methods of this
    engine's instances; nothing in `atom` is changed. The `never` process wraps only the
    scheduler, so nothing of the runner path differs there."""

    def __init__(self, engine, grammar: bool = False):
        (core,) = engine.cores
        self.scheduler = core.scheduler
        self.last: tuple[int, bool] | None = None
        self.grammar_s = 0.0
        schedule = self.scheduler.schedule

        def recording_schedule():
            batch = schedule()
            self.last = (len(batch.seqs), all(k == 1 for k in batch.num_new_tokens))
            return batch

        self.scheduler.schedule = recording_schedule
        if grammar:
            (runner,) = engine.executor.workers
            worker = runner.structured_output
            for name in ("commit", "mask_logits"):
                setattr(worker, name, self._timed(getattr(worker, name)))

    def _timed(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.grammar_s += time.perf_counter() - t0

        return timed


_run_ids = iter(range(10**9))


def run(engine, timer: StepTimer, prompts, specs, args) -> dict:
    """One batch to completion. Returns the full-batch decode step times (ms) in order."""
    from atom.sampling_params import SamplingParams

    ids = []
    for prompt, spec in zip(prompts, specs, strict=True):
        rid = f"r{next(_run_ids)}"
        ids.append(rid)
        if spec is None:
            params = SamplingParams(
                temperature=0.0, max_tokens=args.plain_max_tokens, ignore_eos=True
            )
        else:
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
            params.structured_output = spec
        engine.add_request(rid, prompt, params)
    n = len(prompts)
    finals: dict[str, object] = {}
    steps: list[float] = []
    grammar: list[float] = []  # ms of each of those steps spent in the runner's grammar hooks
    full = True  # no request has finished yet
    while engine.has_unfinished_requests():
        timer.last, timer.grammar_s = None, 0.0
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if full and timer.last is not None and timer.last == (n, True):
            steps.append(1000 * dt)
            grammar.append(1000 * timer.grammar_s)
        for o in outs:
            if o.finished:
                finals[o.request_id] = o
                full = False
    outputs = [finals[r] for r in ids]
    return {
        "steps_ms": steps,
        "grammar_ms": grammar,
        "token_ids": [list(o.output_token_ids) for o in outputs],
        "texts": [o.text for o in outputs],
        "finish": [o.finish_reason for o in outputs],
    }


def child(args) -> None:
    """The `never` side: one unconstrained run per "run N" line on stdin, so the parent can
    interleave these runs with its own."""
    engine = make_engine(args)
    timer = StepTimer(engine)
    assert not [m for m in sys.modules if m.startswith(FORBIDDEN)]
    prompts = {n: prompts_for(engine, n) for n in args.batch_sizes}
    for n in args.batch_sizes:  # warm up like the parent
        run(engine, timer, prompts[n], [None] * n, args)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[:1] != ["run"]:
            break
        n = int(cmd[1])
        r = run(engine, timer, prompts[n], [None] * n, args)
        print(json.dumps({"steps_ms": r["steps_ms"], "token_ids": r["token_ids"]}), flush=True)
    leaked = [m for m in sys.modules if m.startswith(FORBIDDEN)]
    preemptions = timer.scheduler.num_preemptions
    engine.shutdown()
    print(json.dumps({"imported": leaked, "preemptions": preemptions}), flush=True)


def admit(engine, spec) -> None:
    from atom.structured_output.admission import api_fingerprint

    vocab = engine.hf_config.vocab_size
    fp = api_fingerprint(engine.tokenizer, engine.eos_token_ids, vocab)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        (answer,) = engine.collective_rpc("structured_output_admit", spec, fp, vocab)
        if answer["status"] == "ready":
            return
        if answer["status"] == "error":
            raise SystemExit(answer["message"])
        time.sleep(0.02)
    raise SystemExit("grammar admission did not finish")


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["batch_sizes"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {
        "never": "#999",
        "plain": "#4a7",
        "constrained": "#d73",
        "mixed": "#e9a23b",
        "plain2": "#8c8",
    }
    width = 0.8 / len(SETTINGS)
    for j, name in enumerate(SETTINGS):
        xs, ys, lo, hi = [], [], [], []
        for i, n in enumerate(sizes):
            s = result["per_batch"][str(n)]["tpot_ms"][name]
            xs.append(i + (j - (len(SETTINGS) - 1) / 2) * width)
            ys.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
        ax1.bar(xs, ys, width, yerr=[lo, hi], capsize=3, color=colors[name], label=name)
    ax1.set_xticks(range(len(sizes)), [f"batch {n}" for n in sizes])
    ax1.set_ylabel("TPOT = full-batch decode step (ms)")
    ax1.set_title("TPOT per setting (median, min-max over repeats)")
    ax1.legend(fontsize=8)
    ratios = [
        ("enabled_overhead", "constrained / plain"),
        ("disabled_regression", "plain / never"),
        ("neighbour_effect", "mixed / plain"),
        ("aa_control", "A/A control: plain2 / plain"),
    ]
    width = 0.8 / len(ratios)
    rcolors = ["#d73", "#4a7", "#e9a23b", "#bbb"]
    for j, (key, label) in enumerate(ratios):
        for i, n in enumerate(sizes):
            pb = result["per_batch"][str(n)]
            x = i + (j - (len(ratios) - 1) / 2) * width
            s = pb["ratios"][key]
            ax2.bar(
                x,
                s["median"] - 1.0,
                width,
                bottom=1.0,
                color=rcolors[j],
                label=label if i == 0 else None,
            )
            ax2.scatter([x] * len(pb["ratio_runs"][key]), pb["ratio_runs"][key], s=10, c="k")
            if key in ("enabled_overhead", "neighbour_effect"):
                name = "constrained" if key == "enabled_overhead" else "mixed"
                hook = 1.0 + pb["grammar_hooks_share"][name]["median"]
                ax2.plot(
                    [x - width / 2, x + width / 2],
                    [hook, hook],
                    color="b",
                    lw=2,
                    label="1 + grammar hooks / plain" if (i, j) == (0, 0) else None,
                )
            ax2.text(x, s["max"], f"{s['median']:.3f}", ha="center", va="bottom", fontsize=7)
    ax2.axhline(1.0, color="k", lw=0.8)
    lows = [
        v
        for n in sizes
        for runs in result["per_batch"][str(n)]["ratio_runs"].values()
        for v in runs
    ]
    highs = lows + [1.0]
    ax2.set_ylim(min(lows + [1.0]) - 0.05, max(highs) + 0.08)
    ax2.set_xticks(range(len(sizes)), [f"batch {n}" for n in sizes])
    ax2.set_ylabel("paired TPOT ratio (bar from 1: median; dots: repeats)")
    ax2.set_title("paired ratios")
    ax2.legend(fontsize=8, loc="upper left")
    fig.suptitle(
        f"structured output serving, SmolLM2-135M, {result['device']}, "
        f"{result['repeats']} interleaved repeats",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: embedded SmolLM2)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96, help="cap of constrained requests")
    ap.add_argument(
        "--plain-max-tokens", type=int, default=24, help="length of unconstrained requests"
    )
    ap.add_argument("--quick", action="store_true", help="batch 8 only, 2 repeats")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.repeats = [8], 2
    if max(args.batch_sizes) > len(ROLES):
        raise SystemExit(f"at most {len(ROLES)} requests per batch")
    if args.model is None:
        from atom.config import EngineConfig
        from atom.model_loader import resolve_model

        args.model = str(resolve_model(EngineConfig()))
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.child:
        child(args)
        return

    from tqdm import tqdm

    t_start = time.monotonic()
    load_start = round(os.getloadavg()[0], 2)
    if load_start > 0.5:
        print(f"warning: 1-minute load average {load_start}: the machine is busy", flush=True)
    cmd = [sys.executable, __file__, "--child", "--model", args.model]
    cmd += ["--batch-sizes", *map(str, args.batch_sizes), "--max-tokens", str(args.max_tokens)]
    cmd += ["--plain-max-tokens", str(args.plain_max_tokens)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    never_proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert never_proc.stdin is not None and never_proc.stdout is not None

    def never_run(n: int) -> dict:
        never_proc.stdin.write(f"run {n}\n")
        never_proc.stdin.flush()
        line = never_proc.stdout.readline()
        if not line:
            raise SystemExit("the `never` process died")
        return json.loads(line)

    engine = make_engine(args)
    timer = StepTimer(engine, grammar=True)
    # Wait for the child's load and warm-up before this process compiles anything.
    if never_proc.stdout.readline().strip() != "ready":
        raise SystemExit("the `never` process did not start")

    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.structured_output.answer import AnswerValidationError, validate_answer
    from atom.structured_output.spec import StructuredOutputSpec

    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    spec = StructuredOutputSpec.of(parse_chat_response_format(rf), None)
    admit(engine, spec)
    prompts = {n: prompts_for(engine, n) for n in args.batch_sizes}
    specs = {
        n: {
            "plain": [None] * n,
            "plain2": [None] * n,
            "constrained": [spec] * n,
            "mixed": [spec if i % 2 else None for i in range(n)],
        }
        for n in args.batch_sizes
    }
    for n in args.batch_sizes:  # warm up: bind, mask buffers, the plain path
        run(engine, timer, prompts[n], specs[n]["mixed"], args)
        run(engine, timer, prompts[n], specs[n]["plain"], args)

    raw = {n: {k: [] for k in SETTINGS} for n in args.batch_sizes}  # per repeat: run dicts
    total = args.repeats * len(args.batch_sizes) * len(SETTINGS)
    with tqdm(total=total, desc="runs", unit="run") as bar:
        for rep in range(args.repeats):
            order = SETTINGS if rep % 2 == 0 else SETTINGS[::-1]
            for n in args.batch_sizes:
                for name in order:
                    bar.set_postfix_str(f"repeat {rep + 1} batch {n} {name}")
                    if name == "never":
                        r = never_run(n)
                    else:
                        r = run(engine, timer, prompts[n], specs[n][name], args)
                    raw[n][name].append(r)
                    bar.update()
    so_stats = engine.structured_output_stats()
    preemptions = timer.scheduler.num_preemptions
    engine.shutdown()
    never_proc.stdin.write("quit\n")
    never_proc.stdin.flush()
    never_end = json.loads(never_proc.stdout.readline())
    never_proc.wait(timeout=60)

    # ---- checks ----
    failures: list[str] = []
    if never_end["imported"]:
        failures.append(f"the `never` process imported {never_end['imported']}")
    if preemptions or never_end["preemptions"]:
        failures.append("preemption happened (KV cache too small): batches were not full")
    per_batch: dict[str, dict] = {}
    for n in args.batch_sizes:
        plain_idx = [i for i in range(n) if specs[n]["mixed"][i] is None]
        ref = raw[n]["never"][0]["token_ids"]
        outputs_match = True
        for rep in range(args.repeats):
            same = (
                raw[n]["never"][rep]["token_ids"] == ref
                and raw[n]["plain"][rep]["token_ids"] == ref
                and raw[n]["plain2"][rep]["token_ids"] == ref
                and all(raw[n]["mixed"][rep]["token_ids"][i] == ref[i] for i in plain_idx)
            )
            if not same:
                outputs_match = False
                failures.append(f"batch {n} repeat {rep + 1}: unconstrained outputs differ")
        answers = {"constrained": 0, "finished": 0, "validated": 0, "length": 0, "error": 0}
        lengths = []
        for name in ("constrained", "mixed"):
            for rep, r in enumerate(raw[n][name]):
                for i, s in enumerate(specs[n][name]):
                    if s is None:
                        continue
                    answers["constrained"] += 1
                    finish = r["finish"][i]
                    if finish == "stop":
                        answers["finished"] += 1
                        lengths.append(len(r["token_ids"][i]))
                        try:
                            validate_answer(s.constraint, r["texts"][i])
                            answers["validated"] += 1
                        except AnswerValidationError as e:
                            failures.append(
                                f"batch {n} repeat {rep + 1} {name} #{i}: invalid answer {e}"
                            )
                    elif finish == "length":
                        answers["length"] += 1
                    else:
                        answers["error"] += 1
        # constrained answers of a prompt should not depend on batch composition
        c_first = raw[n]["constrained"][0]["token_ids"]
        constrained_stable = all(
            r["token_ids"][i] == c_first[i]
            for name in ("constrained", "mixed")
            for r in raw[n][name]
            for i, s in enumerate(specs[n][name])
            if s is not None
        )
        # ---- TPOT over the common window ----
        tpot_runs: dict[str, list[float]] = {k: [] for k in SETTINGS}
        step_median_runs: dict[str, list[float]] = {k: [] for k in SETTINGS}
        hooks_runs: dict[str, list[float]] = {k: [] for k in SETTINGS if k != "never"}
        windows = []
        for rep in range(args.repeats):
            k = min(len(raw[n][name][rep]["steps_ms"]) for name in SETTINGS)
            if k < 3:
                failures.append(f"batch {n} repeat {rep + 1}: only {k} full-batch decode steps")
            windows.append(k)
            for name in SETTINGS:
                window = raw[n][name][rep]["steps_ms"][:k]
                tpot_runs[name].append(statistics.fmean(window))
                step_median_runs[name].append(statistics.median(window))
                if name != "never":
                    hooks_runs[name].append(statistics.fmean(raw[n][name][rep]["grammar_ms"][:k]))

        def paired(a: str, b: str, runs: dict[str, list[float]]) -> list[float]:
            return [x / y for x, y in zip(runs[a], runs[b], strict=True)]

        def ratios_of(runs: dict[str, list[float]]) -> dict[str, list[float]]:
            return {
                "enabled_overhead": paired("constrained", "plain", runs),
                "disabled_regression": paired("plain", "never", runs),
                "neighbour_effect": paired("mixed", "plain", runs),
                "aa_control": paired("plain2", "plain", runs),
            }

        ratio_runs = ratios_of(tpot_runs)
        per_batch[str(n)] = {
            "window_steps": windows,
            "tpot_ms": {k: spread(v) for k, v in tpot_runs.items()},
            "tpot_ms_runs": tpot_runs,
            "ratios": {k: spread(v) for k, v in ratio_runs.items()},
            "ratio_runs": ratio_runs,
            # ms per window step inside the runner's grammar hooks (commit + mask fill/apply)
            "grammar_hooks_ms": {k: spread(v) for k, v in hooks_runs.items()},
            # the same as a share of the plain TPOT of the repeat: the overhead the hooks
            # account for, measured inside the step (insensitive to machine noise between runs)
            "grammar_hooks_share": {
                k: spread([h / p for h, p in zip(v, tpot_runs["plain"], strict=True)])
                for k, v in hooks_runs.items()
                if k in ("constrained", "mixed")
            },
            "window_steps_ms": {
                k: [
                    [round(x, 2) for x in r["steps_ms"][:w]]
                    for r, w in zip(v, windows, strict=True)
                ]
                for k, v in raw[n].items()
            },
            # robustness check: the same ratios with the median step instead of the mean
            "ratios_step_median": {k: spread(v) for k, v in ratios_of(step_median_runs).items()},
            "constrained_answers": answers,
            "constrained_answer_tokens": spread(lengths) if lengths else None,
            "unconstrained_outputs_match": outputs_match,
            "constrained_outputs_stable": constrained_stable,
            "example_answers": raw[n]["constrained"][0]["texts"][:4],
        }

    import torch

    result = {
        "command": " ".join(["python", "benchmarks/bench_structured_serving.py", *sys.argv[1:]]),
        "device": f"CPU, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads",
        "model": Path(args.model).name,
        "batch_sizes": args.batch_sizes,
        "repeats": args.repeats,
        "max_tokens_constrained": args.max_tokens,
        "max_tokens_unconstrained": args.plain_max_tokens,
        "schema": SCHEMA,
        "tpot_definition": (
            "mean wall time of LLMEngine.step() over the first K decode-only steps in which all "
            "n requests decode (K common to the four settings of a repeat)"
        ),
        "per_batch": per_batch,
        "never_process_imported": never_end["imported"],
        "structured_output_stats_after": so_stats,
        "preemptions": {"parent": preemptions, "never": never_end["preemptions"]},
        "failures": failures,
        "loadavg_1m_start_end": [load_start, round(os.getloadavg()[0], 2)],
        "wall_s": round(time.monotonic() - t_start, 1),
    }

    # ---- table ----
    print()
    print(f"TPOT (ms; median [min-max] over {args.repeats} interleaved repeats)")
    print(f"{'batch':>5} {'window':>7}  " + "".join(f"{k:>22}" for k in SETTINGS))
    for n in args.batch_sizes:
        pb = per_batch[str(n)]
        w = f"{min(pb['window_steps'])}-{max(pb['window_steps'])}"
        cells = "".join(
            f"{s['median']:>8.1f} [{s['min']:.1f}-{s['max']:.1f}]".rjust(22)
            for s in (pb["tpot_ms"][k] for k in SETTINGS)
        )
        print(f"{n:>5} {w:>7}  {cells}")
    print()
    print("paired per-repeat ratios: median [min, max]")
    labels = {
        "enabled_overhead": "enabled-request overhead (constrained / plain)",
        "disabled_regression": "disabled-request regression (plain / never)",
        "neighbour_effect": "neighbour effect (mixed / plain)",
        "aa_control": "A/A control, no change (plain2 / plain)",
    }
    for key, label in labels.items():
        cells = "  ".join(
            "batch {}: {:.3f} [{:.3f}, {:.3f}]".format(
                n, *per_batch[str(n)]["ratios"][key].values()
            )
            for n in args.batch_sizes
        )
        print(f"  {label:<48}{cells}")
    print("  the same with each run's median step instead of its mean (robustness check):")
    for key, label in labels.items():
        cells = "  ".join(
            "batch {}: {:.3f} [{:.3f}, {:.3f}]".format(
                n, *per_batch[str(n)]["ratios_step_median"][key].values()
            )
            for n in args.batch_sizes
        )
        print(f"    {label.split(' (')[0]:<46}{cells}")
    print()
    for n in args.batch_sizes:
        pb = per_batch[str(n)]
        a = pb["constrained_answers"]
        print(
            f"batch {n}: constrained answers {a['finished']}/{a['constrained']} finished, "
            f"{a['validated']}/{a['finished']} validated, {a['length']} hit the cap, "
            f"{a['error']} errors; unconstrained outputs equal across never/plain/plain2/mixed: "
            f"{pb['unconstrained_outputs_match']}; constrained outputs stable: "
            f"{pb['constrained_outputs_stable']}"
        )
    for n in args.batch_sizes:
        h = per_batch[str(n)]["grammar_hooks_ms"]
        share = per_batch[str(n)]["grammar_hooks_share"]
        print(
            f"batch {n}: runner grammar hooks per decode step (ms, median): "
            + ", ".join(f"{k} {v['median']:.2f}" for k, v in h.items())
            + f"  = {100 * share['constrained']['median']:.1f}% (constrained), "
            f"{100 * share['mixed']['median']:.1f}% (mixed) of plain TPOT"
        )
    print(f"`never` process imported structured output: {never_end['imported'] or 'no'}")
    print(f"grammar states after the run: {so_stats}; wall {result['wall_s']} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_structured_serving.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "bench_structured_serving.png")
    print(f"wrote {args.out / 'bench_structured_serving.json'} and .png")
    if failures:
        raise SystemExit("FAILED:\n  " + "\n  ".join(failures))


if __name__ == "__main__":
    main()
