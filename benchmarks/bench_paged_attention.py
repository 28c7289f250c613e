"""Attention per layer on a GPU: the paged Triton kernels against the SDPA-over-gathered-blocks
path that CUDA ran before, at Llama-3.2-1B shapes (32 query heads, 8 KV heads, head_dim 64,
bf16, block_size 16, 16 layers).

Each row is one `Attention` layer call, the KV write included, through either path:

- sdpa: `index_copy_` + `index_select` of every block in the padded table + one SDPA with the
  dense mask (`prepare_attention` runs once per step, outside the timing, as in the runner);
- paged: `store_kv` + `paged_decode_attention` (decode rows) or `paged_prefill_attention`.

Decode: batch 1/16/64/256 at context 512, 2048 and ragged (uniform in 512-2048; the SDPA path
pads to the longest). Prefill: one 2048-token prompt, eight 512-token prompts, four 512-token
chunks at context 2048. Times are µs per layer call: `graph` is device time (a CUDA graph of the
16 layers back to back, each reading its own cache, median of replays), `eager` is wall time of
the same calls launched from Python (host cost included). `GB/s` is the K/V bytes the sequences
own over the paged graph time.

Prints a table and writes `paged_attention.json` + `.png` under `--out`.

Usage (GPU): python benchmarks/bench_paged_attention.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atom.model_ops import attention  # noqa: E402
from atom.model_ops.context import AttentionContext, set_context  # noqa: E402

HQ, HK, D, PAGE, LAYERS = 32, 8, 64, 16, 16
DTYPE = torch.bfloat16


def make_step(ctx_lens: list[int], q_lens: list[int], g: torch.Generator) -> dict:
    """Random q/k/v and per-layer caches; each sequence owns shuffled blocks, as in the engine."""
    need = [-(-c // PAGE) for c in ctx_lens]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(ctx_lens), max(need), dtype=torch.long)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n]
        used += n
    q_lens_t = torch.tensor(q_lens)
    pos = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx_lens, q_lens, strict=True)])
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)
    dev = "cuda"
    ctx = AttentionContext(
        slot_mapping=(tables[seq, pos // PAGE] * PAGE + pos % PAGE).to(dev),
        block_tables=tables.to(dev),
        context_lens=torch.tensor(ctx_lens).to(dev),
        query_lens=q_lens_t.to(dev),
        cu_seqlens_q=torch.nn.functional.pad(q_lens_t.cumsum(0), (1, 0)).to(dev),
        max_query_len=max(q_lens),
    )
    t = int(q_lens_t.sum())
    qkv = [torch.randn(t, h, D, device=dev, dtype=DTYPE) for h in (HQ, HK, HK)]
    caches = [
        torch.randn(2, num_blocks, PAGE, HK, D, device=dev, dtype=DTYPE) for _ in range(LAYERS)
    ]
    return {"ctx": ctx, "qkv": qkv, "caches": caches}


def layer_calls(step: dict, paged: bool) -> Callable[[], None]:
    """One call per layer, each on its own cache, through the chosen path."""
    attention._paged_kernels = lambda x: paged
    ctx = AttentionContext(**vars(step["ctx"]))
    attention.prepare_attention(ctx, PAGE)
    layers = []
    for cache in step["caches"]:
        layer = attention.Attention(HQ, D, D**-0.5, HK)
        layer.k_cache, layer.v_cache = cache[0], cache[1]
        layers.append(layer)

    def run() -> None:
        attention._paged_kernels = lambda x: paged
        set_context(ctx)
        for layer in layers:
            layer(*step["qkv"])

    return run


def graph_us(run: Callable[[], None], replays: int = 7) -> float:
    """Median device µs per layer call, from replays of a CUDA graph of `run`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAYERS)
    del graph
    return statistics.median(times)


def eager_us(run: Callable[[], None], rounds: int = 10) -> float:
    """Wall µs per layer call launched from Python, host cost included."""
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / (rounds * LAYERS)


def cases(g: torch.Generator) -> list[tuple[str, str, list[int], list[int]]]:
    out = []
    for batch in (1, 16, 64, 256):
        ragged = torch.randint(512, 2049, (batch,), generator=g).tolist()
        for name, lens in (("512", [512] * batch), ("2048", [2048] * batch), ("ragged", ragged)):
            out.append(("decode", f"B={batch} ctx={name}", lens, [1] * batch))
    out.append(("prefill", "1 x 2048-token prompt", [2048], [2048]))
    out.append(("prefill", "8 x 512-token prompts", [512] * 8, [512] * 8))
    out.append(("prefill", "4 x 512-token chunks at ctx 2048", [2048] * 4, [512] * 4))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_paged_attention needs a CUDA GPU and Triton")
    g = torch.Generator().manual_seed(0)
    results = []
    print(f"{'case':40s} {'sdpa graph':>11s} {'paged graph':>12s} {'speedup':>8s} "
          f"{'sdpa eager':>11s} {'paged eager':>12s} {'paged GB/s':>11s}")  # fmt: skip
    for kind, name, ctx_lens, q_lens in cases(g):
        step = make_step(ctx_lens, q_lens, g)
        row = {"kind": kind, "case": name, "tokens": sum(q_lens), "context": sum(ctx_lens)}
        for impl, paged in (("sdpa", False), ("paged", True)):
            run = layer_calls(step, paged)
            row[f"{impl}_graph_us"] = graph_us(run)
            row[f"{impl}_eager_us"] = eager_us(run)
        kv_bytes = 2 * sum(ctx_lens) * HK * D * DTYPE.itemsize
        row["paged_gbps"] = kv_bytes / row["paged_graph_us"] / 1e3
        results.append(row)
        print(f"{kind + ' ' + name:40s} {row['sdpa_graph_us']:11.1f} {row['paged_graph_us']:12.1f} "
              f"{row['sdpa_graph_us'] / row['paged_graph_us']:7.1f}x {row['sdpa_eager_us']:11.1f} "
              f"{row['paged_eager_us']:12.1f} {row['paged_gbps']:11.0f}", flush=True)  # fmt: skip
        del step
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name(),
        "shapes": {"hq": HQ, "hk": HK, "head_dim": D, "block_size": PAGE, "layers": LAYERS},
        "dtype": str(DTYPE),
        "results": results,
    }
    (args.out / "paged_attention.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "paged_attention.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    labels = [f"{r['kind']} {r['case']}" for r in results]
    y = range(len(results))
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(results) + 1.5))
    for offset, impl in ((-0.2, "sdpa"), (0.2, "paged")):
        times = [r[f"{impl}_graph_us"] for r in results]
        ax.barh([i + offset for i in y], times, height=0.4, label=f"{impl} (CUDA graph)")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("µs per layer call (device time)")
    ax.set_title(f"Attention, Llama-3.2-1B shapes, bf16, on {report['device']}")
    ax.legend()
    fig.subplots_adjust(left=0.3, right=0.98)
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
