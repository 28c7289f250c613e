"""Decode attention launch settings on a GPU: every `KernelConfig` (keys per loop step, warps,
pipeline stages) of `paged_decode_attention` at Llama-3.2-1B shapes (32 query heads, 8 KV heads,
head_dim 64, bf16, block_size 16), for the batch sizes and contexts the engine decodes.

Each cell is device µs per call (`bench_paged_attention.graph_us`): a CUDA graph of `LAYERS` calls back to back, each on its own
cache (so the KV reads come from HBM, not L2), median of replays. Every config's output is
checked against the default config's (the kernel the tests compare with the reference). The
best config per case, and the default's time beside it, show what `decode_config` should pick.

Prints a table; writes tune_decode_attention.json under `--out`.
Usage (GPU): python benchmarks/tune_decode_attention.py
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_paged_attention import LAYERS, graph_us  # noqa: E402

from atom.model_ops.paged_attention import KernelConfig, paged_decode_attention  # noqa: E402

HQ, HK, D, PAGE = 32, 8, 64, 16
CASES = [(256, 128), (256, 512), (256, "64-512"), (64, 512), (64, 2048), (16, 2048), (1, 2048)]
CONFIGS = [
    KernelConfig(n, w, s) for n, w, s in itertools.product((32, 64, 128), (1, 2, 4, 8), (1, 2, 3))
]


def make_case(batch: int, ctx: int | str, g: torch.Generator) -> dict:
    """q, per-layer caches and shuffled block tables for `batch` sequences of `ctx` keys."""
    if isinstance(ctx, str):
        low, high = map(int, ctx.split("-"))
        lens = torch.randint(low, high + 1, (batch,), generator=g)
    else:
        lens = torch.full((batch,), ctx)
    need = [-(-int(n) // PAGE) for n in lens]
    perm = torch.randperm(sum(need) + 1, generator=g)
    tables = torch.zeros(batch, max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n]
        used += n
    caches = [
        torch.randn(2, sum(need) + 1, PAGE, HK, D, device="cuda", dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    return {"q": q, "caches": caches, "tables": tables.cuda(), "lens": lens.int().cuda()}


def run(case: dict, config: KernelConfig) -> list[torch.Tensor]:
    return [
        paged_decode_attention(
            case["q"], kv[0], kv[1], case["tables"], case["lens"], D**-0.5, config=config
        )
        for kv in case["caches"]
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    from tqdm import tqdm

    g = torch.Generator().manual_seed(0)
    default = KernelConfig()
    rows = []
    for batch, ctx in CASES:
        case = make_case(batch, ctx, g)
        expected = run(case, default)
        times: dict[str, float] = {}
        for config in tqdm(CONFIGS, desc=f"B={batch} ctx={ctx}"):
            try:
                got = run(case, config)
            except Exception as e:  # noqa: BLE001 - a config Triton cannot build: left out
                print(f"{config}: {type(e).__name__}", flush=True)
                continue
            err = max(
                (a.float() - b.float()).abs().max().item()
                for a, b in zip(got, expected, strict=True)
            )
            if err > 2e-2:
                raise SystemExit(f"{config} differs from the default by {err} at B={batch}")
            times[repr(config)] = graph_us(functools.partial(run, case, config), replays=9)
        best = min(times, key=times.__getitem__)
        row = {
            "batch": batch,
            "ctx": ctx,
            "default_us": times[repr(default)],
            "best": best,
            "best_us": times[best],
            "all_us": times,
        }
        rows.append(row)
        print(
            f"B={batch:>3} ctx={ctx!s:>7}: default {row['default_us']:.1f} us, "
            f"best {row['best_us']:.1f} us {best}",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune_decode_attention.json").write_text(json.dumps(rows, indent=2) + "\n")
    for config in sorted(times, key=lambda c: sum(r["all_us"].get(c, 1e9) for r in rows))[:8]:
        cells = " ".join(f"{r['all_us'].get(config, float('nan')):7.1f}" for r in rows)
        print(f"{config:<55} {cells}")


if __name__ == "__main__":
    main()
