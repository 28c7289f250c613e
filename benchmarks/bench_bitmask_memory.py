"""Where the bitmask kernel's time goes on a GPU: the kernel next to plain memory operations of
the same size, at batch 4,096 with 129,280 bf16 logits (1.06 GB) and a 66 MB mask.

Questions it answers, each row timed like ``bench_bitmask_kernel.py`` (CUDA graph, median):
- How fast can logits be written at all? torch's bf16 ``fill_``, the same fill through an int32
  view, and a read-modify-write of every element (``mul_``).
- What does reading a mask cost inside a write stream? Three small kernels write -inf over the
  logits in 8 KB programs: without a mask; reading 128 mask words per program but storing
  without waiting for them; and storing only after the mask arrives (as the masking kernel must).
- How does our kernel compare to those? At 0%, 1% and 100% allowed, and with the same 7.7% of
  16-byte vectors mixed laid out at random, in whole 32-byte sectors, or contiguously per row.
- Does reading the mask in its own phase help? The batch in 1,024-row chunks, each chunk's mask
  first read into L2 by a separate kernel.

Prints a table and writes ``bitmask_memory.json`` + ``.png`` under ``--out``.

Usage (GPU): python benchmarks/bench_bitmask_memory.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atom.model_ops.triton_structured_output import apply_token_bitmask_inplace_triton  # noqa: E402
from benchmarks.bench_bitmask_kernel import random_bitmask, time_graph  # noqa: E402

VOCAB, BATCH = 129280, 4096
WORDS = (VOCAB + 31) // 32
LANES = VOCAB // 2  # int32 lanes per bf16 row
NINF2 = 0xFF80FF80 - 2**32  # two bf16 -inf in one int32 lane

try:
    import triton
    import triton.language as tl
except ImportError:  # the script exits with a message below
    triton = None

if triton is not None:

    @triton.jit
    def _fill_kernel(
        out_ptr, mask_ptr, sink_ptr, n_lanes, n_words, NINF: tl.constexpr, MODE: tl.constexpr
    ):
        # One program: 2,048 int32 lanes (8 KB) of one row, and that tile's 128 mask words.
        # MODE 0: store only. 1: read the words but store first. 2: store after the words arrive.
        row = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0)
        lanes = t * 2048 + tl.arange(0, 2048)
        ptrs = out_ptr + row * n_lanes + lanes
        ninf = tl.full((2048,), NINF, tl.int32)
        if MODE == 0:
            tl.store(ptrs, ninf, mask=lanes < n_lanes)
        else:
            w = t * 128 + tl.arange(0, 128)
            top = tl.max(tl.load(mask_ptr + row * n_words + w, mask=w < n_words, other=0), axis=0)
            if MODE == 1:
                tl.store(ptrs, ninf, mask=lanes < n_lanes)
                tl.store(sink_ptr + t, top)
            else:
                tl.store(ptrs, tl.where(top != 12345, ninf, 0), mask=lanes < n_lanes)

    @triton.jit
    def _prefetch_kernel(mask_ptr, sink_ptr, n):
        # Read mask words into L2 (kept there first on eviction) and nothing else.
        offs = tl.program_id(0) * 2048 + tl.arange(0, 2048)
        words = tl.load(mask_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
        tl.store(sink_ptr + tl.program_id(0), tl.max(words, axis=0))


def vector_masks(share_mixed: float) -> dict[str, torch.Tensor]:
    """Masks where a share of the 8-token vectors (one mask byte each) are mixed (one token
    allowed) and the rest forbidden, laid out at random, in pairs (whole 32-byte sectors), or
    contiguously at the start of each row."""
    n_bytes = WORDS * 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    spread = (torch.rand(BATCH, n_bytes, device="cuda", generator=gen) < share_mixed).to(
        torch.uint8
    )
    pairs = torch.rand(BATCH, n_bytes // 2, device="cuda", generator=gen) < share_mixed
    pairs = pairs.to(torch.uint8).repeat_interleave(2, dim=1).contiguous()
    contiguous = torch.zeros(BATCH, n_bytes, dtype=torch.uint8, device="cuda")
    contiguous[:, : int(share_mixed * n_bytes)] = 1
    return {
        name: m.view(torch.int32)
        for name, m in (("random", spread), ("sectors", pairs), ("contiguous", contiguous))
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available() or triton is None:
        sys.exit("bench_bitmask_memory needs a CUDA GPU and Triton")
    torch.manual_seed(0)
    logits = torch.randn(BATCH, VOCAB, device="cuda").to(torch.bfloat16)
    sink = torch.zeros(1 << 22, dtype=torch.int32, device="cuda")
    zero = torch.zeros(BATCH, WORDS, dtype=torch.int32, device="cuda")
    masks = {
        "0% allowed": zero,
        "1% allowed": random_bitmask(BATCH, VOCAB, 0.01, "cuda"),
        "50% allowed": random_bitmask(BATCH, VOCAB, 0.5, "cuda"),
        "99.9% allowed": random_bitmask(BATCH, VOCAB, 0.999, "cuda"),
        "100% allowed": torch.full((BATCH, WORDS), -1, dtype=torch.int32, device="cuda"),
    }
    masks |= {f"7.7% of vectors mixed, {k}": m for k, m in vector_masks(0.077).items()}
    grid = (triton.cdiv(LANES, 2048), BATCH)

    def fill(mode: int) -> Callable[[torch.Tensor], None]:
        return lambda mask: _fill_kernel[grid](
            logits.view(torch.int32), mask, sink, LANES, WORDS, NINF=NINF2, MODE=mode, num_warps=4
        )

    def chunked(mask: torch.Tensor) -> None:
        for start in range(0, BATCH, 1024):
            part = mask[start : start + 1024]
            _prefetch_kernel[(triton.cdiv(part.numel(), 2048),)](part, sink, part.numel())
            apply_token_bitmask_inplace_triton(logits[start : start + 1024], part)

    rows: list[tuple[str, str, Callable[[torch.Tensor], None]]] = [
        ("write", "torch fill_ (bf16)", lambda m: logits.fill_(float("-inf"))),
        ("write", "torch fill_ (int32 view)", lambda m: logits.view(torch.int32).fill_(NINF2)),
        ("write", "torch mul_ (read + write)", lambda m: logits.mul_(1.0)),
        ("write", "fill kernel, no mask", fill(0)),
        ("write", "fill kernel, mask read, stores first", fill(1)),
        ("write", "fill kernel, stores wait for the mask", fill(2)),
    ]

    def ours(mask: torch.Tensor) -> None:
        apply_token_bitmask_inplace_triton(logits, mask)

    rows += [(name, "ours", ours) for name in masks]
    rows += [
        (name, "ours, 1,024-row chunks, mask prefetched to L2", chunked)
        for name in ("0% allowed", "1% allowed", "50% allowed", "99.9% allowed")
    ]
    results = []
    for mask_name, impl, fn in rows:
        mask = masks.get(mask_name, zero)
        sets = [(logits, mask, mask)]
        times = [
            time_graph(lambda lg, m, _c, _rl, _rt, fn=fn: fn(m), sets, None, None)
            for _ in range(args.rounds)
        ]
        results.append({"mask": mask_name, "impl": impl, "us": statistics.median(times)})
        print(f"{impl:48s} {mask_name:36s} {results[-1]['us']:8.1f} µs", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name(),
        "batch": BATCH,
        "vocab": VOCAB,
        "results": results,
    }
    (args.out / "bitmask_memory.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "bitmask_memory.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    labels = [f"{r['impl']} | {r['mask']}" if r["mask"] != "write" else r["impl"] for r in results]
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(results) + 1))
    ax.barh(range(len(results)), [r["us"] for r in results])
    ax.set_yticks(range(len(results)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("µs per call (CUDA graph)")
    ax.set_title(f"bf16 logits [{report['batch']}, {report['vocab']}] on {report['device']}")
    fig.subplots_adjust(left=0.4, right=0.98)
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
