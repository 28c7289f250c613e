"""Where the host's time goes in a speculative decode step, beside a plain one: cProfile over
full-batch decode steps of the real engine, per setting, with the step time measured without the
profiler first.

Settings as in `bench_spec_decode.py`: `plain-async`, `ngram-async`, `ngram` (synchronous).
Greedy, `--batch` requests of repeated token prompts (n-gram lookup finds drafts in them), every
request decoding when the measured steps start. On CUDA the target is bench_engine's random 1B
model; on CPU the tests' tiny random Llama shape is not at hand, so the embedded SmolLM2.

Prints, per setting, ms per step and the functions of `atom` with the most cumulative time per
step; writes benchmarks/results/profile_spec_host{tag}.json.
    python benchmarks/profile_spec_host.py --device cuda --model /tmp/atom-random-llama-1b-129k
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

RESULTS = Path(__file__).parent / "results"
SETTINGS = ("plain-async", "ngram-async", "ngram")


def make_engine(args: argparse.Namespace, setting: str):
    from atom.config import EngineConfig
    from atom.model_engine.llm_engine import LLMEngine

    method, _, scheduling = setting.partition("-")
    spec = {} if method == "plain" else {"speculative_method": method}
    if spec:
        spec["num_speculative_tokens"] = args.k
    kw = dict(model=args.model, device=args.device, max_model_len=1024, kv_cache_bytes=2 << 30)
    return LLMEngine(EngineConfig(**kw, **spec, async_scheduling=scheduling == "async"))


def decode_steps(engine, args: argparse.Namespace, profile: cProfile.Profile | None) -> float:
    """Submit the batch, step until every request decodes, then time `args.steps` steps (under
    `profile` when given); returns ms per step. The batch is then run to its end."""
    from atom.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 6 + 32, ignore_eos=True)
    for i in range(args.batch):
        prompt = [(1000 + 17 * i + j % 7) for j in range(64)]
        engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, params)
    scheduler = engine.cores[0].scheduler
    for _ in range(8):  # prefill, and the first decode steps
        engine.step()
    assert scheduler.num_running == args.batch and not scheduler.num_waiting
    if profile is not None:
        profile.enable()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    elapsed = time.perf_counter() - start
    if profile is not None:
        profile.disable()
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * elapsed / args.steps


def top_functions(profile: cProfile.Profile, steps: int, count: int) -> list[dict]:
    """The `atom` functions (and torch/numpy calls made from them) with the most cumulative time,
    in ms per step."""
    stats = pstats.Stats(profile)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        if "/atom/" not in path:
            continue
        where = path.split("/atom/", 1)[1]
        rows.append(
            {
                "function": f"{where}:{line}({name})",
                "calls_per_step": calls / steps,
                "own_ms": 1000 * own / steps,
                "cumulative_ms": 1000 * cumulative / steps,
            }
        )
    rows.sort(key=lambda r: -r["cumulative_ms"])
    return rows[:count]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.model is None:
        from atom.config import EngineConfig
        from atom.model_loader import resolve_model

        args.model = str(resolve_model(EngineConfig()))
    if args.model.endswith("atom-random-llama-1b-129k"):
        from bench_engine import make_random_llama_1b

        make_random_llama_1b(Path(args.model), args.device)
    results = {}
    for setting in SETTINGS:
        engine = make_engine(args, setting)
        decode_steps(engine, args, None)  # warm-up: kernels, graphs, allocator
        step_ms = decode_steps(engine, args, None)
        profile = cProfile.Profile()
        profiled_ms = decode_steps(engine, args, profile)
        core = engine.cores[0]
        results[setting] = {
            "step_ms": step_ms,
            "profiled_step_ms": profiled_ms,
            "proposed": core.num_proposed_drafts,
            "accepted": core.num_accepted_drafts,
            "top": top_functions(profile, args.steps, args.top),
        }
        engine.shutdown()
        print(f"== {setting}: {step_ms:.2f} ms/step ({profiled_ms:.2f} profiled), drafts "
              f"{core.num_accepted_drafts}/{core.num_proposed_drafts} accepted")  # fmt: skip
        for row in results[setting]["top"]:
            print(f"  {row['cumulative_ms']:7.3f} {row['own_ms']:7.3f} "
                  f"{row['calls_per_step']:6.1f}  {row['function']}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile_spec_host{args.tag}.json"
    meta = {"command": " ".join(sys.argv), "batch": args.batch, "k": args.k}
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
