"""Where tensor-parallel ranks should apply the grammar bitmask: to the gathered logits (each rank
masks all of them) or to its own vocabulary shard before the all-gather (each rank masks 1/tp).

Two rank processes over gloo on this CPU, each holding its shard ``[B, V / 2]`` of float32 logits
for the DeepSeek vocabulary (129,280 tokens) and the full packed bitmask ``[B, ceil(V / 32)]``
(random words), as a step of B constrained rows has them. Per batch size, medians over
``--reps`` rounds (ranks meet at a barrier before each) of:

- ``gather_then_mask``: all-gather the shards, then mask the full rows (what ATOM does);
- ``mask_then_gather``: mask the shard with the mask words it owns, then all-gather;
- the parts alone: ``gather``, ``mask_full``, ``mask_shard``.

Both orders must give the same logits bit for bit (checked every round, before timing). Prints
a table; writes benchmarks/results/bench_tp_mask.json and .png.
    python benchmarks/bench_tp_mask.py [--batches 1 16 64] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from atom.model_ops.embed_head import DEFAULT_VOCAB_PADDING, pad_vocab
from atom.model_ops.triton_structured_output import apply_token_bitmask_inplace

RESULTS = Path(__file__).parent / "results"
DEEPSEEK_VOCAB = 129_280
TP = 2
WAYS = ("gather_then_mask", "mask_then_gather", "gather", "mask_full", "mask_shard")


def _gather(shard: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, shard)
    return torch.cat(parts, dim=-1)


def _shard_words(bitmask: torch.Tensor, rank: int, per_rank: int) -> torch.Tensor:
    """The mask words of this rank's columns (a shard starts on a 32-token word boundary)."""
    assert per_rank % 32 == 0
    first = rank * per_rank // 32
    return bitmask[:, first : first + per_rank // 32].contiguous()


def gather_then_mask(shard: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    logits = _gather(shard)
    apply_token_bitmask_inplace(logits, bitmask)
    return logits


def mask_then_gather(shard: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    apply_token_bitmask_inplace(shard, words)
    return _gather(shard)


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _measure(b: int, rank: int, padded: int, reps: int) -> dict:
    """One batch size's row: parity of the two orders, then each way's median."""
    per_rank = padded // TP
    gen = torch.Generator().manual_seed(b)  # the same bitmask on every rank
    bitmask = torch.randint(-(2**31), 2**31 - 1, (b, padded // 32), generator=gen)
    bitmask = bitmask.to(torch.int32)
    shard = torch.randn(b, per_rank, generator=torch.Generator().manual_seed(b * TP + rank))
    words = _shard_words(bitmask, rank, per_rank)
    full = _gather(shard)
    parity = torch.equal(
        gather_then_mask(shard.clone(), bitmask), mask_then_gather(shard.clone(), words)
    )
    cases = {
        "gather_then_mask": lambda: gather_then_mask(shard.clone(), bitmask),
        "mask_then_gather": lambda: mask_then_gather(shard.clone(), words),
        "gather": lambda: _gather(shard.clone()),
        "mask_full": lambda: apply_token_bitmask_inplace(full.clone(), bitmask),
        "mask_shard": lambda: apply_token_bitmask_inplace(shard.clone(), words),
    }
    row = {"batch": b, "parity": parity} | {k: _median_ms(f, reps) for k, f in cases.items()}
    row["clone_ms"] = _median_ms(lambda: shard.clone(), reps)  # in every case but mask_full
    return row


def _rank_main(rank: int, port: int, batches: list[int], reps: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    padded = pad_vocab(DEEPSEEK_VOCAB, DEFAULT_VOCAB_PADDING * TP)
    rows = [_measure(b, rank, padded, reps) for b in batches]
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(batches: list[int], reps: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, batches, reps, out)) for r in range(TP)]
    for p in procs:
        p.start()
    rows = out.get(timeout=1800)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise SystemExit(f"rank process exited with {p.exitcode}")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for way in WAYS:
        ax.plot(xs, [r[way] for r in rows], "o-" if "_then_" in way else "x:", label=way)
    ax.set(xscale="log", yscale="log", xlabel="constrained rows (batch)", ylabel="ms (median)")
    ax.set_title(f"TP={TP} over gloo, CPU, vocabulary {DEEPSEEK_VOCAB:,}, float32", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    rows = run(args.batches, args.reps)
    print(f"{'B':>4} " + " ".join(f"{w:>17}" for w in WAYS) + "  parity")
    for r in rows:
        cells = " ".join(f"{r[w]:>17.2f}" for w in WAYS)
        print(f"{r['batch']:>4} {cells}  {r['parity']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"tp": TP, "vocab": DEEPSEEK_VOCAB, "dtype": "float32", "reps": args.reps}
    (out / "bench_tp_mask.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, out / "bench_tp_mask.png")
    print(f"wrote {out / 'bench_tp_mask.json'} and {out / 'bench_tp_mask.png'}")


if __name__ == "__main__":
    main()
