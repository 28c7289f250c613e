"""Where one engine step's time goes: host segments and the GPU's busy share, per setting.

The same random-weight engine as `bench_structured_serving.py --random-llama-1b` (or SmolLM2 on
CPU), greedy, every request of a batch submitted at once. For each batch size and setting
(`plain`, or constrained by one of that benchmark's schemas), once every request decodes, the
next `--steps` full-batch decode steps run with timers wrapped around the methods a step calls
(on the instances and classes of this process only; nothing in `atom` is changed); then a few
more run under `torch.profiler`, whose CUDA kernels give the share of each step's wall time the
GPU was busy. The segments nest (`read` holds `process`) and some run on the grammar thread
(`fill`, `commit_many`, and `token_wait` partly) at the same time as the engine thread's, so
they do not add up to the step. With gates (a grammar process) the `gate_*` segments are the
engine thread's (`gate_stream_wait`, `gate_stream_write` and `gate_mask_kernel`, the driver's
stream operations and the mask kernel's launch, nest in `gate_mask` and `gate_publish`;
`tensor_copy` is every `Tensor.copy_`, the gates' rows and sampled ids among them) and
`child_gate_ms` / `child_wait_ms` the grammar process's own time per gate, working and waiting
for the stream. `stage_inputs` holds `stage_build` (the host arrays), `stage_pin` (their
page-locking) and `stage_graph_copies` (a decode graph's buffers taking them).

Prints a table of milliseconds per step; writes benchmarks/results/profile_step_{device}.json
and, with `--trace`, a gzipped Chrome trace per setting under `--trace-dir`. With
`--cprofile-steps N`, N more full-batch steps run under `cProfile` on the engine thread (the
grammar process is not profiled), and the functions taking the most of it, by their own time
per step (µs, inflated by the profiler's own cost per call), go into the JSON and the log.
    python benchmarks/profile_step.py --random-llama-1b --device cuda
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import bench_structured_serving as bss  # noqa: E402

RESULTS = Path(__file__).parent / "results"


class Segments:
    """Accumulated wall time per segment name while `on`; a named range of the profiler's
    trace per segment while `annotate` (the profiled steps), on whichever thread runs it."""

    def __init__(self) -> None:
        self.on = False
        self.annotate = False
        self.total: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        import torch

        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a, **kw):
            if self.annotate:
                with torch.profiler.record_function(label):
                    return fn(*a, **kw)
            if not self.on:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total[label] += time.perf_counter() - t0

        setattr(owner, name, timed)


def instrument(engine: Any, segments: Segments) -> None:
    """Timers around the step's host work (see the module docstring)."""
    import torch

    from atom.model_engine.deferred_output import DeferredOutput

    (core,) = engine.cores
    (runner,) = engine.executor.workers
    wraps = [
        # Every tensor copy on any thread, the gates' among them: in place (a busy host, its
        # caches cold between steps) a copy may cost more than bench_gate_ops's 4-7 µs.
        (torch.Tensor, "copy_", "tensor_copy"),
        (core.scheduler, "schedule", "schedule"),
        (core, "_read", "read"),
        (core, "_process", "process"),
        (runner, "_forward", "forward_launch"),
        (runner.model, "compute_logits", "lm_head_launch"),
        (runner, "sampler", "sample_launch"),
        (DeferredOutput, "host_token_ids", "token_wait"),
    ]
    if hasattr(runner, "_stage"):  # the inputs built before the previous sampling is queued
        wraps.append((runner, "_stage", "stage_inputs"))
    # Inside stage_inputs: the host arrays' build, their page-locking, and a decode graph's
    # buffers taking them (four copies).
    if hasattr(runner, "step_inputs"):
        wraps.append((runner.step_inputs, "build", "stage_build"))
    wraps.append((torch.Tensor, "pin_memory", "stage_pin"))
    if getattr(runner, "graphs", None) is not None:
        wraps.append((runner.graphs, "stage", "stage_graph_copies"))
    worker = runner.structured_output
    if worker.manager is not None or worker.pool is not None:  # structured output was used
        wraps += [
            (worker, "start_step", "grammar_start"),  # engine thread
            (worker, "finish_step", "grammar_wait_apply"),  # engine thread
        ]
    if worker.manager is not None:
        wraps += [
            (worker.manager, "fill_masks", "fill"),  # grammar thread
            (worker.manager, "commit_many", "commit_many"),  # grammar thread
        ]
    if worker.pool is not None:  # commit and fill run in the grammar processes
        wraps += [
            (worker.pool.processes[0], "call", "grammar_process_call"),  # grammar thread (drafts)
            (runner, "_gate_commits", "gate_commits"),  # engine thread, from here on
            (worker, "gate_send", "gate_send"),
            (worker, "repeat_gate", "gate_send"),  # a checkout's gate sent again (steady batch)
            (worker, "gate_mask", "gate_mask"),
            (worker, "publish", "gate_publish"),
            (worker, "gate_errors", "gate_answer_wait"),
        ]
        # Inside gate_mask and publish: the driver's stream operations and the mask kernel's
        # launch (the rest of gate_mask is the rows' copy and Python).
        from atom.model_ops import triton_structured_output
        from atom.structured_output import worker as worker_module

        wraps += [
            (worker_module, "stream_wait", "gate_stream_wait"),
            (worker_module, "stream_write", "gate_stream_write"),
            (triton_structured_output, "apply_token_bitmask_inplace", "gate_mask_kernel"),
        ]
    for owner, name, label in wraps:
        if hasattr(owner, name):  # a baseline checkout may predate some of them
            segments.wrap(owner, name, label)


class ChildTiming:
    """With gates: each grammar process's own time per gate (``_Grammars.gate_timing``), busy
    and waiting for the stream, over the gates of the timed steps (read before the first and
    after the last: a call waits for the gates in flight, so never between two timed steps);
    reported for the busiest process."""

    def __init__(self, engine: Any) -> None:
        (runner,) = engine.executor.workers
        worker = runner.structured_output
        self.processes = worker.pool.processes if worker.pool is not None and worker.gates else []
        # gates, busy s, and of that: waited, committing, filling; gates alone (``gate_timing``)
        self.totals = [[0, 0.0, 0.0, 0.0, 0.0, 0] for _ in self.processes]
        self._before: list[tuple] = []

    def start(self) -> None:
        self._before = [p.call("gate_timing") for p in self.processes]

    def stop(self) -> None:
        if not self._before:
            return
        for total, process, before in zip(self.totals, self.processes, self._before, strict=True):
            now = process.call("gate_timing")
            for k, (value, start) in enumerate(zip(now, before, strict=True)):
                total[k] += value - start

    def per_step_ms(self) -> dict:
        busiest = max(self.totals, key=lambda t: t[1] - t[2], default=None)
        if busiest is None or not busiest[0]:
            return {}
        gates, busy_s, waited_s, commit_s, fill_s, alone = busiest
        return {
            "child_alone_share": alone / gates,
            "child_gate_ms": 1000 * (busy_s - waited_s) / gates,
            "child_wait_ms": 1000 * waited_s / gates,
            "child_commit_ms": 1000 * commit_s / gates,
            "child_fill_ms": 1000 * fill_s / gates,
            "grammar_processes": len(self.processes),
        }


def gpu_busy_ms(prof: Any) -> float:
    """Total time covered by at least one CUDA kernel or copy (overlaps counted once)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    )
    busy, end = 0.0, None
    for start, stop in spans:
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1000.0  # profiler times are in microseconds


def run_setting(
    engine: Any,
    segments: Segments,
    prompts: list,
    specs: list,
    args: argparse.Namespace,
    trace: Path | None,
) -> dict:
    """Decode one batch; time `args.steps` full-batch steps, then profile `args.profile_steps`."""
    import torch

    segments.total.clear()
    child = ChildTiming(engine)
    timer = bss.StepTimer(engine)
    bss.add_requests(engine, prompts, specs, args)
    n, walls, profiled, functions = len(prompts), [], None, None
    while engine.has_unfinished_requests():
        full = timer.full_decode(n)
        if full and len(walls) < args.steps:
            if not walls:
                child.start()
            segments.on = True
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
            segments.on = False
            if len(walls) == args.steps:
                child.stop()
        elif full and profiled is None:
            segments.annotate = True
            profiled = profile(engine, args.profile_steps, trace)
            segments.annotate = False
        elif full and functions is None and args.cprofile_steps:
            functions = python_profile(engine, args.cprofile_steps)
        else:
            engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps = len(walls)
    if not steps:
        raise SystemExit(f"batch {n}: no full-batch decode step (raise --max-tokens)")
    out = {"steps": steps, "step_ms": 1000 * statistics.fmean(walls)}
    out.update({k: 1000 * v / steps for k, v in sorted(segments.total.items())})
    out.update(child.per_step_ms())
    if profiled is not None:
        out.update(profiled)
    if functions is not None:
        out["cprofile_us_per_step"] = functions
    return out


def python_profile(engine: Any, num_steps: int, top: int = 40) -> dict[str, float]:
    """`num_steps` steps under cProfile: the `top` functions by own time, µs per step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(num_steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, tottime, ...)
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        f"{Path(f).name}:{line}:{name} x{nc / num_steps:g}": 1e6 * tt / num_steps
        for (f, line, name), (_, nc, tt, _, _) in ranked
    }


def profile(engine: Any, num_steps: int, trace: Path | None) -> dict:
    """`num_steps` steps under torch.profiler: wall and GPU-busy milliseconds per step."""
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if trace is not None:
        raw = trace.with_suffix("")
        prof.export_chrome_trace(str(raw))
        trace.write_bytes(gzip.compress(raw.read_bytes()))
        raw.unlink()
    busy = gpu_busy_ms(prof) if torch.cuda.is_available() else 0.0
    return {
        "profiled_step_ms": 1000 * wall / num_steps,
        "gpu_busy_ms": busy / num_steps,
        "gpu_busy_share": busy / (1000 * wall),
    }


def make_engine(args: argparse.Namespace) -> Any:
    """`bench_structured_serving`'s engine, with this script's thread settings."""
    import torch

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    return bss.make_engine(args)  # reads the grammar flags and --share-from


def print_table(rows: list[dict]) -> None:
    for r in rows:
        for name, us in r.get("cprofile_us_per_step", {}).items():
            print(f"cprofile b{r['batch']} {r['setting']}: {us:8.1f} µs/step {name}")
    skip = {"batch", "setting", "steps", "cprofile_us_per_step"}
    cols = sorted({k for r in rows for k in r} - skip)
    print("ms per full-batch decode step (segments nest; see the docstring)")
    print(f"{'batch':>5} {'setting':<18}" + "".join(f"{c[:14]:>15}" for c in cols))
    for r in rows:
        cells = "".join(
            f"{r[c]:>15.3f}" if isinstance(r.get(c), float) else f"{'-':>15}" for c in cols
        )
        print(f"{r['batch']:>5} {r['setting']:<18}{cells}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-llama-1b", action="store_true")
    ap.add_argument("--model-dir", default="/tmp/atom-random-llama-1b-129k")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--schemas", nargs="+", default=["free-string", "mostly-forbidden"])
    ap.add_argument("--steps", type=int, default=24, help="timed full-batch steps")
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--cprofile-steps", type=int, default=0, help="steps under cProfile")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--grammar-threads", type=int, default=None, help="llguidance executor")
    ap.add_argument(
        "--grammar-process", choices=["on", "off"], default=None, help="default: the engine's (off)"
    )
    ap.add_argument(
        "--grammar-processes", type=int, default=None, help="default: the engine's (by cores)"
    )
    bss.add_share_from(ap)
    ap.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument(
        "--inline-rows",
        type=int,
        default=None,
        help="steps with at most this many constrained rows do their grammar work on the engine "
        "thread (default: structured_output.worker.INLINE_ROWS)",
    )
    ap.add_argument("--tag", default="", help="suffix of the output file")
    ap.add_argument("--trace", action="store_true", help="write gzipped Chrome traces")
    ap.add_argument("--trace-dir", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.plain_max_tokens = args.max_tokens
    args.threads = None
    return args


def main() -> None:
    args = parse_args()
    if args.trace:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    if args.inline_rows is not None:
        from atom.structured_output import worker

        worker.INLINE_ROWS = args.inline_rows
    args.model = bss.resolve_model(args)
    engine = make_engine(args)
    schemas = {k: bss.RANDOM_SCHEMAS[k] for k in args.schemas} if args.random_llama_1b else None
    specs = bss.admitted_specs(engine, schemas or {"person": bss.SCHEMA})
    segments = Segments()
    instrument(engine, segments)
    rows: list[dict] = []
    for n in args.batch_sizes:
        prompts = bss.prompts_for(engine, n, args)
        settings: dict[str, list] = {"plain": [None] * n}
        settings.update({f"constrained:{k}": [s] * n for k, s in specs.items()})
        for name, per_request in settings.items():
            bss.run(engine, bss.StepTimer(engine), prompts, per_request, args)  # warm-up
            trace = None
            if args.trace:
                trace = args.trace_dir / f"trace_b{n}_{name.replace(':', '_')}.json.gz"
            row = run_setting(engine, segments, prompts, per_request, args, trace)
            rows.append({"batch": n, "setting": name, **row})
            print(json.dumps(rows[-1]), flush=True)
    engine.shutdown()
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile_step_{args.device}{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
