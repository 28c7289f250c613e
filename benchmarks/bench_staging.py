"""GPU: what staging a step's inputs costs the host, operation by operation.

A decode step's host arrays reach the device as the engine stages them today: each array is
page-locked afresh (`Tensor.pin_memory`, from PyTorch's caching host allocator), then copied
into a CUDA graph's buffers (`copy_`, one a field; the block table into a wider buffer, a
strided destination) or to a new device tensor (`.to`). This times each of those host calls
against the alternatives a persistent staging buffer would use: a numpy copy into page-locked
memory allocated once (`torch.empty(pin_memory=True)`) or registered once with the driver
(`cudaHostRegister` on a numpy array, which the caching allocator does not track), copies from
it, device-to-device copies, and the CUDA event a ring of such buffers records each step.

The stream is kept busy (a `torch.cuda._sleep` ahead of every batch of calls) so that copies
are queued behind work, as in the engine's asynchronous steps. Each row is the median over
`--repeats` batches of the mean host µs of `--calls` calls. Prints a table; writes
benchmarks/results/bench_staging{_TAG}.json and .png.
    python benchmarks/bench_staging.py [--rows 64 256] [--width 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).parent / "results"


def host_us(call: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over `repeats` of the mean host time of `calls` calls, the stream busy."""
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU spinning ahead of the calls
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def registered(array: np.ndarray) -> torch.Tensor:
    """`array` registered with the driver as page-locked (outside PyTorch's allocator)."""
    cudart = torch.cuda.cudart()
    assert cudart.cudaHostRegister(array.ctypes.data, array.nbytes, 0) == 0
    return torch.from_numpy(array)


def operations(rows: int, width: int) -> dict[str, Callable[[], object]]:
    """The host calls of one step's staging at `rows` sequences, `width` table columns."""
    dev = torch.device("cuda")
    longs = np.arange(4 * rows, dtype=np.int64)  # ids, positions, slots, sample rows
    ints = np.ones(rows * (1 + width), dtype=np.int32)  # context lengths, block tables
    pinned_longs = torch.from_numpy(longs).pin_memory()
    table = torch.from_numpy(ints[rows:]).pin_memory().view(rows, width)
    graph_positions = torch.zeros(rows, dtype=torch.long, device=dev)
    graph_tables = torch.zeros(rows, 4 * width, dtype=torch.int32, device=dev)
    device_longs = torch.zeros(4 * rows, dtype=torch.long, device=dev)
    persistent = torch.empty(4 * rows, dtype=torch.long, pin_memory=True)
    persistent_view = persistent.numpy()
    registered_longs = registered(np.empty(4 * rows, dtype=np.int64))
    registered_view = registered_longs.numpy()
    event = torch.cuda.Event()
    done = torch.cuda.Event()
    done.record()
    torch.cuda.synchronize()
    return {
        "pin_memory (longs)": lambda: torch.from_numpy(longs).pin_memory(),
        "pin_memory (ints)": lambda: torch.from_numpy(ints).pin_memory(),
        "copy_ pinned -> graph buffer": lambda: graph_positions.copy_(
            pinned_longs[:rows], non_blocking=True
        ),
        "copy_ pinned table -> wider buffer": lambda: graph_tables[:, :width].copy_(
            table, non_blocking=True
        ),
        "to(device) pinned": lambda: pinned_longs.to(dev, non_blocking=True),
        "numpy copy into persistent pinned": lambda: np.copyto(persistent_view, longs),
        "copy_ persistent pinned -> device": lambda: device_longs.copy_(
            persistent, non_blocking=True
        ),
        "numpy copy into registered": lambda: np.copyto(registered_view, longs),
        "copy_ registered -> device": lambda: device_longs.copy_(
            registered_longs, non_blocking=True
        ),
        "copy_ device -> graph buffer": lambda: graph_positions.copy_(device_longs[:rows]),
        "copy_ device table -> wider buffer": lambda: graph_tables[:, :width].copy_(
            graph_tables[:, width : 2 * width]
        ),
        "event record": lambda: event.record(),
        "event synchronize (done)": lambda: done.synchronize(),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(next(iter(result["rows"].values())))
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(result["rows"])
    for k, (rows, times) in enumerate(result["rows"].items()):
        ax.barh([i + k * width for i in range(len(names))], times.values(), width, label=rows)
    ax.set_yticks([i + width / 2 for i in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("host µs per call (stream busy)")
    ax.set_title(f"Staging a step's inputs, by operation ({result['device']})")
    ax.legend(title="rows")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--width", type=int, default=64, help="block-table columns")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_staging.py times CUDA host calls: no CUDA device here")
    result = {"device": torch.cuda.get_device_name(), "width": args.width, "rows": {}}
    for rows in args.rows:
        ops = operations(rows, args.width)
        result["rows"][rows] = {
            name: host_us(call, args.calls, args.repeats) for name, call in ops.items()
        }
    names = list(next(iter(result["rows"].values())))
    print(f"{'operation':40s}" + "".join(f"{r:>10d}" for r in args.rows) + "  (host µs)")
    for name in names:
        cells = "".join(f"{result['rows'][r][name]:10.2f}" for r in args.rows)
        print(f"{name:40s}{cells}")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"bench_staging{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
