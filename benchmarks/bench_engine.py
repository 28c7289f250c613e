"""ATOM `LLM.generate` vs transformers batched `generate` on the same model and prompts.

N requests of mixed prompt and output lengths (greedy, eos ignored so both sides produce the
same tokens). transformers runs them as one left-padded batch, so every row decodes until the
longest request is done; ATOM batches continuously. Throughput counts the requested output
tokens only. Prints a table, writes benchmarks/results/bench_engine.json and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tqdm import tqdm

from atom.llm import LLM
from atom.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"
WORDS = (
    "the engine schedules requests in blocks while the model reads its cache and writes new "
    "tokens for every user who asks a question about history science music or code"
).split()


def make_workload(n: int, tokenizer, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 200))]
        prompts.append(tokenizer.encode(" ".join(words)))
        outputs.append(rng.randint(16, 128))
    return prompts, outputs


def run_atom(llm: LLM, prompts, outputs) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.output_token_ids) for o in outs] == outputs
    return elapsed


def run_transformers(model_dir: Path, prompts, outputs, device: str, dtype) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        with tqdm(total=1, desc="transformers batched generate") as bar:
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(outputs),
                do_sample=False,
                pad_token_id=0,
            )
            bar.update()
        if device == "cuda":
            torch.cuda.synchronize()
    return time.perf_counter() - start


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["transformers", "atom"]
    values = [result["transformers_tok_s"], result["atom_tok_s"]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(names, values, color=["#999999", "#2a7ab9"])
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"{result['model']} on {result['device']}, {result['num_requests']} mixed requests\n"
        f"atom / transformers = {result['ratio']:.2f}x"
    )
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dtype_name = "float32" if args.device == "cpu" else "bfloat16"
    llm = LLM(args.model, device=args.device, dtype=dtype_name, max_num_seqs=args.num_requests)
    engine = llm.engine
    prompts, outputs = make_workload(args.num_requests, llm.tokenizer, args.seed)
    atom_s = run_atom(llm, prompts, outputs)
    model_dir = Path(engine.config.model)
    del llm, engine
    hf_s = run_transformers(model_dir, prompts, outputs, args.device, getattr(torch, dtype_name))

    total = sum(outputs)
    result = {
        "model": model_dir.name if args.model else "SmolLM2-135M-Instruct",
        "device": args.device,
        "dtype": dtype_name,
        "num_requests": args.num_requests,
        "prompt_tokens": [len(p) for p in prompts],
        "output_tokens": outputs,
        "total_output_tokens": total,
        "torch_threads": torch.get_num_threads(),
        "atom_seconds": atom_s,
        "transformers_seconds": hf_s,
        "atom_tok_s": total / atom_s,
        "transformers_tok_s": total / hf_s,
        "ratio": hf_s / atom_s,
    }
    print(f"\n{'engine':<14}{'seconds':>10}{'out tok/s':>12}")
    print(f"{'transformers':<14}{hf_s:>10.2f}{result['transformers_tok_s']:>12.1f}")
    print(f"{'atom':<14}{atom_s:>10.2f}{result['atom_tok_s']:>12.1f}")
    print(
        f"ratio atom/transformers: {result['ratio']:.2f}x  ({total} output tokens, "
        f"prompts {min(result['prompt_tokens'])}-{max(result['prompt_tokens'])} tokens)"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_engine.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "bench_engine.png")
    print(f"wrote {RESULTS / 'bench_engine.json'} and {RESULTS / 'bench_engine.png'}")


if __name__ == "__main__":
    main()
