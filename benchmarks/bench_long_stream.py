"""Host time per token of one long streamed answer, on CPU: does it stay flat as the text grows?

What a server stream does with each token of a request without stop strings (a lazy
detokenizer): the engine thread keeps the token and reports an output, and the stream's reader
decodes its `delta_text`. `--tokens` random ordinary SmolLM2 token ids (fixed seed); prints the
microseconds per token over each interval (a cost that grows with the text shows as a rising
column). Run it against another checkout with `PYTHONPATH=DIR python benchmarks/...`: the
script imports whichever `atom` comes first. Writes benchmarks/results/bench_long_stream{_TAG}.json.
    python benchmarks/bench_long_stream.py [--tokens 32000] [--tag after]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32000)
    ap.add_argument("--marks", type=int, nargs="+", default=[2000, 8000, 16000, 32000])
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    import atom
    from atom.config import EngineConfig
    from atom.model_engine.detokenizer import IncrementalDetokenizer
    from atom.model_engine.output import RequestOutput
    from atom.model_loader import resolve_model
    from atom.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(EngineConfig()))
    rng = random.Random(0)
    ids = [rng.randrange(200, 40000) for _ in range(args.tokens)]
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams())
    rows, start, last, previous = [], time.perf_counter(), 0, time.perf_counter()
    for i, token in enumerate(ids, start=1):
        detokenizer.push(token)
        text, delta = detokenizer.report(False)
        out = RequestOutput("r", [], [], [token], text, delta, False, None, None, None)
        _ = out.delta_text
        if i in args.marks or i == len(ids):
            now = time.perf_counter()
            rows.append({"tokens": i, "us_per_token": 1e6 * (now - previous) / (i - last)})
            previous, last = now, i
    total = time.perf_counter() - start
    print(f"atom from {Path(atom.__file__).parent}")
    print(f"{'tokens up to':>13} {'us/token':>9}")
    for row in rows:
        print(f"{row['tokens']:>13} {row['us_per_token']:>9.2f}")
    print(f"whole stream: {total:.3f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_long_stream" + (f"_{args.tag}" if args.tag else "")
    (args.out / f"{stem}.json").write_text(
        json.dumps({"atom": str(Path(atom.__file__).parent), "rows": rows, "total_s": total})
    )


if __name__ == "__main__":
    main()
