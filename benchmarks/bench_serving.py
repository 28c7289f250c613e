"""Online serving benchmark: `atom serve` under streamed Chat Completions load, measured from
the client side the way one measures a vLLM deployment (`vllm bench serve`).

The script starts `atom serve` itself (127.0.0.1, a free port, waits for /health), sends a
warm-up request per schema and one plain one, then runs one *cell* per (request rate,
constrained share) with the official `openai` AsyncOpenAI client (stream=True,
stream_options.include_usage), and stops the server.

Load (fixed by `--seed`; every cell gets the same lengths, so cells ask for the same work):
- prompts of `--prompt-words` random words (uniform in MIN..MAX); the words are drawn anew per
  cell, so no cell is served from another cell's prefix cache;
- plain requests: `ignore_eos` and max_tokens uniform in `--output-tokens` MIN..MAX, so each
  produces exactly that many tokens;
- constrained requests (`response_format` json_schema, one of three small bounded schemas; the
  server refuses `ignore_eos` with a format): the grammar ends the answer, capped by
  `--json-max-tokens`. Constrained requests are the first round(share * n) of one seeded
  permutation, so those of share 0.5 are also constrained at share 1;
- arrivals: Poisson at each `--request-rates` value (exponential gaps, the same for every
  share at one rate), or all at once for `inf` (saturation).

Metrics per cell (client clock, time.monotonic, common to the client processes):
- request throughput = completed requests / cell duration (first send to last stream end);
  output throughput = completion tokens (server usage) / cell duration;
- TTFT: send to first chunk with text; TPOT per request: (end of stream - TTFT) / (tokens - 1);
  ITL: gaps between successive chunks with text (a chunk may carry several tokens, as in vLLM);
  E2E latency: send to end of stream; p50 and p99 over requests (ITL: over gaps);
- errors: HTTP errors, error events in the stream, streams ending without usage;
- constrained answers: json.loads and jsonschema (draft 2020-12) on the streamed text: valid,
  invalid, or capped (finish_reason "length": the cap cut the JSON);
- client CPU share: the busiest client process's CPU time / cell duration; near 100% the
  client, not the server, limits the cell and its latencies include the client's own parsing
  time: raise `--client-procs` (the requests are dealt round-robin to that many processes,
  each with its own event loop and client, all on the same arrival schedule).

Writes `{--out}/bench_serving_{device}[_quick][_{tag}].json` (cells, the exact command line,
server command, git commit, machine) and `.png`; prints a table.
    python benchmarks/bench_serving.py --quick                          # smoke run
    python benchmarks/bench_serving.py --num-requests 40 --request-rates 1 inf
    python benchmarks/bench_serving.py --random-llama-1b --device cuda --client-procs 4 \
        [--server-arg=--enforce-eager --tag eager]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import platform
import queue
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the server inherits it: local models only

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parent.parent
WORDS = (
    "the engine schedules requests in blocks while the model reads its cache and writes new "
    "tokens for every user who asks a question about history science music or code"
).split()
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "hobbies": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "maxItems": 3,
            },
        },
        "required": ["name", "age", "hobbies"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 24},
            "price_cents": {"type": "integer", "minimum": 0, "maximum": 100000},
            "in_stock": {"type": "boolean"},
        },
        "required": ["title", "price_cents", "in_stock"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 16},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "attendees": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 999},
                "maxItems": 4,
            },
        },
        "required": ["city", "year", "attendees"],
        "additionalProperties": False,
    },
}


@dataclass(frozen=True)
class Planned:
    """One request of a cell, fixed before the cell starts."""

    arrival_s: float  # offset from the cell's start
    prompt: str
    max_tokens: int
    schema: str | None  # a SCHEMAS key; None: plain request with ignore_eos


@dataclass
class Outcome:
    """What the client saw of one request."""

    schema: str | None
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""


# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------
def rate_json(rate: float) -> float | str:
    """A request rate as JSON can hold it: `inf` (saturation) becomes the string "inf"."""
    return "inf" if math.isinf(rate) else rate


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """Poisson arrivals (exponential gaps, first at 0) at `rate` per second; `inf`: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def json_hint(schema: str) -> str:
    """The instruction a constrained prompt ends with, naming the schema's keys (a real client
    tells the model what it wants; the grammar alone would also do)."""
    keys = ", ".join(SCHEMAS[schema]["properties"])
    return f"\nReply with only a JSON object describing a {schema}, with keys {keys}."


def plan_cell(args: argparse.Namespace, rate: float, share: float, cell: int) -> list[Planned]:
    """The requests of one cell. Lengths, schemas and which requests are constrained come from
    `--seed` alone (same work in every cell); arrivals from the seed and rate; words per cell."""
    shape = random.Random(f"shape-{args.seed}")
    words = random.Random(f"words-{args.seed}-{cell}")
    n = args.num_requests
    draws = [
        (
            shape.randint(*args.prompt_words),
            shape.randint(*args.output_tokens),
            shape.choice(sorted(SCHEMAS)),
        )
        for _ in range(n)
    ]
    order = list(range(n))
    shape.shuffle(order)
    constrained = set(order[: round(share * n)])
    arrivals = arrival_times(n, rate, random.Random(f"arrivals-{args.seed}-{rate}"))
    plan = []
    for i, (n_words, n_out, schema) in enumerate(draws):
        prompt = " ".join(words.choice(WORDS) for _ in range(n_words))
        if i in constrained:
            plan.append(
                Planned(arrivals[i], prompt + json_hint(schema), args.json_max_tokens, schema)
            )
        else:
            plan.append(Planned(arrivals[i], prompt, n_out, None))
    return plan


# ---------------------------------------------------------------------------------------------
# client
# ---------------------------------------------------------------------------------------------
def request_kwargs(req: Planned, model: str, temperature: float) -> dict[str, Any]:
    """Chat Completions arguments: streamed with usage; a schema or `ignore_eos`."""
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": req.prompt}],
        "max_tokens": req.max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.schema is None:
        kwargs["extra_body"] = {"ignore_eos": True}
    else:
        kwargs["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": req.schema, "schema": SCHEMAS[req.schema], "strict": True},
        }
    return kwargs


async def send(client: Any, req: Planned, model: str, temperature: float) -> Outcome:
    """One streamed request, timed on the client clock."""
    import openai

    out = Outcome(schema=req.schema)
    parts: list[str] = []
    start = last = time.monotonic()
    try:
        stream = await client.chat.completions.create(**request_kwargs(req, model, temperature))
        async for chunk in stream:
            now = time.monotonic()
            if chunk.usage is not None:
                out.prompt_tokens = chunk.usage.prompt_tokens
                out.output_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                out.finish_reason = choice.finish_reason or out.finish_reason
                text = (choice.delta.content or "") + (
                    getattr(choice.delta, "reasoning_content", None) or ""
                )
                if not text:
                    continue
                if out.ttft_s is None:
                    out.ttft_s = now - start
                else:
                    out.gaps_s.append(now - last)
                last = now
                parts.append(choice.delta.content or "")
        out.latency_s = time.monotonic() - start
    except openai.APIError as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
        return out
    if out.finish_reason is None or out.output_tokens == 0:
        out.error = "stream ended without a finish reason or usage"
    out.text = "".join(parts)
    return out


def make_client(base_url: str, timeout_s: float) -> Any:
    """AsyncOpenAI without retries: a retry would hide an error and skew latency."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=timeout_s)


_TICKS: Any = None  # in a client process: the queue its finished requests are counted on


def client_init(ticks: Any) -> None:
    """Client process start: keeps the progress queue and imports the SDK before any cell."""
    global _TICKS
    _TICKS = ticks
    import openai  # noqa: F401


def client_ready() -> None:
    """A no-op task: once one has run per process, every client process is up."""


async def send_part(
    base_url: str, model: str, plan: list[Planned], start_at: float, args: argparse.Namespace
) -> tuple[list[Outcome], float]:
    """Sends each planned request at `start_at` + its arrival offset; returns the outcomes
    and the time the last stream ended."""
    client = make_client(base_url, args.request_timeout)

    async def launch(req: Planned) -> Outcome:
        await asyncio.sleep(max(0.0, start_at + req.arrival_s - time.monotonic()))
        out = await send(client, req, model, args.temperature)
        _TICKS.put(1)
        return out

    outcomes = await asyncio.gather(*(launch(r) for r in plan))
    end = time.monotonic()
    await client.close()
    return list(outcomes), end


def client_part(
    base_url: str, model: str, plan: list[Planned], start_at: float, args: argparse.Namespace
) -> tuple[list[Outcome], float, float]:
    """One client process's share of a cell, on its own event loop: parsing the SDK's stream
    costs ~0.1 ms of CPU per chunk, so one process alone would cap a fast server. Returns
    outcomes, end time and the CPU seconds this process spent."""
    cpu = time.process_time()
    outcomes, end = asyncio.run(send_part(base_url, model, plan, start_at, args))
    return outcomes, end, time.process_time() - cpu


def run_cell(
    pool: Any,
    ticks: Any,
    bar: Any,
    plan: list[Planned],
    target: tuple[str, str],
    args: argparse.Namespace,
) -> tuple[list[Outcome], float, float]:
    """Deals the plan round-robin to the client processes, which all start one second from now
    (time to set up); returns outcomes, duration (start to last stream end) and the busiest
    client process's CPU share of that duration."""
    k = args.client_procs
    start_at = time.monotonic() + 1.0
    futures = [pool.submit(client_part, *target, plan[i::k], start_at, args) for i in range(k)]
    for _ in plan:
        while True:
            with contextlib.suppress(queue.Empty):
                ticks.get(timeout=1.0)
                break
            failed = [f.exception() for f in futures if f.done() and f.exception()]
            if failed:
                raise failed[0]
        bar.update()
    parts = [f.result() for f in futures]
    duration = max(end for _, end, _ in parts) - start_at
    outcomes = [o for outs, _, _ in parts for o in outs]
    return outcomes, duration, max(cpu for _, _, cpu in parts) / duration


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------
def spread_ms(values: list[float]) -> dict[str, float | int | None]:
    """Mean, p50, p90, p99 in ms (numpy's linear percentiles, as vLLM reports them)."""
    import numpy as np

    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "n": len(values),
        "mean": float(ms.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
    }


def json_verdict(out: Outcome, validators: dict[str, Any]) -> str:
    """valid | invalid | capped (the cap cut the JSON) | error (no answer)."""
    if out.error is not None:
        return "error"
    if out.finish_reason == "length":
        return "capped"
    try:
        value = json.loads(out.text)
    except json.JSONDecodeError:
        return "invalid"
    return "valid" if validators[out.schema].is_valid(value) else "invalid"


def summarize(outs: list[Outcome], duration: float, validators: dict[str, Any]) -> dict:
    """One cell's metrics from its outcomes."""
    ok = [o for o in outs if o.error is None]
    timed = [o for o in ok if o.ttft_s is not None and o.latency_s is not None]
    tpot = [(o.latency_s - o.ttft_s) / (o.output_tokens - 1) for o in timed if o.output_tokens > 1]
    tokens = sum(o.output_tokens for o in ok)
    verdicts = Counter(json_verdict(o, validators) for o in outs if o.schema is not None)
    return {
        "requests": len(outs),
        "constrained": sum(o.schema is not None for o in outs),
        "completed": len(ok),
        "errors": len(outs) - len(ok),
        "error_examples": sorted({o.error for o in outs if o.error})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": tokens / duration,
        "output_tokens_total": tokens,
        "output_tokens_mean": tokens / len(ok) if ok else None,
        "prompt_tokens_mean": sum(o.prompt_tokens for o in ok) / len(ok) if ok else None,
        "mean_in_flight": sum(o.latency_s for o in timed) / duration,
        "ttft_ms": spread_ms([o.ttft_s for o in timed]),
        "tpot_ms": spread_ms(tpot),
        "itl_ms": spread_ms([g for o in ok for g in o.gaps_s]),
        "e2e_ms": spread_ms([o.latency_s for o in timed]),
        "json": {k: verdicts.get(k, 0) for k in ("valid", "invalid", "capped", "error")},
        "json_examples": [o.text for o in ok if o.schema is not None][:2],
    }


# ---------------------------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    """A port nobody listens on now, so parallel runs (and other servers) never collide."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_llama_dir(args: argparse.Namespace) -> str:
    """Builds (or reuses) bench_engine's random-weight Llama-3.2-1B-shaped model folder."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engine import make_random_llama_1b

    print(f"random Llama-3.2-1B-shaped model in {args.model_dir}", flush=True)
    return str(make_random_llama_1b(Path(args.model_dir), args.device))


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    """`atom serve` with the benchmark's model and device, then `--server-arg`s (later flags
    win in argparse, so they can override what is set here)."""
    cmd = [sys.executable, "-m", "atom.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--device", args.device, "--log-level", "warning"]
    if args.random_llama_1b:
        cmd += ["--model", random_llama_dir(args), "--dtype", "bfloat16"]
    elif args.model:
        cmd += ["--model", args.model]
    return cmd + args.server_arg


def wait_healthy(proc: subprocess.Popen, base_url: str, log: Path, timeout_s: float) -> None:
    """Polls /health until it answers; fails with the log's tail if the server exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise SystemExit(f"atom serve exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    raise SystemExit(f"atom serve did not answer /health within {timeout_s:.0f} s (log: {log})")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (uvicorn's graceful stop), then SIGKILL to the server's own process group
    (it was started in a new session, so its schema workers go too)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def serving(args: argparse.Namespace) -> Iterator[tuple[str, str, list[str]]]:
    """Runs `atom serve`; yields (base URL, served model id, server command)."""
    port = free_port()
    cmd = server_command(args, port)
    base_url = f"http://127.0.0.1:{port}"
    fd, name = tempfile.mkstemp(prefix="bench_serving_", suffix=".log")
    os.close(fd)
    log = Path(name)
    print(f"starting: {shlex.join(cmd)}\n  server log: {log}", flush=True)
    t0 = time.monotonic()
    with log.open("w") as f:
        # cwd=REPO: `python -m` serves the atom package of this checkout, next to the script.
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_healthy(proc, base_url, log, args.server_timeout)
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        print(f"server ready in {time.monotonic() - t0:.0f} s, model {model}", flush=True)
        yield base_url, model, cmd
    finally:
        stop_server(proc)


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------
async def warm_up(base_url: str, model: str, args: argparse.Namespace) -> None:
    """One plain request and one per schema, at once: schemas get prepared and cached and the
    first-call paths run, so cells measure a deployment already serving these schemas."""
    client = make_client(base_url, args.request_timeout)
    plan = [Planned(0.0, "warm up " * 8, 8, None)]
    plan += [Planned(0.0, "warm up" + json_hint(s), args.json_max_tokens, s) for s in SCHEMAS]
    outs = await asyncio.gather(*(send(client, r, model, args.temperature) for r in plan))
    await client.close()
    failed = [o.error for o in outs if o.error]
    if failed:
        raise SystemExit(f"warm-up failed: {failed[0]}")


def run_all(args: argparse.Namespace, base_url: str, model: str) -> list[dict]:
    """Every (rate, share) cell in turn, each starting on an idle server. Client processes are
    spawned (not forked: this process may hold a CUDA context) once, before the first cell."""
    from jsonschema import Draft202012Validator
    from tqdm import tqdm

    validators = {name: Draft202012Validator(s) for name, s in SCHEMAS.items()}
    asyncio.run(warm_up(base_url, model, args))
    grid = [(r, s) for r in args.request_rates for s in args.constrained_shares]
    ctx = multiprocessing.get_context("spawn")
    ticks = ctx.Queue()
    pool = ProcessPoolExecutor(
        args.client_procs, mp_context=ctx, initializer=client_init, initargs=(ticks,)
    )
    cells = []
    with (
        pool,
        tqdm(
            total=len(grid) * args.num_requests, desc="requests", unit="req", mininterval=1
        ) as bar,
    ):
        for f in [pool.submit(client_ready) for _ in range(args.client_procs)]:
            f.result()
        for i, (rate, share) in enumerate(grid):
            bar.set_postfix_str(f"rate {rate:g}/s, constrained {share:.0%}")
            plan = plan_cell(args, rate, share, i)
            outs, duration, cpu = run_cell(pool, ticks, bar, plan, (base_url, model), args)
            cell = {"request_rate": rate_json(rate), "constrained_share": share}
            cell["client_cpu_share"] = cpu  # near 1: the client, not the server, set the pace
            cells.append(cell | summarize(outs, duration, validators))
    return cells


def git_state() -> dict[str, Any]:
    """The commit and whether tracked files differ from it (read-only git; no index refresh)."""
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")

    def git(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, env=env)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return {"commit": None}
    return {"commit": head.stdout.strip(), "dirty": git("diff", "--quiet", "HEAD").returncode != 0}


def machine(device: str) -> dict[str, Any]:
    """Host, CPU, accelerator and load: what the figures depend on besides the code."""
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
    }
    if device == "cuda":
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"]
        with contextlib.suppress(OSError):
            info["gpus"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    return info


def cell_row(c: dict) -> str:
    """One table line."""

    def pair(key: str) -> str:
        s = c[key]
        return "-" if s["p50"] is None else f"{s['p50']:.0f}/{s['p99']:.0f}"

    j = c["json"]
    checked = f"{j['valid']}/{c['constrained']}" + (f" c{j['capped']}" if j["capped"] else "")
    return (
        f"{c['request_rate']:>6} {c['constrained_share']:>6.0%} "
        f"{c['completed']:>4}/{c['requests']:<4} {c['errors']:>4} {checked:>10} "
        f"{c['request_throughput']:>7.2f} {c['output_throughput']:>8.1f} "
        f"{pair('ttft_ms'):>13} {pair('tpot_ms'):>11} {pair('itl_ms'):>11} {pair('e2e_ms'):>13} "
        f"{c['client_cpu_share']:>7.0%}"
    )


def print_table(cells: list[dict]) -> None:
    """The cells as `vllm bench serve` users read them: throughput, then latency spreads."""
    print(
        f"\n{'rate/s':>6} {'constr':>6} {'done':>9} {'err':>4} {'json ok':>10} "
        f"{'req/s':>7} {'out tok/s':>8} {'TTFT p50/p99':>13} {'TPOT p50/99':>11} "
        f"{'ITL p50/99':>11} {'E2E p50/p99':>13} {'client':>7}   (times in ms)"
    )
    for c in cells:
        print(cell_row(c))


def plot(result: dict, path: Path) -> None:
    """Four panels against the constrained share, one line per request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [
        ("output_throughput", "output tokens / s"),
        ("ttft_ms", "TTFT (ms)"),
        ("tpot_ms", "TPOT (ms)"),
        ("itl_ms", "inter-token latency (ms)"),
    ]
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        for i, rate in enumerate(result["request_rates"]):
            cells = [c for c in result["cells"] if c["request_rate"] == rate]
            xs = [100 * c["constrained_share"] for c in cells]
            color = f"C{i}"
            name = "saturation" if rate == "inf" else f"{rate:g} req/s"
            if key == "output_throughput":
                ax.plot(xs, [c[key] for c in cells], "o-", color=color, label=name)
                continue
            ax.plot(xs, [c[key]["p50"] for c in cells], "o-", color=color, label=f"{name} p50")
            ax.plot(xs, [c[key]["p99"] for c in cells], "s--", color=color, label=f"{name} p99")
        ax.set(xlabel="constrained requests (%)", ylabel=label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"atom serve, {result['model']}, {result['device']}: {result['num_requests']} streamed "
        f"chat requests per point",
        fontsize=10,
    )
    totals = {k: sum(c["json"][k] for c in result["cells"]) for k in ("valid", "invalid", "capped")}
    errors = sum(c["errors"] for c in result["cells"])
    fig.text(
        0.01,
        0.005,
        f"all cells: {errors} errors; constrained answers {totals['valid']} valid, "
        f"{totals['invalid']} invalid, {totals['capped']} capped",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    """Defaults fit a GPU run (200 requests per cell); `--quick` shrinks everything."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument(
        "--random-llama-1b",
        action="store_true",
        help="serve bench_engine's random-weight Llama-3.2-1B-shaped model (129,280-token "
        "DeepSeek tokenizer, bf16), built into --model-dir if missing",
    )
    ap.add_argument("--model-dir", default="/tmp/atom-random-llama-1b-129k")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `atom serve` argument, repeatable; write --server-arg=--enforce-eager",
    )
    ap.add_argument("--num-requests", type=int, default=200, help="requests per cell")
    ap.add_argument("--request-rates", type=float, nargs="+", default=[8.0, 32.0, math.inf])
    ap.add_argument("--constrained-shares", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--prompt-words", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    ap.add_argument("--output-tokens", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--json-max-tokens", type=int, default=256, help="cap of constrained requests")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--server-timeout", type=float, default=1800, help="seconds to wait for /health"
    )
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=600,
        help="seconds one request may take before it counts as an error",
    )
    ap.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes sharing each cell's requests (use several for a fast server: "
        "one parses ~10k chunks/s at most)",
    )
    ap.add_argument("--tag", default="", help="suffix of the output file stem")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (overrides the load flags): 8 requests per cell, saturation, constrained "
        "shares 0 and 1, 8-16 output tokens",
    )
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.request_rates, args.constrained_shares = 8, [math.inf], [0.0, 1.0]
        args.prompt_words, args.output_tokens, args.json_max_tokens = [8, 32], [8, 16], 96
    if not all(0.0 <= s <= 1.0 for s in args.constrained_shares):
        ap.error("--constrained-shares must lie in [0, 1]")
    if args.client_procs < 1:
        ap.error("--client-procs must be at least 1")
    if not all(r > 0 for r in args.request_rates):
        ap.error("--request-rates must be above 0 (inf: all at once)")
    return args


def main() -> None:
    """Serve, run the grid, then write what is needed to reproduce and compare the figures."""
    args = parse_args()
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        print(f"warning: 1-minute load average {load_start:.1f}: the machine is busy", flush=True)
    t0 = time.monotonic()
    with serving(args) as (base_url, model, server_cmd):
        cells = run_all(args, base_url, model)
    stem = f"bench_serving_{args.device}" + ("_quick" if args.quick else "")
    stem += f"_{args.tag}" if args.tag else ""
    result = {
        "command": shlex.join(["python", *sys.argv]),
        "server_command": shlex.join(server_cmd),
        "served_tree": str(REPO),  # the server's working directory: its atom package
        "git": git_state(),
        "machine": machine(args.device)
        | {"loadavg_1m_start_end": [load_start, os.getloadavg()[0]]},
        "model": model,
        "device": args.device,
        "num_requests": args.num_requests,
        "client_procs": args.client_procs,
        "request_rates": [rate_json(r) for r in args.request_rates],
        "constrained_shares": args.constrained_shares,
        "prompt_words": args.prompt_words,
        "output_tokens": args.output_tokens,
        "json_max_tokens": args.json_max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "schemas": SCHEMAS,
        "wall_s": time.monotonic() - t0,
        "cells": cells,
    }
    print_table(cells)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{stem}.png")
    print(f"wall {result['wall_s']:.0f} s; wrote {args.out / stem}.json and .png")


if __name__ == "__main__":
    main()
