"""Ranks and replicas side by side: the same greedy workload (a small random-weight Llama,
`SMALL_LLAMA`) on one in-process rank, on one rank
process (the transport alone), and on each `--layouts` entry (tensor-parallel ranks x
data-parallel replicas, torch.distributed over gloo on CPU). Every layout must produce exactly the
one in-process rank's tokens (checked); reports output tokens/s, ms per engine step and the
ratio to the in-process rank; writes benchmarks/results/bench_parallel.json and .png.

    python benchmarks/bench_parallel.py [--layouts 1x1 2x1 1x2 2x2] [--num-requests 16]

On this 2-core machine a layout with more ranks than cores measures contention as much as the
transport; the one-rank-process row isolates the transport (pickled token deltas over pipes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from bench_engine import make_random_llama_1b, make_workload

from atom.config import EngineConfig
from atom.llm import LLM
from atom.model_engine.multiproc_executor import MultiprocExecutor
from atom.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"
# A random-weight Llama small enough for CPU whose heads split over two ranks (SmolLM2-135M's 9
# do not), with the DeepSeek 129,280-token vocabulary (a vocabulary-parallel LM head that counts).
SMALL_LLAMA = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}  # fmt: skip


@dataclasses.dataclass
class Layout:
    name: str
    tensor_parallel_size: int
    data_parallel_size: int
    rank_processes: bool  # ranks in worker processes (always, beyond one rank)


def layouts(names: list[str]) -> list[Layout]:
    """The in-process reference, the one-rank-process transport row, then ``names`` (TPxDP)."""
    found = [Layout("in-process 1x1", 1, 1, False), Layout("rank process 1x1", 1, 1, True)]
    for name in names:
        tp, dp = (int(x) for x in name.split("x"))
        if (tp, dp) != (1, 1):
            found.append(Layout(f"{tp}x{dp}", tp, dp, True))
    return found


def make_llm(layout: Layout, config: EngineConfig) -> LLM:
    config = dataclasses.replace(
        config,
        tensor_parallel_size=layout.tensor_parallel_size,
        data_parallel_size=layout.data_parallel_size,
    )
    return LLM(config=config, executor_factory=MultiprocExecutor if layout.rank_processes else None)


def measure(llm: LLM, prompts, outputs) -> dict:
    """Seconds, engine steps and token ids of the workload (after a two-request warm-up)."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    steps = 0
    step = llm.engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    llm.engine.step = counted
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "steps": steps, "tokens": [o.output_token_ids for o in outs]}


def run(args: argparse.Namespace) -> dict:
    folder = make_random_llama_1b(args.model_dir, "cpu", **SMALL_LLAMA)
    config = EngineConfig(
        model=str(folder), device="cpu", dtype="float32", max_num_seqs=args.num_requests
    )
    rows, reference = [], None
    for layout in layouts(args.layouts):
        llm = make_llm(layout, config)
        if reference is None:
            prompts, outputs = make_workload(args.num_requests, llm.tokenizer, args.seed)
        result = measure(llm, prompts, outputs)
        llm.engine.shutdown()
        reference = reference or result
        total = sum(outputs)
        rows.append({
            "layout": layout.name,
            "tensor_parallel_size": layout.tensor_parallel_size,
            "data_parallel_size": layout.data_parallel_size,
            "seconds": result["seconds"],
            "steps": result["steps"],
            "ms_per_step": 1000 * result["seconds"] / result["steps"],
            "tok_s": total / result["seconds"],
            "vs_in_process": reference["seconds"] / result["seconds"],
            "same_tokens": result["tokens"] == reference["tokens"],
        })  # fmt: skip
        print(f"{layout.name:<18} {rows[-1]['tok_s']:8.1f} tok/s  {rows[-1]['ms_per_step']:7.2f} "
              f"ms/step  {rows[-1]['vs_in_process']:.2f}x  same={rows[-1]['same_tokens']}")  # fmt: skip
    return {
        "machine": "CPU",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model": f"random-weight Llama {SMALL_LLAMA}, vocabulary 129,280, float32",
        "num_requests": args.num_requests,
        "total_output_tokens": sum(outputs),
        "command": "benchmarks/bench_parallel.py " + " ".join(args.argv),
        "rows": rows,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["layout"] for r in rows], [r["tok_s"] for r in rows], color="#2a7ab9")
    for i, r in enumerate(rows):
        ax.text(i, r["tok_s"], f"{r['vs_in_process']:.2f}x", ha="center", va="bottom")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['num_requests']} greedy requests, CPU ({result['cpu_count']} cores), "
                 "TPxDP over gloo", fontsize=9)  # fmt: skip
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    import sys

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layouts", nargs="+", default=["2x1", "1x2", "2x2"])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/atom-random-llama-small-129k"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.argv = sys.argv[1:]
    result = run(args)
    assert all(r["same_tokens"] for r in result["rows"]), "a layout's tokens differ"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_parallel.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "bench_parallel.png")
    print(f"wrote {args.out / 'bench_parallel.json'} and .png")


if __name__ == "__main__":
    main()
