"""A short engine run for NVIDIA's compute-sanitizer: the asynchronous path with CUDA graphs,
paged attention, deferred output, structured output and preemption, on a tiny random-weight
Llama (the tests' checkpoint) so that the checked run stays short.

    compute-sanitizer --tool memcheck python benchmarks/sanitize_engine.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize_engine.py
    python benchmarks/sanitize_engine.py cpu      # the same run on CPU (no sanitizer)
    python benchmarks/sanitize_engine.py cuda graphs-sync   # one variant alone, no comparison
    python benchmarks/sanitize_engine.py cuda graphs-sync float32   # ... in float32

A variant alone (eager-sync, eager-async, graphs-sync, graphs-async, graphs-async-ngram) tells
which part of the engine a sanitizer's failure belongs to.

Needs the SmolLM2 tokenizer: the embedded model, or ATOM_TEST_TOKENIZER_DIR (a saved copy).
Exits non-zero when an output differs from the synchronous eager run or an answer is invalid.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import _save_tiny_llama  # noqa: E402

from atom.config import EngineConfig  # noqa: E402
from atom.entrypoints.openai.protocol import parse_chat_response_format  # noqa: E402
from atom.llm import LLM  # noqa: E402
from atom.sampling_params import SamplingParams  # noqa: E402
from atom.structured_output.spec import StructuredOutputSpec  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}


def tiny_model(folder: Path) -> Path:
    from transformers import AutoTokenizer

    _save_tiny_llama(folder, vocab_size=49152, max_positions=2048, bos=1, eos=2)
    source = os.environ.get("ATOM_TEST_TOKENIZER_DIR")
    if source is None:
        from atom.model_loader import resolve_model

        source = resolve_model(EngineConfig())
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def run(model: Path, device: str, dtype: torch.dtype | None = None, **variant) -> list:
    # A cache of 14 blocks of 16 tokens for 6 requests of 5-6 blocks each: preemption.
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    block_bytes = 2 * 2 * 16 * 2 * 16 * dtype.itemsize
    llm = LLM(str(model), device=device, dtype=str(dtype).removeprefix("torch."),
              kv_cache_bytes=14 * block_bytes, max_num_seqs=8, **variant)  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    spec = StructuredOutputSpec.of(parse_chat_response_format(fmt), None)
    prompts = [[100 + 7 * i + j for j in range(20 + 5 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * 6
    params[1] = params[4] = SamplingParams(temperature=0.0, max_tokens=24, structured_output=spec)
    outs = llm.generate(prompts, params, use_tqdm=False)
    preemptions = llm.engine.cores[0].scheduler.num_preemptions
    print(variant, "preemptions:", preemptions, flush=True)
    assert preemptions > 0
    return outs


VARIANTS = {
    f"{graphs}-{mode}": {"enforce_eager": graphs == "eager", "async_scheduling": mode == "async"}
    for graphs in ("eager", "graphs")
    for mode in ("sync", "async")
}
# Asynchronous speculative decoding: n-gram drafts verified in CUDA graphs, the next step's
# positions moved on the device by the drafts the step in flight accepts.
VARIANTS["graphs-async-ngram"] = VARIANTS["graphs-async"] | {
    "speculative_method": "ngram",
    "num_speculative_tokens": 3,
}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
        if len(sys.argv) > 2:
            dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else None
            run(model, device, dtype, **VARIANTS[sys.argv[2]])
            return
        checked = run(model, device, enforce_eager=False, async_scheduling=True)
        reference = run(model, device, enforce_eager=True, async_scheduling=False)
    same = [
        a.output_token_ids == b.output_token_ids for a, b in zip(checked, reference, strict=True)
    ]
    for i in (1, 4):
        assert checked[i].error is None and json.loads(checked[i].text)["a"] in range(10)
    print("outputs equal to the synchronous eager run:", same, flush=True)
    sys.exit(0 if all(same) else 1)


if __name__ == "__main__":
    main()
