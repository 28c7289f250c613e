"""Decode time per step of the server's engine (`AsyncLLM`), every output streamed, before and
after a change, on CPU.

`bench_host_step.py` steps `LLMEngine` inline; the server runs it on a background thread that
hands each step's outputs to the requests' asyncio queues on the event loop, where a consumer
per request reads them (as the API's handlers do). This times that path end to end: the tests'
tiny random-weight Llama (`bench_host_step.save_tiny_llama`, so the forward is cheap and the
host work shows), `--batch` greedy requests (`ignore_eos`) submitted at once and consumed to
the end; ms per decode step = (time to T + 1 tokens - time to 1 token) / T, the median of
`--repeats`. With `--baseline DIR` (another checkout) each repeat runs the baseline and then
this checkout, each in its own process importing its own `atom`; both must stream the same
tokens (checked). `--consume stream final`: each side also runs with consumers that ask for the
final output only (`SamplingParams.final_only`, as the server's non-streamed answers do), in
processes of their own, interleaved. Prints a table; writes
benchmarks/results/bench_async_step{_TAG}.json and .png.
    python benchmarks/bench_async_step.py --baseline /tmp/atom-base [--batches 64 256]
    python benchmarks/bench_async_step.py --consume stream final
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"


async def stream_batch(
    llm, prompts: list[list[int]], max_tokens: int, final_only: bool = False
) -> tuple[float, str]:
    """Seconds until every request of the batch has streamed its last output, and a digest of
    the tokens streamed."""
    from atom.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    params.final_only = final_only
    run = random.randrange(10**9)

    async def consume(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in llm.generate(f"b{run}-{i}", prompt, params):
            tokens += out.new_token_ids
        return tokens

    start = time.perf_counter()
    streamed = await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    return elapsed, hashlib.sha256(json.dumps(streamed).encode()).hexdigest()[:16]


def side(args: argparse.Namespace) -> None:
    """One process, one checkout: ms per decode step at each batch size, as a JSON line."""
    import torch
    from bench_host_step import FIRST_ORDINARY_ID, save_tiny_llama  # on the path: main

    from atom.config import EngineConfig
    from atom.model_engine.async_llm import AsyncLLM

    torch.set_num_threads(1)
    model = save_tiny_llama(args.model_dir, args.vocab)
    config = EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        async_scheduling=True,
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(2048, 64 * max(args.batches)),
    )
    llm = AsyncLLM(config)
    result = {}

    async def measure() -> None:
        await stream_batch(llm, [[FIRST_ORDINARY_ID] * 8] * 2, 4)  # warm-up
        for n in args.batches:
            vocab = range(FIRST_ORDINARY_ID, args.vocab)
            prompts = [random.Random(i).choices(vocab, k=args.prompt_tokens) for i in range(n)]
            final_only = args.consume_one == "final"
            first, _ = await stream_batch(llm, prompts, 1, final_only)
            whole, digest = await stream_batch(llm, prompts, args.max_tokens + 1, final_only)
            step_ms = 1000 * (whole - first) / args.max_tokens
            result[n] = {"step_ms": step_ms, "digest": digest}

    try:
        asyncio.run(measure())
    finally:
        llm.shutdown()
    print(json.dumps(result))


def run_side(root: Path, args: argparse.Namespace, consume: str) -> dict:
    command = [sys.executable, __file__, "--side", str(root), "--consume-one", consume]
    command += sys.argv[1:]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return {int(n): r for n, r in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted({r["side"] for r in rows}):
        mine = [r for r in rows if r["side"] == name]
        ax.plot([r["batch"] for r in mine], [r["step_ms"] for r in mine], "o-", label=name)
    ax.set_xlabel("requests streaming at once")
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title("AsyncLLM, tiny random Llama, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_host_step import before_after_args, save_tiny_llama

    before_after_args(ap)
    ap.add_argument("--consume", nargs="+", default=["stream"], choices=["stream", "final"])
    ap.add_argument("--consume-one", default="stream", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side is not None:
        side(args)
        return
    save_tiny_llama(args.model_dir, args.vocab)  # once, here: each side then only loads it
    roots = {"current": ROOT} | ({"baseline": args.baseline} if args.baseline else {})
    sides = {
        name if len(args.consume) == 1 else f"{name}/{consume}": (root, consume)
        for name, root in roots.items()
        for consume in args.consume
    }
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name in sorted(sides):  # baseline, then current
            root, consume = sides[name]
            runs[name].append(run_side(root, args, consume))
    rows = []
    for name, repeats in runs.items():
        for n in args.batches:
            digests = {r[n]["digest"] for r in repeats}
            step = statistics.median(r[n]["step_ms"] for r in repeats)
            rows.append({"side": name, "batch": n, "step_ms": step, "digests": sorted(digests)})
    same = all(
        len({d for r in rows if r["batch"] == n for d in r["digests"]}) == 1 for n in args.batches
    )
    print(f"{'side':>16} {'batch':>6} {'ms/step':>9}")
    for r in rows:
        print(f"{r['side']:>16} {r['batch']:>6} {r['step_ms']:>9.3f}")
    print(f"same tokens streamed on every run and side: {same}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_async_step" + (f"_{args.tag}" if args.tag else "")
    (args.out / f"{stem}.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, default=str)
    )
    plot(rows, args.out / f"{stem}.png")
    print(f"wrote {args.out / (stem + '.json')} and .png")


if __name__ == "__main__":
    main()
