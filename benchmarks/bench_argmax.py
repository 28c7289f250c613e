"""Device time of a greedy argmax over a decode step's logits: torch's `argmax` against the
sampler's `two_pass_argmax` at several chunk counts, bf16 rows of the 129,280-token DeepSeek
vocabulary, for the batch sizes a decode step has. Picks `TWO_PASS_ARGMAX_MAX_ROWS` and
`ARGMAX_CHUNKS` in `atom/model_ops/sampler.py`; both sides' results are checked equal.
Median of CUDA-event timings over `--iters` calls each. Prints a table; writes
bench_argmax_{device}.json and .png under `--out`.
    python benchmarks/bench_argmax.py --device cuda --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from atom.model_ops.sampler import two_pass_argmax

VOCAB = 129280
CHUNKS = (32, 64, 128, 256)


def device_us(fn, logits: torch.Tensor, iters: int) -> float:
    """Median microseconds of `fn(logits)` on the device, one event pair per call."""
    for _ in range(5):
        fn(logits)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(logits)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.device != "cuda" or not torch.cuda.is_available():
        raise SystemExit("bench_argmax times device kernels: it needs --device cuda and a GPU")
    results = []
    for rows in args.rows:
        logits = torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16)
        row = {"rows": rows, "torch_us": device_us(lambda x: x.argmax(dim=-1), logits, args.iters)}
        for chunks in CHUNKS:
            assert torch.equal(two_pass_argmax(logits, chunks), logits.argmax(dim=-1))
            fn = lambda x, c=chunks: two_pass_argmax(x, c)  # noqa: E731
            row[f"two_pass_{chunks}_us"] = device_us(fn, logits, args.iters)
        results.append(row)
    header = f"{'rows':>5}{'torch us':>10}" + "".join(f"{f'2pass/{c} us':>14}" for c in CHUNKS)
    print(header)
    for r in results:
        cells = "".join(f"{r[f'two_pass_{c}_us']:>14.1f}" for c in CHUNKS)
        print(f"{r['rows']:>5}{r['torch_us']:>10.1f}{cells}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_argmax_{args.device}.json").write_text(json.dumps(results, indent=1))
    plot(results, out / f"bench_argmax_{args.device}.png")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r["rows"] for r in results]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rows, [r["torch_us"] for r in results], "o-", label="torch argmax")
    for c in CHUNKS:
        ax.plot(rows, [r[f"two_pass_{c}_us"] for r in results], ".--", label=f"two-pass, {c}")
    ax.set(xscale="log", xlabel="rows", ylabel="device us", title="argmax, bf16, V=129,280")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
