"""A/B a kernel change on the GPU: the working tree's bitmask kernel against modified copies of
``atom/model_ops/triton_structured_output.py`` (and XGrammar CUDA when installed), at the same
points and in interleaved rounds (each round starts one implementation later), CUDA-graph timed
like ``bench_bitmask_kernel.py``. Prints one line per point with medians and ratios to ours.

Usage (GPU):
    cp atom/model_ops/triton_structured_output.py /tmp/variant.py   # then edit the copy
    python benchmarks/ab_bitmask_kernel.py /tmp/variant.py [more variants...]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atom.model_ops import triton_structured_output  # noqa: E402
from benchmarks.bench_bitmask_kernel import DTYPES, rotating_sets, time_rounds  # noqa: E402

POINTS = [
    ("bf16", 129280, b, p, r) for b in (512, 4096) for p in (0.01, 0.5, 0.999) for r in (0, 1)
]
POINTS += [("fp32", 129280, b, p, r) for b in (512, 4096) for p in (0.01, 0.5) for r in (0, 1)]
POINTS += [("bf16", 256000, 4096, 0.01, r) for r in (0, 1)]


def kernel_impl(module) -> Callable:
    """The uniform benchmark signature over one kernel module (compact mask with row indices)."""
    return lambda lg, full, compact, rows_l, rows_t: module.apply_token_bitmask_inplace_triton(
        lg, compact if rows_t is not None else full, rows_t
    )


def load_variant(path: Path):
    spec = importlib.util.spec_from_file_location(f"variant_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", type=Path, nargs="+", help="modified copies of the kernel module")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ab_bitmask_kernel needs a CUDA GPU")
    impls = {"ours": kernel_impl(triton_structured_output)}
    impls |= {path.stem: kernel_impl(load_variant(path)) for path in args.variants}
    try:
        import xgrammar as xgr

        impls["xgr_cuda"] = lambda lg, full, compact, rows_l, rows_t: (
            xgr.apply_token_bitmask_inplace(lg, full, indices=rows_t, backend="cuda")
        )
    except ImportError:
        print("xgrammar not installed: ours against the variants only")
    names = list(impls)
    for dname, vocab, batch, share, with_rows in POINTS:
        rows_l = list(range(0, batch, 2)) if with_rows else None
        sets = rotating_sets(DTYPES[dname], vocab, batch, share, rows_l)
        rows_t = torch.tensor(rows_l, dtype=torch.int32, device="cuda") if with_rows else None
        tag = f"{dname} V={vocab} B={batch}"
        times = time_rounds(impls, sets, rows_l, rows_t, args.rounds, tag)
        med = {name: statistics.median(t) if t else float("nan") for name, t in times.items()}
        print(
            f"{dname} V={vocab} B={batch} p={share} rows={'y' if with_rows else 'n'} "
            + " ".join(f"{name}={med[name]:.1f}" for name in names)
            + " | "
            + " ".join(f"{name}/ours={med[name] / med['ours']:.3f}" for name in names[1:]),
            flush=True,
        )
        del sets


if __name__ == "__main__":
    main()
