"""Does one request stall the others? ``/health`` latency while hostile structured-output requests
are in flight, against the same server idle, side by side in one run.

A real server (``python -m atom.cli serve``, embedded SmolLM2-135M-Instruct, CPU) is started
as users start it. Phases, each polling ``GET /health`` every 20 ms:

- ``idle``: nothing else runs.
- ``hostile``: at once, schemas whose preparation costs seconds (every value of an n-value enum
  checked against n patterns under ``not``; n = ``--sizes``, distinct, so none is cached; the
  largest overruns the 10 s budget here), a
  nested ``$schema`` whose pattern ``^(a+)+$|!$`` backtracks exponentially in Python's ``re`` on
  the forced ``--nested-length`` + 1 character answer, and a ``multipleOf: 0.01`` answer that float division rejects.
- ``repeat``: each hostile schema again (a cache lookup now, refusals included).

With ``--baseline DIR`` the same phases also run against the server of another checkout
(e.g. a ``git worktree`` of an older commit) started the same way, for a before/after.

Prints a table; writes benchmarks/results/bench_event_loop.json and .png.
    python benchmarks/bench_event_loop.py [--baseline /tmp/atom-old]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]
DIALECT = "https://json-schema.org/draft/2020-12/schema"
PROMPT = [{"role": "user", "content": "Reply in JSON."}]


def hostile_schema(n: int) -> dict:
    patterns = [{"pattern": f"^value[0-9]{{4}}$|z{i}"} for i in range(n)]
    values = [f"value{i:04d}" for i in range(n)]
    return {"type": "object", "properties": {"v": {"enum": values, "not": {"allOf": patterns}}}}


def nested_dialect(length: int) -> dict:
    """The answer is forced to ``length`` "a" then "!"; each extra "a" doubles the time Python's
    ``re`` takes on the first pattern."""
    pattern = {
        "$schema": DIALECT,
        "type": "string",
        "pattern": "^(a+)+$|!$",
        "allOf": [{"pattern": f"^a{{{length}}}!$"}],
    }
    return {
        "type": "object",
        "properties": {"s": pattern},
        "required": ["s"],
        "additionalProperties": False,
    }


PRICE = {
    "type": "object",
    "properties": {
        "price": {"type": "number", "multipleOf": 0.01, "minimum": 0.28, "maximum": 0.3}
    },
    "required": ["price"],
    "additionalProperties": False,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkout: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "atom.cli", "serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=checkout, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server of {checkout} did not start")


async def poll_health(http: httpx.AsyncClient, until: asyncio.Future | float) -> list[float]:
    """/health latencies (s), every 20 ms, until ``until`` is done (or a deadline passes)."""
    latencies = []
    while not (until.done() if isinstance(until, asyncio.Future) else time.monotonic() > until):
        start = time.monotonic()
        response = await http.get("/health")
        latencies.append(time.monotonic() - start)
        assert response.status_code == 200
        await asyncio.sleep(0.02)
    return latencies


async def ask(http: httpx.AsyncClient, model: str, schema: dict) -> dict:
    start = time.monotonic()
    body = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": 48,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
    }
    response = await http.post("/v1/chat/completions", json=body, timeout=600)
    return {"status": response.status_code, "seconds": time.monotonic() - start}


def summary(latencies: list[float]) -> dict:
    ms = sorted(1000 * x for x in latencies)
    return {
        "samples": len(ms),
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "max_ms": ms[-1],  # a blocked event loop answers one poll late: p99 alone hides it
    }


async def measure(base_url: str, sizes: list[int], nested_length: int) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        await ask(http, model, PRICE)  # warm: worker processes, grammar compiler
        idle = await poll_health(http, time.monotonic() + 5)
        hostile = [hostile_schema(n) for n in sizes]
        schemas = [*hostile, nested_dialect(nested_length), PRICE]
        requests = asyncio.ensure_future(asyncio.gather(*(ask(http, model, s) for s in schemas)))
        loaded = await poll_health(http, requests)
        answers = await requests
        repeats = [await ask(http, model, schema) for schema in hostile]
    names = [f"hostile_{n}" for n in sizes]
    return {
        "idle": summary(idle),
        "hostile": summary(loaded),
        "requests": dict(zip([*names, "nested_dialect", "multiple_of"], answers, strict=True)),
        "repeats": dict(zip(names, repeats, strict=True)),
    }


def run(checkout: Path, sizes: list[int], nested_length: int) -> dict:
    port = free_port()
    server = start_server(checkout, port)
    try:
        return asyncio.run(measure(f"http://127.0.0.1:{port}", sizes, nested_length))
    finally:
        server.terminate()
        server.wait(timeout=30)


def print_table(results: dict) -> None:
    print(f"{'server':<10} {'phase':<8} {'p50 ms':>8} {'p99 ms':>9} {'max ms':>9}")
    for name, r in results.items():
        for phase in ("idle", "hostile"):
            s = r[phase]
            print(
                f"{name:<10} {phase:<8} {s['p50_ms']:>8.1f} {s['p99_ms']:>9.1f} {s['max_ms']:>9.1f}"
            )
        for req, a in r["requests"].items():
            print(f"{name:<10} {req:<16} HTTP {a['status']} in {a['seconds']:.2f} s")
        for req, a in r["repeats"].items():
            print(f"{name:<10} {req + ' again':<16} HTTP {a['status']} in {a['seconds']:.2f} s")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels, p99, worst = [], [], []
    for name, r in results.items():
        for phase in ("idle", "hostile"):
            labels.append(f"{name}\n{phase}")
            p99.append(r[phase]["p99_ms"])
            worst.append(r[phase]["max_ms"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], p99, width=0.4, label="p99", color="#6a9")
    ax.bar([i + 0.2 for i in x], worst, width=0.4, label="max", color="#c64")
    ax.set_xticks(list(x), labels)
    ax.axhline(50, color="k", linestyle="--", linewidth=1, label="target 50 ms")
    ax.set_yscale("log")
    ax.set_ylabel("/health latency (ms, log)")
    ax.set_title("/health while hostile structured-output requests run (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[200, 199, 300], help="slow schemas (n) at once"
    )
    parser.add_argument("--nested-length", type=int, default=26, help="forced 'a' run length")
    parser.add_argument("--baseline", type=Path, help="another checkout to measure the same way")
    args = parser.parse_args()
    results = {"current": run(ROOT, args.sizes, args.nested_length)}
    if args.baseline is not None:
        results["baseline"] = run(args.baseline.resolve(), args.sizes, args.nested_length)
    print_table(results)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "bench_event_loop.json"
    meta = {
        "machine": "CPU",
        "cpu_count": os.cpu_count(),
        "sizes": args.sizes,
        "nested_length": args.nested_length,
    }
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
