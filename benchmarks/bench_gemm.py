"""The decode step's GEMMs alone, per BLAS backend: where a large batch's device time goes.

At batch 256 the random-weight Llama-3.2-1B step is no longer bound by streaming its weights:
it runs 2 x 1.24e9 x 256 = 635 GFLOP, and the device-only step (`bench_engine.py`) is mostly
GEMMs. This times `F.linear` (bf16) at each of the step's shapes (the fused QKV, the attention
output, the fused gate/up and the down projection of a layer, and the LM head over the
129,280-token vocabulary), for each row count and each of torch's BLAS backends on CUDA
(cuBLAS and cuBLASLt), between CUDA events over `--iters` back-to-back calls, and reports the
microseconds (device time: the calls are replayed from a CUDA graph, as the engine's decode step
is), the TFLOPS, the weights' read rate and the time of a whole step's GEMMs (16 layers and the
LM head).

More candidates, with `--backends`: `cublas-t`, the same product computed transposed
(`W @ X^T`, an [out, rows] result: cuBLAS then sees many rows and few columns and may tile
it better); `inductor`, `torch.compile`'s max-autotune, which tries its Triton GEMM templates
against cuBLAS per shape (its autotuning table goes to the log); and `triton-splitk`, a
split-K Triton GEMM here, the fastest of a few configurations per shape (checked against
`F.linear` first). Does anything beat cuBLAS on the down, QKV and attention-output shapes at
256 rows (350-470 TFLOPS against 660 for gate/up, benchmarks/results/h200_2026-12-04c)?
Prints a table; writes benchmarks/results/bench_gemm.json and .png under `--out`.
    python benchmarks/bench_gemm.py [--rows 1 16 64 256]
    python benchmarks/bench_gemm.py --rows 256 --backends cublas cublas-t inductor
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"
HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 2048, 8192, 16, 129280
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
# (name, output features, input features, calls per decode step)
SHAPES = [
    ("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, LAYERS),
    ("o", HIDDEN, HEADS * HEAD_DIM, LAYERS),
    ("gate_up", 2 * INTERMEDIATE, HIDDEN, LAYERS),
    ("down", HIDDEN, INTERMEDIATE, LAYERS),
    ("lm_head", VOCAB, HIDDEN, 1),
]


BACKENDS = ("cublas", "cublaslt", "cublas-t", "inductor", "triton-splitk")


def splitk_kernel():
    """A split-K GEMM in Triton (imported on first use): program (m, n, s) multiplies a
    [BLOCK_M, BLOCK_N] tile over the s-th of SPLIT equal slices of K and adds it into an fp32
    result (atomically; stores bf16 directly when SPLIT is 1). At 256 rows the down projection
    has 2 x 16 tiles of 128 x 128 for 132 SMs; slicing K gives each SM one."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x, w, out, M, N, K, k_slice, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.program_id(2) * k_slice + tl.arange(0, BLOCK_K)
        xs = x + rm[:, None] * K + rk[None, :]
        ws = w + rn[:, None] * K + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k_slice, BLOCK_K):
            a = tl.load(xs, mask=rm[:, None] < M, other=0.0)
            b = tl.load(ws, mask=rn[:, None] < N, other=0.0)
            acc += tl.dot(a, tl.trans(b))
            xs += BLOCK_K
            ws += BLOCK_K
        at = out + rm[:, None] * N + rn[None, :]
        inside = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT == 1:
            tl.store(at, acc.to(tl.bfloat16), mask=inside)
        else:
            tl.atomic_add(at, acc, mask=inside)

    return kernel


# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, warps, stages) tried per shape; the fastest is reported
SPLITK_CONFIGS = [
    (bm, bn, 64, split, warps, 4)
    for bm in (64, 128)
    for bn in (64, 128)
    for split in (1, 2, 4, 8)
    for warps in (4, 8)
]


def splitk_linear(config: tuple[int, ...]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """x [rows, in] by w [out, in] with ``splitk_kernel`` in ``config``: an fp32 result zeroed,
    accumulated into and cast (one bf16 store with SPLIT 1); in must divide into SPLIT slices
    of whole BLOCK_K steps."""
    block_m, block_n, block_k, split, warps, stages = config
    kernel = splitk_kernel()

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        (m, k), n = x.shape, w.shape[0]
        assert k % (split * block_k) == 0
        out = torch.empty(
            m, n, device=x.device, dtype=torch.bfloat16 if split == 1 else torch.float32
        )
        if split > 1:
            out.zero_()
        grid = (-(-m // block_m), -(-n // block_n), split)
        kernel[grid](x, w, out, m, n, k, k // split, block_m, block_n, block_k, split,
                     num_warps=warps, num_stages=stages)  # fmt: skip
        return out if split == 1 else out.to(torch.bfloat16)

    return linear


def time_splitk(rows: int, out_features: int, in_features: int, iters: int) -> tuple[float, tuple]:
    """The fastest of ``SPLITK_CONFIGS`` for one shape, after checking it against
    ``F.linear``: (microseconds, config)."""
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) / 64
    expected = F.linear(x, w).float()
    best = (float("inf"), ())
    for config in SPLITK_CONFIGS:
        if in_features % (config[3] * config[2]):
            continue
        linear = splitk_linear(config)
        error = (linear(x, w).float() - expected).abs().max().item()
        assert error < 0.05, f"split-K {config}: max error {error}"
        best = min(best, (time_linear(rows, out_features, in_features, iters, linear), config))
    return best


def product(backend: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`backend`'s product of x [rows, in] by w [out, in] (a new compiled function for
    `inductor`: each shape autotunes on its first call)."""
    if backend == "cublas-t":
        return lambda x, w: torch.mm(w, x.t())  # [out, rows]: the result transposed
    if backend == "inductor":
        return torch.compile(
            lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False
        )
    torch.backends.cuda.preferred_blas_library(backend)
    return F.linear


def time_linear(
    rows: int,
    out_features: int,
    in_features: int,
    iters: int,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> float:
    """Device microseconds per `linear` of [rows, in] by [out, in] in bf16: `iters` calls
    captured in a CUDA graph and replayed between two events (launched one by one from
    Python, the small shapes would time the host's launches instead)."""
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
    linear(x, w)  # the algorithm, workspace or compiled kernel is chosen outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            linear(x, w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def measure(rows_list: list[int], iters: int, backends: list[str]) -> list[dict]:
    for limit in ("recompile_limit", "cache_size_limit"):  # inductor: one compile per shape
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    results = []
    for backend in backends:
        for rows in rows_list:
            step_us = 0.0
            for name, out_f, in_f, calls in SHAPES:
                config = None
                if backend == "triton-splitk":
                    us, config = time_splitk(rows, out_f, in_f, iters)
                else:
                    us = time_linear(rows, out_f, in_f, iters, product(backend))
                    torch.backends.cuda.preferred_blas_library("default")
                step_us += us * calls
                results.append(
                    {
                        "backend": backend,
                        "rows": rows,
                        "gemm": name,
                        "us": us,
                        "tflops": 2 * rows * out_f * in_f / (us * 1e-6) / 1e12,
                        "weight_tb_s": 2 * out_f * in_f / (us * 1e-6) / 1e12,
                        "config": config,
                    }
                )
            results.append({"backend": backend, "rows": rows, "gemm": "step", "us": step_us})
    return results


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for backend in sorted({r["backend"] for r in results}):
        rows = [r for r in results if r["backend"] == backend and r["gemm"] == "step"]
        ax.plot([r["rows"] for r in rows], [r["us"] / 1e3 for r in rows], "o-", label=backend)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (decode batch)")
    ax.set_ylabel("GEMMs of one decode step, ms")
    ax.set_title("Llama-3.2-1B shape, bf16, 129,280-token LM head")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--iters", type=int, default=50, help="calls per graph")
    ap.add_argument(
        "--backends", nargs="+", choices=BACKENDS, default=["cublas", "cublaslt"], help="GEMMs"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm needs CUDA")
    results = measure(args.rows, args.iters, args.backends)
    print(f"{'backend':>9} {'rows':>5} {'gemm':>8} {'us':>9} {'TFLOPS':>8} {'weights TB/s':>13}")
    for r in results:
        print(
            f"{r['backend']:>9} {r['rows']:>5} {r['gemm']:>8} {r['us']:>9.1f} "
            f"{r.get('tflops', float('nan')):>8.1f} {r.get('weight_tb_s', float('nan')):>13.2f}"
            + (f"  {r['config']}" if r.get("config") else "")
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_gemm.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": results}, indent=2)
    )
    plot(results, args.out / "bench_gemm.png")
    print(f"wrote {args.out / 'bench_gemm.json'} and {args.out / 'bench_gemm.png'}")


if __name__ == "__main__":
    main()
