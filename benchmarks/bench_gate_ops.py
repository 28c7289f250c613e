"""Host cost of each operation the engine thread does for one gate (``StructuredOutputWorker``
``gate_send``, ``gate_mask``, ``publish``, ``gate_errors``), one at a time, on CUDA.

A gate's engine-thread work is a dozen small calls: a pickled message down a pipe, two stream
memory operations through ctypes, two H2D copies, the stale-area fill, the mask kernel, the cast
and D2H copy of the sampled ids, and the answer read from the pipe. `bench_structured_serving`
times the hooks as a whole (0.34 ms a step at batch 1 on the H200, 2026-12-03); this says which
calls that time is made of. Each operation runs `--iters` times back to back (a sync between
operations, none inside), its mean host microseconds per call reported at each row count.

Back to back, each call finds the code and data of the last one in the caches; in the engine
a gate's calls come once a step, between a step's other work. `--cold` reads 64 MiB between
calls (untimed) so that each call starts with the caches of another workload, as in the engine.

Prints a table; writes benchmarks/results/bench_gate_ops.json.
    python benchmarks/bench_gate_ops.py --out /tmp/gpu
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
VOCAB = 129280
WORDS = -(-VOCAB // 32)


def _echo(conn) -> None:
    """The child: answer every message with a small dict, as a gate's errors come back."""
    while True:
        try:
            conn.recv()
        except EOFError:
            return
        conn.send((True, {}))


def _timed(fn: Callable[[], object], iters: int, evict: Callable[[], object] | None) -> float:
    """Mean host µs per call of ``fn`` (one untimed call first: a kernel's first launch
    compiles it; the device drained before and after); with ``evict``, each call timed alone
    after it."""
    fn()
    torch.cuda.synchronize()
    elapsed = 0.0
    if evict is None:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        elapsed = time.perf_counter() - start
    else:
        for _ in range(iters):
            evict()
            start = time.perf_counter()
            fn()
            elapsed += time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / iters * 1e6


def measure(rows: int, iters: int, conn, cold: bool = False) -> dict[str, float]:
    """Each of a gate's engine-thread operations at ``rows`` constrained rows."""
    from atom.model_ops.triton_structured_output import apply_token_bitmask_inplace
    from atom.structured_output.stream_flags import (
        current_stream_handle,
        host_register,
        host_unregister,
        stream_wait,
        stream_write,
    )

    dev = torch.device("cuda")
    ring_at = 64 + rows * WORDS * 4 + -(-(rows + 1) * 4 // 64) * 64  # 64-byte aligned
    host = torch.zeros(ring_at + rows * 8, dtype=torch.uint8)
    host_register(dev, host.data_ptr(), host.numel())
    counter = host.data_ptr()
    host_rows = host[64 : 64 + rows * WORDS * 4].view(torch.int32).view(rows, WORDS)
    host_rows.fill_(-1)
    at = 64 + rows * WORDS * 4
    host_index = host[at : at + (rows + 1) * 4].view(torch.int32)
    host_index[:rows] = torch.arange(rows, dtype=torch.int32)
    ring = host[ring_at:].view(torch.int32)
    dev_rows, dev_index = host_rows.to(dev), host_index.to(dev)  # valid rows before the kernel
    logits = torch.randn(rows, VOCAB, device=dev, dtype=torch.bfloat16)
    sampled = torch.zeros(rows, dtype=torch.int64, device=dev)
    stream = current_stream_handle(dev)
    rids = [f"chatcmpl-{uuid.uuid4().hex}" for _ in range(rows)]
    message = ("gate", (7, [(r, [-1], (6, i)) for i, r in enumerate(rids)],
                        [(i, r, [], i) for i, r in enumerate(rids)], 30.0), True)  # fmt: skip
    apply_token_bitmask_inplace(logits, dev_rows, dev_index[:rows])  # compile

    def stale() -> None:
        dev_rows.masked_fill_(dev_index[-1:].ne(7).unsqueeze(1), -1)

    stamp = (dev_index[-1:], 0)  # the kernel's own stale check, in place of ``stale``

    def pipe_round_trip() -> None:
        conn.send(message)
        conn.recv()

    ops = {
        "current_stream": lambda: torch.cuda.current_stream(dev),
        "current_stream_handle": lambda: current_stream_handle(dev),
        "pickle_message": lambda: pickle.dumps(message),
        "pipe_send_and_answer": pipe_round_trip,
        "stream_wait": lambda: stream_wait(stream, counter, 0),
        "copy_rows": lambda: dev_rows.copy_(host_rows, non_blocking=True),
        "copy_index": lambda: dev_index.copy_(host_index, non_blocking=True),
        "stream_write": lambda: stream_write(stream, counter, 0),
        "stale_fill": stale,
        "mask_kernel": lambda: apply_token_bitmask_inplace(logits, dev_rows, dev_index[:rows]),
        "mask_kernel_stamped": lambda: apply_token_bitmask_inplace(
            logits, dev_rows, dev_index[:rows], stamp
        ),
        "ids_cast_int32": lambda: sampled.to(torch.int32),
        "ids_copy_to_ring": lambda: ring[:rows].copy_(sampled.to(torch.int32), non_blocking=True),
        "ids_copy_int64": lambda: (
            ring[: 2 * rows].view(torch.int64).copy_(sampled, non_blocking=True)
        ),
    }
    evict = None
    if cold:
        scratch = torch.ones(64 << 20 >> 3, dtype=torch.float64)
        evict = scratch.sum
    result = {name: _timed(fn, iters, evict) for name, fn in ops.items()}
    host_unregister(dev, host.data_ptr())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--cold", action="store_true", help="each call after 64 MiB read elsewhere")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    conn, child_end = ctx.Pipe()
    child = ctx.Process(target=_echo, args=(child_end,), daemon=True)
    child.start()
    table = {rows: measure(rows, args.iters, conn, args.cold) for rows in args.rows}
    conn.close()
    child.join(timeout=5)
    names = list(next(iter(table.values())))
    caches = "cold (64 MiB read before each call)" if args.cold else "back to back"
    print(f"host µs per call, {args.iters} calls each, {caches}, {torch.cuda.get_device_name()}")
    print(f"{'operation':<22}" + "".join(f"{f'rows {r}':>10}" for r in args.rows))
    for name in names:
        print(f"{name:<22}" + "".join(f"{table[r][name]:>10.1f}" for r in args.rows))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_gate_ops{'_cold' if args.cold else ''}.json"
    path.write_text(
        json.dumps({"iters": args.iters, "cold": args.cold, "us_per_call": table}, indent=2)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
