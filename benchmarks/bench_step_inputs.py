"""Host time of building a step's inputs, by kind of step, under a saturated serving load.

The real scheduler runs alone (no model: every sampled token is a fixed id) over a queue of
`--requests` prompts of 32-511 random tokens, each with max_tokens uniform in a range, at most
`max_num_seqs` running, asynchronous scheduling. Every step's inputs are built by a runner's
`StepInputsBuilder` (the CPU path: no pinning), and its time is kept by kind of step:

- `same`: a decode step (one token a sequence) of the previous step's sequences;
- `changed`: a decode step whose sequences differ from the previous step's (some finished,
  some were admitted after their prefill);
- `mixed`: a step with a prefill chunk.

With `--baseline DIR` (a checkout before a change, e.g. `git worktree add /tmp/atom-base HEAD`)
each repeat runs the baseline and then this checkout, each in its own process importing its own
`atom`, on the same requests; the columns are medians over a run's steps of that kind, then over
the repeats. Prints a table; writes benchmarks/results/bench_step_inputs{_TAG}.json and .png.
    python benchmarks/bench_step_inputs.py --baseline /tmp/atom-base [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
KINDS = ("same", "changed", "mixed")
CASES = ("256:64:64", "256:64:256", "64:64:256", "16:64:256")


def run_case(max_seqs: int, low: int, high: int, requests: int, seed: int) -> dict:
    """Steps of one saturated run by kind: how many, their rows, and the median build time."""
    from atom.config import EngineConfig
    from atom.model_engine.block_manager import BlockManager
    from atom.model_engine.scheduler import Scheduler
    from atom.model_engine.sequence import Sequence
    from atom.model_engine.step_inputs import StepInputsBuilder
    from atom.sampling_params import SamplingParams

    rng = random.Random(seed)
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=8192, block_size=16)
    scheduler = Scheduler(config, BlockManager(num_blocks=1 << 20, block_size=16))
    for i in range(requests):
        prompt = [rng.randrange(100, 1000) for _ in range(rng.randrange(32, 512))]
        params = SamplingParams(max_tokens=rng.randrange(low, high + 1), ignore_eos=True)
        scheduler.add(Sequence(f"r{i}", prompt, params))
    builder = StepInputsBuilder(16)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    rows = dict.fromkeys(KINDS, 0)
    in_flight, last = None, []
    while scheduler.has_unfinished() or in_flight is not None:
        batch = scheduler.schedule()
        if batch.seqs:
            start = time.perf_counter()
            builder.build(batch, len(batch.seqs), pin=False)
            elapsed = time.perf_counter() - start
            if max(batch.num_new_tokens) > 1:
                kind = "mixed"
            else:
                kind = "same" if batch.seqs == last else "changed"
            times[kind].append(elapsed)
            rows[kind] += len(batch.seqs)
            last = batch.seqs
        if in_flight is not None:  # asynchronous: read the step before after scheduling this one
            for seq, _ in scheduler.update(in_flight, {s.seq_id: 500 for s in in_flight.seqs}):
                if seq.num_known_tokens >= seq.max_len:
                    scheduler.finish(seq, "length")
        in_flight = batch if batch.seqs else None
    return {
        kind: {
            "steps": len(times[kind]),
            "rows": rows[kind],
            "us": 1e6 * statistics.median(times[kind]) if times[kind] else None,
        }
        for kind in KINDS
    }


def measure(requests: int, seed: int) -> list[dict]:
    """Every case of `CASES`, in this process (the `--side` child)."""
    results = []
    for case in CASES:
        max_seqs, low, high = (int(x) for x in case.split(":"))
        results.append({"case": case, "kinds": run_case(max_seqs, low, high, requests, seed)})
    return results


def run_side(checkout: Path, requests: int, seed: int) -> list[dict]:
    """`measure` in a process importing `checkout`'s atom."""
    command = [sys.executable, __file__, "--side", str(checkout), "--requests", str(requests)]
    done = subprocess.run(
        [*command, "--seed", str(seed)], check=True, stdout=subprocess.PIPE, text=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def combine(runs: list[list[dict]]) -> list[dict]:
    """Per case and kind, the median over the repeats of each run's median."""
    out = []
    for i, case in enumerate(CASES):
        kinds = {}
        for kind in KINDS:
            first = runs[0][i]["kinds"][kind]
            times = [run[i]["kinds"][kind]["us"] for run in runs]
            us = statistics.median(times) if first["us"] is not None else None
            kinds[kind] = {"steps": first["steps"], "rows": first["rows"], "us": us}
        out.append({"case": case, "kinds": kinds})
    return out


def table(results: dict[str, list[dict]]) -> str:
    sides = list(results)
    head = "max_seqs:tokens    kind     steps  rows/step  " + "  ".join(
        f"{side:>9s} us" for side in sides
    )
    lines = [head]
    for i, case in enumerate(CASES):
        for kind in KINDS:
            first = results[sides[0]][i]["kinds"][kind]
            if not first["steps"]:
                continue
            cells = "  ".join(f"{results[side][i]['kinds'][kind]['us']:12.1f}" for side in sides)
            per_step = first["rows"] / first["steps"]
            lines.append(f"{case:17s}  {kind:7s}  {first['steps']:5d}  {per_step:9.0f}  {cells}")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{case}\n{kind}" for case in CASES for kind in KINDS]
    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.8 / len(results)
    for s, (side, runs) in enumerate(results.items()):
        values = [run["kinds"][kind]["us"] or 0 for run in runs for kind in KINDS]
        ax.bar([x + s * width for x in range(len(labels))], values, width, label=side)
    ax.set_xticks([x + width / 2 for x in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("µs per step (build inputs)")
    ax.set_title("Step-input build time by kind of step (max_num_seqs:min-max tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="another checkout to measure the same way")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--side", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side is not None:
        sys.path.insert(0, str(args.side))
        print(json.dumps(measure(args.requests, args.seed)))
        return
    sides = {"current": ROOT}
    if args.baseline is not None:
        sides = {"baseline": args.baseline.resolve(), **sides}
    runs: dict[str, list] = {side: [] for side in sides}
    for r in range(args.repeats):
        for side, checkout in sides.items():
            print(f"repeat {r + 1}/{args.repeats}: {side}", file=sys.stderr)
            runs[side].append(run_side(checkout, args.requests, args.seed))
    results = {side: combine(side_runs) for side, side_runs in runs.items()}
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"bench_step_inputs{'_' + args.tag if args.tag else ''}.json"
    meta = {"requests": args.requests, "seed": args.seed, "repeats": args.repeats}
    out.write_text(
        json.dumps(
            {**meta, "sides": {k: str(v) for k, v in sides.items()}, "results": results}, indent=1
        )
    )
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
