"""Host time of one engine decode step per sequence, on CPU, before and after a change.

A tiny random-weight Llama (the tests' 2-layer one, hidden 64, with the embedded SmolLM2
tokenizer; its LM head covers the first `--vocab` ids) keeps the forward cheap, so that the step
is mostly the engine's own host work. For each scheduling mode (asynchronous on and off) and
batch size, a batch of greedy requests (distinct random prompts, `ignore_eos`, fixed
`max_tokens`) decodes after a warm-up batch; every step whose batch (and, asynchronously, the
one read in it) holds every request decoding is timed by segment, with timers wrapped around
methods of this process's engine instances (nothing in `atom` changes):

- host: `schedule` (Scheduler.schedule), `read` (EngineCore._read: the runner's output, then
  `update` and per request `_process`), `build_inputs` (the runner's StepInputsBuilder.build),
  `sampling_tensors` (ModelRunner._sampling_tensors) and `execute_rest` (the rest of the
  runner's host work in a step: `execute`, ModelRunner._execute, less the build, the sampling
  tensors and the compute columns below); `host` is their sum, `us/seq` that sum per sequence.
  `update` and `take_output` nest in `read`;
- compute: `model` (the forward), `logits`, `sample`; `forward` (ModelRunner._forward) holds
  `fill` (the inputs the host has not read yet, taken on the device from the step that sampled
  them) and `model`; `step` is the wall time of `LLMEngine.step`;
- garbage collection: `gc` is the time the collector ran during the step (``gc.callbacks``),
  on whichever segment it interrupted. Its pauses fall in a few steps, which a median hides:
  `step_mean` and `gc_mean` are means over the timed steps.

Each column is the median over the timed steps, then over `--repeats` runs. With `--baseline
DIR` (a checkout of the code before the change, e.g. `git worktree add /tmp/atom-base HEAD`)
each repeat runs the baseline and then the current checkout, each in its own process importing
its own `atom`, so that the two sides interleave; both must produce the same token ids and text
(checked). Prints a table; writes benchmarks/results/bench_host_step{_TAG}.json and .png.
    python benchmarks/bench_host_step.py --baseline /tmp/atom-base [--repeats 5]
    python benchmarks/bench_host_step.py --baseline /tmp/atom-base --max-tokens 512 --tag long
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
FIRST_ORDINARY_ID = 17  # SmolLM2's ids below it are special tokens
HOST = ("schedule", "read", "build_inputs", "sampling_tensors", "execute_rest")
NESTED = ("update", "take_output", "execute", "forward", "fill", "model", "logits", "sample")
# The model runner's own host work in a step: `execute` but what other columns time in it.
IN_EXECUTE = ("build_inputs", "sampling_tensors", "forward", "logits", "sample")
MEANS = ("step_mean", "gc_mean")
COLUMNS = ("step", *HOST, *NESTED, "host", "us/seq", *MEANS)


def save_tiny_llama(folder: Path, vocab_size: int) -> Path:
    """The tests' tiny random-weight Llama (fixed seed) with the SmolLM2 tokenizer, once; its
    LM head covers the first `vocab_size` ids only, so that the logits stay cheap."""
    folder = folder / f"vocab{vocab_size}"
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoTokenizer

    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from conftest import _save_tiny_llama

    from atom.config import EngineConfig
    from atom.model_loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(EngineConfig()))
    _save_tiny_llama(folder, vocab_size, 2048, tokenizer.bos_token_id, tokenizer.eos_token_id)
    tokenizer.save_pretrained(folder)
    return folder


def instrument(engine: Any, segments: Any) -> None:
    """Timers around the step's segments (see the module docstring)."""
    from atom.model_engine import model_runner

    (core,) = engine.cores
    (runner,) = engine.executor.workers
    # The runner's step-inputs builder; a checkout before it (a baseline) has the function.
    builder = getattr(runner, "step_inputs", None)
    inputs = (builder, "build") if builder is not None else (model_runner, "build_step_inputs")
    wraps = [
        (core.scheduler, "schedule", "schedule"),
        (core.scheduler, "update", "update"),
        (core, "_read", "read"),
        (core.executor, "take_output", "take_output"),
        (*inputs, "build_inputs"),
        (runner, "_sampling_tensors", "sampling_tensors"),
        (runner, "_execute", "execute"),
        (runner, "_forward", "forward"),
        (runner, "_fill_placeholders", "fill"),
        (runner.model, "forward", "model"),
        (runner.model, "compute_logits", "logits"),
        (runner, "sampler", "sample"),
    ]
    for owner, name, label in wraps:
        segments.wrap(owner, name, label)


def make_engine(model: Path, async_scheduling: bool, max_seqs: int) -> Any:
    from atom.config import EngineConfig
    from atom.model_engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        async_scheduling=async_scheduling,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(2048, 64 * max_seqs),
    )
    return LLMEngine(config)


def decode_batch(engine: Any, segments: Any, n: int, args: argparse.Namespace) -> dict:
    """One batch of `n` requests to completion; segment milliseconds per timed step and a
    digest of what every request produced."""
    import bench_structured_serving as bss

    timer = bss.StepTimer(engine)
    collecting = GcTimer()
    vocab = range(FIRST_ORDINARY_ID, engine.hf_config.vocab_size)
    prompts = [random.Random(i).choices(vocab, k=args.prompt_tokens) for i in range(n)]
    add_requests(engine, prompts, args)
    finals: dict[str, Any] = {}
    timed: list[dict[str, float]] = []
    while engine.has_unfinished_requests():
        segments.total.clear()
        segments.on = True
        collecting.seconds = 0.0
        t0 = time.perf_counter()
        outs = engine.step()
        segments.total["step"] += time.perf_counter() - t0
        segments.total["gc"] = collecting.seconds
        segments.on = False
        if timer.full_decode(n):
            step = {k: 1000 * v for k, v in segments.total.items()}
            step["execute_rest"] = step["execute"] - sum(step.get(k, 0.0) for k in IN_EXECUTE)
            step["host"] = sum(step.get(k, 0.0) for k in HOST)
            step["us/seq"] = 1000 * step["host"] / n
            timed.append(step)
        finals.update({o.request_id: o for o in outs if o.finished})
    collecting.close()
    row = {k: statistics.median(s.get(k, 0.0) for s in timed) for k in COLUMNS if k not in MEANS}
    row["step_mean"] = statistics.fmean(s["step"] for s in timed)
    row["gc_mean"] = statistics.fmean(s["gc"] for s in timed)
    ordered = [finals[r] for r in sorted(finals, key=lambda r: int(r[1:]))]
    digest = hashlib.sha256(repr([(o.output_token_ids, o.text) for o in ordered]).encode())
    return {"steps": len(timed), **row, "digest": digest.hexdigest()[:16]}


def add_requests(engine: Any, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """Greedy requests of `--max-tokens` each, final-only with `--final-only` (as
    `LLM.generate` and a non-streamed API request are: no output per step)."""
    from atom.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, final_only=args.final_only
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)


class GcTimer:
    """Seconds the garbage collector ran since ``seconds`` was last reset."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._on_phase)

    def _on_phase(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def close(self) -> None:
        gc.callbacks.remove(self._on_phase)


def run_side(args: argparse.Namespace) -> None:
    """Child process: every (mode, batch) on one checkout (`--side`), its rows printed."""
    import torch

    sys.path.insert(0, str(args.side))
    import profile_step

    import atom

    assert Path(atom.__file__).resolve().is_relative_to(args.side.resolve()), atom.__file__
    torch.set_num_threads(args.torch_threads)
    rows = []
    for mode in args.modes:
        engine = make_engine(args.model_dir, mode == "async", max(args.batches))
        segments = profile_step.Segments()
        instrument(engine, segments)
        for n in args.batches:
            decode_batch(engine, segments, n, args)  # warm-up
            rows.append({"mode": mode, "batch": n, **decode_batch(engine, segments, n, args)})
        engine.shutdown()
    print(json.dumps(rows))


def measure(checkout: Path, args: argparse.Namespace) -> list[dict]:
    """One side in a fresh process (its own `atom` import): its rows, its last line of output."""
    command = [sys.executable, __file__, *common_args(args), "--side", str(checkout)]
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def common_args(args: argparse.Namespace) -> list[str]:
    return [
        "--modes",
        *args.modes,
        "--batches",
        *map(str, args.batches),
        "--max-tokens",
        str(args.max_tokens),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--torch-threads",
        str(args.torch_threads),
        "--model-dir",
        str(args.model_dir),
        *(["--final-only"] if args.final_only else []),
    ]


def median_rows(repeats: list[list[dict]]) -> list[dict]:
    """Per (mode, batch): the median of each column over the repeats."""
    out = []
    for rows in zip(*repeats, strict=True):
        digests = {r["digest"] for r in rows}
        assert len(digests) == 1, f"outputs differ between repeats: {rows}"
        med = {c: statistics.median(r.get(c, 0.0) for r in rows) for c in COLUMNS}
        out.append({**rows[0], **med})
    return out


def print_table(results: dict[str, list[dict]]) -> None:
    print("ms per full-batch decode step (median over repeats); us/seq = host / batch")
    header = f"{'side':<9} {'mode':<6} {'batch':>5}"
    print(header + "".join(f" {c:>12}" for c in COLUMNS))
    for side, rows in results.items():
        for r in rows:
            line = f"{side:<9} {r['mode']:<6} {r['batch']:>5}"
            print(line + "".join(f" {r[c]:>12.3f}" for c in COLUMNS))
    if "baseline" in results:
        for base, cur in zip(results["baseline"], results["current"], strict=True):
            same = "same outputs" if base["digest"] == cur["digest"] else "OUTPUTS DIFFER"
            print(
                f"{cur['mode']:<6} batch {cur['batch']:>4}: host per sequence "
                f"{base['us/seq']:.2f} -> {cur['us/seq']:.2f} us "
                f"({base['us/seq'] / cur['us/seq']:.2f}x), {same}"
            )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = result["results"]
    labels = [f"{r['mode']} {r['batch']}" for r in results["current"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(results)
    for s, (side, rows) in enumerate(results.items()):
        bottom = [0.0] * len(rows)
        for k, segment in enumerate(HOST):
            heights = [1000 * r[segment] / r["batch"] for r in rows]
            xs = [i + s * width for i in range(len(rows))]
            ax.bar(xs, heights, width, bottom=bottom, color=f"C{k}", alpha=1 - 0.4 * s)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for i, b in enumerate(bottom):
            ax.text(i + s * width, b, side, ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(labels))], labels)
    ax.set_ylabel("host us per sequence per decode step")
    ax.legend(HOST, fontsize=8)
    ax.set_title(f"engine host time per decode step, CPU ({result['meta']['cpu_count']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def before_after_args(ap: argparse.ArgumentParser) -> None:
    """The options of a before/after run on the tiny model (this and `bench_async_step.py`)."""
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192, help="LM head rows of the tiny model")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of each side")
    ap.add_argument("--baseline", type=Path, help="another checkout to measure the same way")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/atom-bench-tiny-llama"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", default="", help="suffix of the output files")
    ap.add_argument("--side", type=Path, help=argparse.SUPPRESS)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["async", "sync"], choices=["async", "sync"])
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument(
        "--final-only", action="store_true", help="requests report their final output only"
    )
    before_after_args(ap)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.side is not None:
        run_side(args)
        return
    args.model_dir = save_tiny_llama(args.model_dir, args.vocab)
    sides = {"current": ROOT}
    if args.baseline is not None:
        sides = {"baseline": args.baseline.resolve(), **sides}
    runs: dict[str, list[list[dict]]] = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side, checkout in sides.items():
            runs[side].append(measure(checkout, args))
    results = {side: median_rows(r) for side, r in runs.items()}
    print_table(results)
    meta = {"machine": "CPU", "cpu_count": os.cpu_count(), "command": " ".join(sys.argv)}
    meta.update({k: getattr(args, k) for k in ("max_tokens", "prompt_tokens", "repeats")})
    result = {"meta": meta, "results": results, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"bench_host_step{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
