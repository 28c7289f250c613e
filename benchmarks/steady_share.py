"""How many decode steps are steady (``ScheduledBatch.steady``) under a given load, by scheduler.

A steady step's inputs are the previous step's advanced by one token (`step_inputs`), which
spares the host a pass over every sequence; any other step is built from every sequence. This
runs the real scheduler alone (no model: every sampled token is a fixed id) over a queue of
requests at saturation: `--requests` prompts of 32-511 random tokens, each with max_tokens
uniform in the given range, `--max-num-seqs` running at most, asynchronous scheduling. It
counts the steps that are prefill or mixed (some row computes more than one token), decode-only,
and steady, and the share of rows in steady steps.

Prints a table; writes benchmarks/results/steady_share.json.
    python benchmarks/steady_share.py [--cases 256:64:64 256:64:256 64:64:256 16:64:256]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from atom.config import EngineConfig
from atom.model_engine.block_manager import BlockManager
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import Sequence
from atom.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"


def count_steps(max_seqs: int, low: int, high: int, requests: int, seed: int) -> dict:
    """Steps of one saturated run, by kind (see the module docstring)."""
    rng = random.Random(seed)
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=8192, block_size=16)
    scheduler = Scheduler(config, BlockManager(num_blocks=1 << 20, block_size=16))
    for i in range(requests):
        prompt = [rng.randrange(100, 1000) for _ in range(rng.randrange(32, 512))]
        params = SamplingParams(max_tokens=rng.randrange(low, high + 1), ignore_eos=True)
        scheduler.add(Sequence(f"r{i}", prompt, params))
    counts = {"steps": 0, "prefill_or_mixed": 0, "decode_only": 0, "steady": 0}
    rows = steady_rows = 0
    in_flight = None
    while scheduler.has_unfinished() or in_flight is not None:
        batch = scheduler.schedule()
        if batch.seqs:
            counts["steps"] += 1
            rows += len(batch.seqs)
            decode = max(batch.num_new_tokens) == 1
            counts["decode_only" if decode else "prefill_or_mixed"] += 1
            counts["steady"] += batch.steady
            steady_rows += len(batch.seqs) if batch.steady else 0
        if in_flight is not None:  # asynchronous: read the step before after scheduling this one
            for seq, _ in scheduler.update(in_flight, {s.seq_id: 500 for s in in_flight.seqs}):
                if seq.num_known_tokens >= seq.max_len:
                    scheduler.finish(seq, "length")
        in_flight = batch if batch.seqs else None
    return {**counts, "steady_row_share": steady_rows / rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--cases",
        nargs="+",
        default=["256:64:64", "256:64:256", "64:64:256", "16:64:256"],
        help="MAX_NUM_SEQS:MIN_TOKENS:MAX_TOKENS",
    )
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    rows = []
    print("max_num_seqs  max_tokens  steps  prefill/mixed  decode-only  steady  rows in steady")
    for case in args.cases:
        max_seqs, low, high = (int(x) for x in case.split(":"))
        row = {"max_num_seqs": max_seqs, "max_tokens": [low, high]}
        row |= count_steps(max_seqs, low, high, args.requests, args.seed)
        rows.append(row)
        print(
            f"{max_seqs:12d}  {low:4d}-{high:<5d}  {row['steps']:5d}  {row['prefill_or_mixed']:13d}"
            f"  {row['decode_only']:11d}  {row['steady']:6d}  {row['steady_row_share']:14.0%}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "steady_share.json"
    path.write_text(
        json.dumps({"requests": args.requests, "seed": args.seed, "rows": rows}, indent=1)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
