"""Structured output in the serving engine: enabled-request overhead, disabled-request
regression and the neighbour effect, on the same prompts, with matching outputs checked.

Real engine (`LLMEngine`, with its defaults: CUDA graphs on CUDA, asynchronous scheduling),
greedy. Two models:

- default (CPU): the embedded SmolLM2-135M-Instruct (unless --model). For each batch size n, n
  distinct chat prompts ask for one JSON object {"name": str, "age": int}; the constraint is
  that object's JSON schema ("person": name 1..24 chars, age 0..120, no other keys).
- `--random-llama-1b` (meant for `--device cuda`): bench_engine's random-weight
  Llama-3.2-1B-shaped model with DeepSeek's 129,280-token tokenizer, bf16; prompts are random
  ordinary token ids (fixed seed). A random model writes no sensible JSON, so two schemas span
  the mask density instead, each its own row: "mostly-allowed" (one string property of at least
  8192 characters: inside the string ~92% of the vocabulary is allowed) and "mostly-forbidden"
  (an array of at least 256 integers in 0..999: ~0.3% allowed). Neither answer can end within
  the 256-token cap of this mode, so constrained requests run to their max tokens, as long as
  the unconstrained ones (same cap by default): the batch stays full to the end.

Settings (same prompts, same batch size; all n requests are submitted at once):

- `never`: a child process in which `atom.structured_output` (and llguidance) is never imported
  runs the n prompts unconstrained; it asserts this through `sys.modules` before and after.
- `plain`: this process, after structured output was initialized on the worker (admission RPC,
  grammar compiled) and used by warm-up constrained requests, runs the same prompts
  unconstrained.
- `constrained`: the same prompts, every request carrying the schema.
- `mixed`: the same prompts, odd-indexed requests constrained, even-indexed unconstrained (at
  batch 1 that is none: `mixed` is then a second A/A control).
- `plain2`: `plain` again, an A/A control: plain2 / plain shows what "no difference" looks like
  on this machine (the noise floor of the ratios below).

Unconstrained requests run with `ignore_eos` and a fixed `--plain-max-tokens`, so they stay in
the batch; constrained requests stop at the end of their JSON object (EOS forced by the grammar)
or at `--max-tokens`.

What is measured (TPOT): the wall time of `LLMEngine.step()` for *full-batch decode steps*. With
asynchronous scheduling a step schedules and submits batch N+1, then reads batch N's output
(grammar commit, mask fill and apply and sampling belong to the submitted batch; output
processing and detokenization to the read one), so in steady state one step is one period of
the pipeline. A step counts when both batches are decode-only (one new token per sequence, read
from the scheduler's batches) and hold all n requests, and no request has finished yet: the
first decode step, which waits for the prefill's output, and the last ones, from which the
scheduler drops requests whose pending token already reaches their max tokens, do not. Every
request gets one token per such step, so step time == TPOT of each request in it. To compare
equal work, within a repeat every setting is cut to the same first K full-batch decode steps,
K = the smallest count among the settings (a constrained run ends the window when its first
answer completes). TPOT of a run = mean over those K steps. Prefill, admission/binding and
queueing are excluded.

Repeats are interleaved (for each schema and batch size, the five settings run back to back, in
forward then reverse order on alternate repeats: ABCDE EDCBA ...), so paired settings see the
same machine drift. Headline ratios are the median over repeats of the per-repeat paired ratio,
with min and max:

- enabled-request overhead = constrained / plain
- disabled-request regression = plain / never (feature used in-process, request unconstrained)
- neighbour effect = mixed / plain (cost for unconstrained requests of constrained neighbours;
  step time is shared by the whole batch)
- A/A control = plain2 / plain

The engine thread's structured-output hooks are also timed inside each step of the parent
process (the rank's `StructuredOutputWorker.start_step`, which hands a step's commit, mask fill
and mask of the logits to the grammar thread, and `finish_step`, which waits for that work; with
a grammar process, `gate_send` (`repeat_gate` for a steady batch; not counted before
2026-12-04), `gate_mask`, `publish` and `gate_errors`: send a step to the children, queue its
mask, put its sampled ids on the board, read its errors; wrapped on the instance): their time
per window step, as a share of the plain TPOT, is the part of the overhead the engine thread
spends on grammar work, measured without the run-to-run noise of a shared machine, and for the
constrained setting hook by hook (`grammar_hooks_ms_by_hook`). Grammar-thread work that
overlaps the engine thread's is not in it.

Checks (asserted; the run fails otherwise, after writing its results): greedy unconstrained
token ids equal across `never`, `plain`, `plain2` and the unconstrained half of `mixed` in every
repeat; `never` never imported structured output; every constrained answer that finished
validates against the schema; no preemption. Reported: how many constrained answers
finished/validated.

Prints a table; writes benchmarks/results/bench_structured_serving.json and .png (the SmolLM2
model on CPU), else bench_structured_serving_{device}.json and .png; each records the command,
commit, machine and device.
    python benchmarks/bench_structured_serving.py            # full (~5-6 min on 2 idle CPU cores)
    python benchmarks/bench_structured_serving.py --quick    # short smoke run
    python benchmarks/bench_structured_serving.py --random-llama-1b --device cuda   # ~3-4 min, H200
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).parent / "results"
ROLES = [
    "pirate",
    "baker",
    "astronaut",
    "knight",
    "detective",
    "wizard",
    "farmer",
    "pilot",
    "chef",
    "nurse",
    "sailor",
    "painter",
    "teacher",
    "miner",
    "dancer",
    "poet",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
# The random model's two mask densities. Their answers cannot end within RANDOM_MAX_TOKENS:
# closing the string needs 8192 characters (over 32 per token on average), the array 256
# integers (two tokens each at least: a number, a separator).
RANDOM_MAX_TOKENS = 256
RANDOM_SCHEMAS = {
    "mostly-allowed": {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 8192, "maxLength": 16384}},
        "required": ["text"],
        "additionalProperties": False,
    },
    # A free string: its mask is as dense, without the length counter that makes llguidance's
    # mask of the bounded string several times dearer. A random model rarely closes it; when it
    # does, the window ends there (only full-batch steps count).
    "free-string": {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
        "additionalProperties": False,
    },
    "mostly-forbidden": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 999},
        "minItems": 256,
    },
}
# Per model (False: SmolLM2, True: random Llama): what a flag left unset means. The random
# model's unconstrained requests are as long as its constrained ones, so the batch stays full
# (and the same shape) until every request ends.
DEFAULTS = {
    False: {"batch_sizes": [8, 16], "repeats": 8, "max_tokens": 96, "plain_max_tokens": 24},
    True: {"batch_sizes": [1, 16, 64, 256], "repeats": 3, "max_tokens": 64, "plain_max_tokens": 64},
}
QUICK = {False: {"batch_sizes": [8], "repeats": 2}, True: {"batch_sizes": [1, 16], "repeats": 2}}
MAX_MODEL_LEN = 512
SETTINGS = ("never", "plain", "constrained", "mixed", "plain2")
FORBIDDEN = ("atom.structured_output", "llguidance")
REPLY = "@@ "  # prefix of the `never` child's protocol lines (anything else on its stdout is not)

Row = tuple[str, int]  # (schema kind, batch size)


def schemas_of(args: argparse.Namespace) -> dict[str, dict]:
    if not args.random_llama_1b:
        return {"person": SCHEMA}
    return {kind: RANDOM_SCHEMAS[kind] for kind in args.schema_kinds or RANDOM_SCHEMAS}


def kv_cache_bytes(args: argparse.Namespace) -> int:
    """SmolLM2 keeps its 256 MiB. The random model gets exactly what its largest batch can hold
    at MAX_MODEL_LEN: the default of a share of free GPU memory would let the first of the two
    processes sharing the GPU take most of it."""
    if not args.random_llama_1b:
        return 256 << 20
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2  # bf16
    return per_token * MAX_MODEL_LEN * max(args.batch_sizes)


def add_share_from(ap: argparse.ArgumentParser) -> None:
    """`--share-from`, which `make_engine` applies; profile_step takes it too."""
    ap.add_argument(
        "--share-from",
        type=int,
        default=None,
        help="live requests the first grammar process takes before the others get new ones "
        "(default: structured_output.grammar_pool.SHARE_FROM)",
    )


def make_engine(args: argparse.Namespace, **overrides: Any) -> Any:
    """The benchmark's engine (`--grammar-process`, `--grammar-processes`, `--grammar-threads`,
    `--share-from`); `overrides`: other `EngineConfig` fields.

    Its startup heap is then frozen out of the garbage collector, as `atom serve` freezes its
    own: otherwise a full collection scans the model's and libraries' objects every so often,
    a stall of tens of milliseconds in whichever step triggers it."""
    from atom.config import EngineConfig
    from atom.model_engine.llm_engine import LLMEngine

    if getattr(args, "grammar_process", None) is not None:
        overrides.setdefault("structured_output_grammar_process", args.grammar_process == "on")
    if getattr(args, "grammar_processes", None) is not None:
        overrides.setdefault("structured_output_grammar_processes", args.grammar_processes)
    if getattr(args, "grammar_threads", None) is not None:
        overrides.setdefault("structured_output_threads", args.grammar_threads)
    if getattr(args, "share_from", None) is not None:
        from atom.structured_output import grammar_pool

        grammar_pool.SHARE_FROM = args.share_from
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype="bfloat16" if args.random_llama_1b else "auto",
            device=args.device,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=kv_cache_bytes(args),
            max_num_seqs=max(args.batch_sizes),
            enable_prefix_caching=False,
            **overrides,
        )
    )
    gc.collect()
    gc.freeze()
    return engine


def prompts_for(engine: Any, n: int, args: argparse.Namespace) -> list[list[int]]:
    """n distinct prompts; batch n's are the first n of batch m > n's."""
    if args.random_llama_1b:
        return random_prompts(engine.tokenizer, n, args.prompt_tokens)
    out = []
    for role in ROLES[:n]:
        text = (
            f"Invent a {role}. Reply with only a JSON object with exactly two keys: "
            '"name" (a short string) and "age" (an integer). No other text.'
        )
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        out.append(list(ids))
    return out


def random_prompts(tokenizer: Any, n: int, length: int) -> list[list[int]]:
    """Random ordinary token ids (no added or special token), one fixed seed per prompt: a
    random model has nothing to read in words, and both processes rebuild the same ids."""
    added = set(tokenizer.get_added_vocab().values())
    ordinary = [i for i in range(len(tokenizer)) if i not in added]
    return [random.Random(i).choices(ordinary, k=length) for i in range(n)]


class StepTimer:
    """Records, per `engine.step()`, the shapes of the batches the scheduler built in this step
    and the one before (with asynchronous scheduling a step submits one and reads the other)
    and (with `grammar=True`) the time the engine thread spent in its structured-output hooks
    (`start_step`: hand the commit, fill and mask to the grammar thread; `finish_step`: wait
    for them; with a grammar process `gate_send`, `gate_mask`, `publish`, `gate_errors`). It wraps methods of this engine's
    instances; nothing in `atom` is changed. The `never` process wraps only the scheduler, so
    nothing of the runner path differs there."""

    def __init__(self, engine: Any, grammar: bool = False):
        (core,) = engine.cores
        self.scheduler = core.scheduler
        # (sequences, decode only) of the batch scheduled last, and of the one before it
        self.last: tuple[int, bool] | None = None
        self.previous: tuple[int, bool] | None = None
        self.grammar_s = 0.0
        self.by_hook: Counter[str] = Counter()  # the same seconds by hook
        self.cpus: Counter[int] = Counter()  # where this thread ran (``sample_cpu``)
        schedule = self.scheduler.schedule

        def recording_schedule():
            batch = schedule()
            shape = (len(batch.seqs), all(k == 1 for k in batch.num_new_tokens))
            self.previous, self.last = self.last, shape
            return batch

        self.scheduler.schedule = recording_schedule
        if grammar:
            (runner,) = engine.executor.workers
            worker = runner.structured_output
            for name in (
                "start_step",
                "finish_step",
                "gate_step",  # before gate_send and gate_mask (a baseline checkout)
                "gate_send",
                "repeat_gate",  # a steady batch's gate_send
                "gate_mask",
                "publish",
                "gate_errors",
            ):
                if hasattr(worker, name):  # a baseline checkout may predate some of them
                    setattr(worker, name, self._timed(name, getattr(worker, name)))

    def sample_cpu(self) -> None:
        """Count the core this thread runs on now (Linux: ``/proc/thread-self/stat``'s 39th
        field): a run's overhead may depend on whether the engine thread shares a core with a
        grammar process (see ``placement``)."""
        with contextlib.suppress(OSError):
            stat = Path("/proc/thread-self/stat").read_text()
            self.cpus[int(stat.rsplit(")", 1)[1].split()[36])] += 1

    def full_decode(self, n: int) -> bool:
        """Did this step schedule, and read the output of, n-sequence decode-only batches?"""
        return self.last == self.previous == (n, True)

    def _timed(self, name: str, fn: Callable) -> Callable:
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                seconds = time.perf_counter() - t0
                self.grammar_s += seconds
                self.by_hook[name] += seconds

        return timed


_run_ids = iter(range(10**9))


def add_requests(engine: Any, prompts: list[list[int]], specs: list, args) -> list[str]:
    from atom.sampling_params import SamplingParams

    ids = []
    for prompt, spec in zip(prompts, specs, strict=True):
        rid = f"r{next(_run_ids)}"
        ids.append(rid)
        if spec is None:
            params = SamplingParams(
                temperature=0.0, max_tokens=args.plain_max_tokens, ignore_eos=True
            )
        else:
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
            params.structured_output = spec
        engine.add_request(rid, prompt, params)
    return ids


def run(engine: Any, timer: StepTimer, prompts: list[list[int]], specs: list, args) -> dict:
    """One batch to completion. Returns the full-batch decode step times (ms) in order."""
    ids = add_requests(engine, prompts, specs, args)
    n = len(prompts)
    finals: dict[str, Any] = {}
    steps: list[float] = []
    grammar: list[float] = []  # ms of each of those steps spent in the runner's grammar hooks
    by_hook: list[dict[str, float]] = []  # the same by hook
    full = True  # no request has finished yet
    timer.last = timer.previous = None
    while engine.has_unfinished_requests():
        timer.grammar_s = 0.0
        timer.by_hook.clear()
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if full and timer.full_decode(n):
            steps.append(1000 * dt)
            grammar.append(1000 * timer.grammar_s)
            by_hook.append({k: 1000 * v for k, v in timer.by_hook.items()})
            if len(steps) % 8 == 1:
                timer.sample_cpu()
        for o in outs:
            if o.finished:
                finals[o.request_id] = o
                full = False
    outputs = [finals[r] for r in ids]
    return {
        "steps_ms": steps,
        "grammar_ms": grammar,
        "grammar_ms_by_hook": by_hook,
        "token_ids": [list(o.output_token_ids) for o in outputs],
        "texts": [o.text for o in outputs],
        "finish": [o.finish_reason for o in outputs],
    }


def reply(obj: object) -> None:
    print(REPLY + json.dumps(obj), flush=True)


def child(args: argparse.Namespace) -> None:
    """The `never` side: one unconstrained run per "run N" line on stdin, so the parent can
    interleave these runs with its own."""
    engine = make_engine(args)
    timer = StepTimer(engine)
    assert not [m for m in sys.modules if m.startswith(FORBIDDEN)]
    prompts = {n: prompts_for(engine, n, args) for n in args.batch_sizes}
    for n in args.batch_sizes:  # warm up like the parent
        run(engine, timer, prompts[n], [None] * n, args)
    reply("ready")
    for line in sys.stdin:
        cmd = line.split()
        if cmd[:1] != ["run"]:
            break
        n = int(cmd[1])
        r = run(engine, timer, prompts[n], [None] * n, args)
        reply({"steps_ms": r["steps_ms"], "token_ids": r["token_ids"]})
    leaked = [m for m in sys.modules if m.startswith(FORBIDDEN)]
    preemptions = timer.scheduler.num_preemptions
    engine.shutdown()
    reply({"imported": leaked, "preemptions": preemptions})


class NeverProcess:
    """The parent's handle on the `never` child: same model, sizes and lengths, driven one run
    at a time. Lines of its stdout without the protocol prefix (a library's print) are passed
    to stderr, never parsed."""

    def __init__(self, args: argparse.Namespace):
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--device", args.device]
        cmd += ["--batch-sizes", *map(str, args.batch_sizes), "--max-tokens", str(args.max_tokens)]
        cmd += ["--plain-max-tokens", str(args.plain_max_tokens)]
        cmd += ["--prompt-tokens", str(args.prompt_tokens)]
        cmd += ["--random-llama-1b"] if args.random_llama_1b else []
        cmd += ["--threads", str(args.threads)] if args.threads is not None else []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _reply(self) -> Any:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])
            print(f"[never] {line}", end="", file=sys.stderr)
        raise SystemExit("the `never` process died")

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_ready(self) -> None:
        if self._reply() != "ready":
            raise SystemExit("the `never` process did not start")

    def run(self, n: int) -> dict:
        self._send(f"run {n}")
        return self._reply()

    def finish(self) -> dict:
        """Its imports and preemptions, read after its last run; then it exits."""
        self._send("quit")
        end = self._reply()
        self.proc.wait(timeout=60)
        return end


def admit(engine: Any, spec: Any) -> None:
    from atom.structured_output.admission import api_fingerprint

    vocab = engine.hf_config.vocab_size
    fp = api_fingerprint(engine.tokenizer, engine.eos_token_ids, vocab)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        (answer,) = engine.collective_rpc("structured_output_admit", spec, fp, vocab)
        if answer["status"] == "ready":
            return
        if answer["status"] == "error":
            raise SystemExit(answer["message"])
        time.sleep(0.02)
    raise SystemExit("grammar admission did not finish")


def admitted_specs(engine: Any, schemas: dict[str, dict]) -> dict[str, Any]:
    """Each schema as a chat `response_format` spec, its grammar compiled on the worker."""
    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.structured_output.spec import StructuredOutputSpec

    specs = {}
    for kind, schema in schemas.items():
        rf = {"type": "json_schema", "json_schema": {"name": kind, "schema": schema}}
        specs[kind] = StructuredOutputSpec.of(parse_chat_response_format(rf), None)
        admit(engine, specs[kind])
    return specs


def setting_specs(spec: Any, n: int) -> dict[str, list]:
    """Per parent setting, each request's spec (None: unconstrained)."""
    return {
        "plain": [None] * n,
        "plain2": [None] * n,
        "constrained": [spec] * n,
        "mixed": [spec if i % 2 else None for i in range(n)],
    }


def measure(
    engine: Any,
    timer: StepTimer,
    never: NeverProcess,
    prompts: dict[int, list[list[int]]],
    specs: dict[Row, dict[str, list]],
    args: argparse.Namespace,
) -> dict[Row, dict[str, list[dict]]]:
    """Interleaved repeats (ABCDE EDCBA ...) of every row; per row and setting, the run dicts."""
    from tqdm import tqdm

    raw: dict[Row, dict[str, list[dict]]] = {row: {k: [] for k in SETTINGS} for row in specs}
    with tqdm(total=args.repeats * len(specs) * len(SETTINGS), desc="runs", unit="run") as bar:
        for rep in range(args.repeats):
            order = SETTINGS if rep % 2 == 0 else SETTINGS[::-1]
            for kind, n in specs:
                for name in order:
                    bar.set_postfix_str(f"repeat {rep + 1} {kind} batch {n} {name}")
                    if name == "never":
                        r = never.run(n)
                    else:
                        r = run(engine, timer, prompts[n], specs[kind, n][name], args)
                    raw[kind, n][name].append(r)
                    bar.update()
    return raw


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def outputs_match(
    raw: dict[str, list[dict]], specs: dict[str, list], label: str, failures: list[str]
) -> bool:
    """Greedy unconstrained token ids equal across never, plain, plain2 and the unconstrained
    half of mixed, in every repeat (a failure per repeat that differs)."""
    plain_idx = [i for i, s in enumerate(specs["mixed"]) if s is None]
    ref = raw["never"][0]["token_ids"]
    match = True
    for rep in range(len(raw["never"])):
        same = (
            raw["never"][rep]["token_ids"] == ref
            and raw["plain"][rep]["token_ids"] == ref
            and raw["plain2"][rep]["token_ids"] == ref
            and all(raw["mixed"][rep]["token_ids"][i] == ref[i] for i in plain_idx)
        )
        if not same:
            match = False
            failures.append(f"{label} repeat {rep + 1}: unconstrained outputs differ")
    return match


def constrained_answers(
    raw: dict[str, list[dict]], specs: dict[str, list], label: str, failures: list[str]
) -> tuple[dict[str, int], list[int]]:
    """How the constrained requests ended; every finished answer must validate. Returns the
    counts and the token lengths of the finished answers."""
    from atom.structured_output.answer import AnswerValidationError, validate_answer

    answers = {"constrained": 0, "finished": 0, "validated": 0, "length": 0, "error": 0}
    lengths = []
    for name in ("constrained", "mixed"):
        for rep, r in enumerate(raw[name]):
            for i, s in enumerate(specs[name]):
                if s is None:
                    continue
                answers["constrained"] += 1
                finish = r["finish"][i]
                if finish == "stop":
                    answers["finished"] += 1
                    lengths.append(len(r["token_ids"][i]))
                    try:
                        validate_answer(s.constraint, r["texts"][i])
                        answers["validated"] += 1
                    except AnswerValidationError as e:
                        failures.append(f"{label} repeat {rep + 1} {name} #{i}: invalid answer {e}")
                elif finish == "length":
                    answers["length"] += 1
                else:
                    answers["error"] += 1
    return answers, lengths


def constrained_stable(raw: dict[str, list[dict]], specs: dict[str, list]) -> bool:
    """A prompt's constrained answer should not depend on the batch's composition."""
    first = raw["constrained"][0]["token_ids"]
    return all(
        r["token_ids"][i] == first[i]
        for name in ("constrained", "mixed")
        for r in raw[name]
        for i, s in enumerate(specs[name])
        if s is not None
    )


def ratios_of(runs: dict[str, list[float]]) -> dict[str, list[float]]:
    """The four headline ratios, paired within each repeat."""

    def paired(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(runs[a], runs[b], strict=True)]

    return {
        "enabled_overhead": paired("constrained", "plain"),
        "disabled_regression": paired("plain", "never"),
        "neighbour_effect": paired("mixed", "plain"),
        "aa_control": paired("plain2", "plain"),
    }


def window_stats(raw: dict[str, list[dict]], label: str, failures: list[str]) -> dict:
    """TPOT over each repeat's common window of K full-batch decode steps, the ratios, and the
    runner's grammar hook time in that window."""
    tpot: dict[str, list[float]] = {k: [] for k in SETTINGS}
    step_median: dict[str, list[float]] = {k: [] for k in SETTINGS}
    hooks: dict[str, list[float]] = {k: [] for k in SETTINGS if k != "never"}
    by_hook: dict[str, list[float]] = {}  # constrained, ms per window step, per repeat
    windows = []
    for rep in range(len(raw["never"])):
        k = min(len(raw[name][rep]["steps_ms"]) for name in SETTINGS)
        if k < 3:
            failures.append(f"{label} repeat {rep + 1}: only {k} full-batch decode steps")
        windows.append(k)
        for name in SETTINGS:
            window = raw[name][rep]["steps_ms"][:k] or [float("nan")]
            tpot[name].append(statistics.fmean(window))
            step_median[name].append(statistics.median(window))
            if name != "never":
                hooks[name].append(statistics.fmean(raw[name][rep]["grammar_ms"][:k] or [0.0]))
        steps = raw["constrained"][rep].get("grammar_ms_by_hook", [])[:k]
        for hook in sorted({h for step in steps for h in step}):
            by_hook.setdefault(hook, []).append(sum(s.get(hook, 0.0) for s in steps) / k)
    ratio_runs = ratios_of(tpot)
    return {
        "window_steps": windows,
        "tpot_ms": {k: spread(v) for k, v in tpot.items()},
        "tpot_ms_runs": tpot,
        "ratios": {k: spread(v) for k, v in ratio_runs.items()},
        "ratio_runs": ratio_runs,
        # ms per window step in the engine thread's grammar hooks (start_step + finish_step)
        "grammar_hooks_ms": {k: spread(v) for k, v in hooks.items()},
        # the constrained setting's hooks one by one (which of them the time is)
        "grammar_hooks_ms_by_hook": {k: spread(v) for k, v in by_hook.items()},
        # the same as a share of the plain TPOT of the repeat: the overhead the hooks account
        # for, measured inside the step (insensitive to machine noise between runs)
        "grammar_hooks_share": {
            k: spread([h / p for h, p in zip(v, tpot["plain"], strict=True)])
            for k, v in hooks.items()
            if k in ("constrained", "mixed")
        },
        "window_steps_ms": {
            k: [[round(x, 2) for x in r["steps_ms"][:w]] for r, w in zip(v, windows, strict=True)]
            for k, v in raw.items()
        },
        # robustness check: the same ratios with the median step instead of the mean
        "ratios_step_median": {k: spread(v) for k, v in ratios_of(step_median).items()},
    }


def summarize_row(
    raw: dict[str, list[dict]], specs: dict[str, list], label: str, failures: list[str]
) -> dict:
    """Everything reported for one (schema, batch size) row; failed checks go to `failures`."""
    answers, lengths = constrained_answers(raw, specs, label, failures)
    return window_stats(raw, label, failures) | {
        "constrained_answers": answers,
        "constrained_answer_tokens": spread(lengths) if lengths else None,
        "unconstrained_outputs_match": outputs_match(raw, specs, label, failures),
        "constrained_outputs_stable": constrained_stable(raw, specs),
        "example_answers": raw["constrained"][0]["texts"][:4],
    }


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return (
            f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, torch {torch.__version__}"
        )
    return f"CPU, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads"


def engine_info(engine: Any) -> dict:
    """The engine settings the step times depend on (at their defaults but the grammar
    process's, which `--grammar-process` sets)."""
    c = engine.config
    return {
        "async_scheduling": c.async_scheduling,
        "cuda_graphs": c.device == "cuda" and not c.enforce_eager,
        "dtype": c.dtype,
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "max_model_len": c.max_model_len,
        "kv_cache_bytes": c.kv_cache_bytes,
        "structured_output_threads": c.structured_output_threads,
        "structured_output_whitespace": c.structured_output_whitespace,
        "structured_output_grammar_process": c.structured_output_grammar_process,
        "structured_output_grammar_processes": c.grammar_processes(c.device),
    }


def worker_stats(engine: Any) -> dict:
    """The rank's structured-output counters (gates and repeated gates among them)."""
    (runner,) = engine.executor.workers
    return runner.structured_output.stats()


def placement(engine: Any, timer: StepTimer) -> dict:
    """The cores the engine thread was seen on during the timed steps (core: samples), and
    those each grammar process may run on: batch 1's overhead went from 1.05 to 1.3 between
    engine processes of the same code on the H200 (benchmarks/results/h200_2026-12-04m), and a
    shared core is one suspect."""
    (runner,) = engine.executor.workers
    pool = runner.structured_output.pool
    children = []
    for process in pool.processes if pool is not None else []:
        try:
            children.append(sorted(os.sched_getaffinity(process.pid)))
        except (OSError, AttributeError):
            children.append(None)
    return {
        "engine_thread_cpus": dict(sorted(timer.cpus.items())),
        "grammar_process_cpus": children,
    }


RATIO_LABELS = {
    "enabled_overhead": "enabled-request overhead (constrained / plain)",
    "disabled_regression": "disabled-request regression (plain / never)",
    "neighbour_effect": "neighbour effect (mixed / plain)",
    "aa_control": "A/A control, no change (plain2 / plain)",
}


def rows_of(result: dict) -> list[tuple[str, int, dict]]:
    return [
        (kind, int(n), row)
        for kind, rows in result["per_schema"].items()
        for n, row in rows.items()
    ]


def print_tables(result: dict) -> None:
    """TPOT per setting and the paired ratios, one line per (schema, batch size)."""
    print(f"\nTPOT (ms; median [min-max] over {result['repeats']} interleaved repeats)")
    print(f"{'schema':<17}{'batch':>5} {'window':>7}  " + "".join(f"{k:>22}" for k in SETTINGS))
    for kind, n, row in rows_of(result):
        w = f"{min(row['window_steps'])}-{max(row['window_steps'])}"
        cells = "".join(
            f"{s['median']:>8.2f} [{s['min']:.2f}-{s['max']:.2f}]".rjust(22)
            for s in (row["tpot_ms"][k] for k in SETTINGS)
        )
        print(f"{kind:<17}{n:>5} {w:>7}  {cells}")
    for key, title in (
        ("ratios", "paired per-repeat ratios: median [min, max]"),
        ("ratios_step_median", "the same with each run's median step (robustness check)"),
    ):
        print(f"\n{title}")
        for k, label in RATIO_LABELS.items():
            print(f"  {k:<20} {label}")
        print(f"{'schema':<17}{'batch':>5}  " + "".join(f"{k:>24}" for k in RATIO_LABELS))
        for kind, n, row in rows_of(result):
            cells = "".join(
                "{:.3f} [{:.3f}, {:.3f}]".format(*row[key][k].values()).rjust(24)
                for k in RATIO_LABELS
            )
            print(f"{kind:<17}{n:>5}  {cells}")


def print_checks(result: dict) -> None:
    """Answers, output checks and the runner's grammar hook time, per row."""
    print()
    for kind, n, row in rows_of(result):
        a = row["constrained_answers"]
        h, share = row["grammar_hooks_ms"], row["grammar_hooks_share"]
        print(
            f"{kind} batch {n}: constrained answers {a['finished']}/{a['constrained']} finished, "
            f"{a['validated']}/{a['finished']} validated, {a['length']} hit the cap, "
            f"{a['error']} errors; unconstrained outputs equal across never/plain/plain2/mixed: "
            f"{row['unconstrained_outputs_match']}; constrained outputs stable: "
            f"{row['constrained_outputs_stable']}\n  engine-thread grammar hooks per decode step "
            "(ms, median): "
            + ", ".join(f"{k} {v['median']:.2f}" for k, v in h.items())
            + f" = {100 * share['constrained']['median']:.1f}% (constrained), "
            f"{100 * share['mixed']['median']:.1f}% (mixed) of plain TPOT\n  constrained by hook: "
            + ", ".join(
                f"{k} {v['median']:.3f}" for k, v in row.get("grammar_hooks_ms_by_hook", {}).items()
            )
        )
    where = result["placement"]
    print(
        f"engine thread seen on cores (core: samples) {where['engine_thread_cpus']}; "
        f"grammar processes on {where['grammar_process_cpus']}; {result['gates']}"
    )
    print(f"`never` process imported structured output: {result['never_process_imported'] or 'no'}")
    print(
        f"grammar states after the run: {result['structured_output_stats_after']}; "
        f"wall {result['wall_s']} s"
    )


COLORS = {
    "never": "#999",
    "plain": "#4a7",
    "constrained": "#d73",
    "mixed": "#e9a23b",
    "plain2": "#8c8",
}


def plot_tpot(ax: Any, rows: list[tuple[str, int, dict]]) -> None:
    width = 0.8 / len(SETTINGS)
    for j, name in enumerate(SETTINGS):
        xs, ys, lo, hi = [], [], [], []
        for i, (_, _, row) in enumerate(rows):
            s = row["tpot_ms"][name]
            xs.append(i + (j - (len(SETTINGS) - 1) / 2) * width)
            ys.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, color=COLORS[name], label=name)
    ax.set_ylabel("TPOT = full-batch decode step (ms)")
    ax.set_title("TPOT per setting (median, min-max over repeats)")
    ax.legend(fontsize=8)


def plot_ratios(ax: Any, rows: list[tuple[str, int, dict]]) -> None:
    """Per row: each ratio's median as a bar from 1, its repeats as dots, and the runner's
    grammar hooks' share of plain TPOT as a blue tick."""
    ratios = [
        ("enabled_overhead", "constrained / plain"),
        ("disabled_regression", "plain / never"),
        ("neighbour_effect", "mixed / plain"),
        ("aa_control", "A/A control: plain2 / plain"),
    ]
    width = 0.8 / len(ratios)
    rcolors = ["#d73", "#4a7", "#e9a23b", "#bbb"]
    for j, (key, label) in enumerate(ratios):
        for i, (_, _, row) in enumerate(rows):
            x = i + (j - (len(ratios) - 1) / 2) * width
            s = row["ratios"][key]
            first = i == 0
            ax.bar(
                x,
                s["median"] - 1.0,
                width,
                bottom=1.0,
                color=rcolors[j],
                label=label if first else None,
            )
            ax.scatter([x] * len(row["ratio_runs"][key]), row["ratio_runs"][key], s=10, c="k")
            if key in ("enabled_overhead", "neighbour_effect"):
                name = "constrained" if key == "enabled_overhead" else "mixed"
                hook = 1.0 + row["grammar_hooks_share"][name]["median"]
                tick = "1 + grammar hooks / plain" if first and j == 0 else None
                ax.plot([x - width / 2, x + width / 2], [hook, hook], color="b", lw=2, label=tick)
            ax.text(x, s["max"], f"{s['median']:.3f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    values = [v for _, _, row in rows for runs in row["ratio_runs"].values() for v in runs]
    ax.set_ylim(min(values + [1.0]) - 0.05, max(values + [1.0]) + 0.08)
    ax.set_ylabel("paired TPOT ratio (bar from 1: median; dots: repeats)")
    ax.set_title("paired ratios")
    ax.legend(fontsize=8, loc="upper left")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rows_of(result)
    kinds = len(result["per_schema"])
    fig, axes = plt.subplots(1, 2, figsize=(max(11.0, 2.2 * len(rows)), 4.6))
    plot_tpot(axes[0], rows)
    plot_ratios(axes[1], rows)
    labels = [f"{kind}\nbatch {n}" if kinds > 1 else f"batch {n}" for kind, n, _ in rows]
    for ax in axes:
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
    fig.suptitle(
        f"structured output serving, {result['model']}, {result['device']}, "
        f"{result['repeats']} interleaved repeats",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    """Flags left unset take the model's defaults (DEFAULTS; `--quick`: QUICK)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: embedded SmolLM2)")
    ap.add_argument(
        "--random-llama-1b",
        action="store_true",
        help="bench_engine's random-weight Llama-3.2-1B-shaped model (129,280-token DeepSeek "
        "tokenizer, bf16), built into --model-dir if missing (--model: an existing one)",
    )
    ap.add_argument("--model-dir", default="/tmp/atom-random-llama-1b-129k")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="cap of constrained requests")
    ap.add_argument("--plain-max-tokens", type=int, default=None, help="unconstrained length")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="random model's prompt length")
    ap.add_argument(
        "--schema-kinds",
        nargs="+",
        choices=sorted(RANDOM_SCHEMAS),
        default=None,
        help="random model: which schemas (default: all)",
    )
    ap.add_argument(
        "--grammar-process",
        choices=["on", "off"],
        default=None,
        help="grammar states in a process of their own (default: the engine's)",
    )
    ap.add_argument(
        "--grammar-processes",
        type=int,
        default=None,
        help="grammar processes per rank (default: the engine's, one per 7 spare cores)",
    )
    ap.add_argument(
        "--grammar-threads",
        type=int,
        default=None,
        help="llguidance executor threads (default: the engine's, one per core up to 16)",
    )
    ap.add_argument(
        "--repeat-gates",
        choices=["on", "off"],
        default="on",
        help="off: every gate sends its commits and jobs (an A/A-style check of repeated gates "
        "in the same checkout; this process's worker is patched, nothing in atom changes)",
    )
    add_share_from(ap)
    ap.add_argument(
        "--pin-engine-thread",
        action="store_true",
        help="keep the engine thread on the core the grammar processes leave free (the last)",
    )
    ap.add_argument("--tag", default="", help="suffix of the output files")
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes, 2 repeats")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for key, value in DEFAULTS[args.random_llama_1b].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        vars(args).update(QUICK[args.random_llama_1b])
    if not args.random_llama_1b and max(args.batch_sizes) > len(ROLES):
        ap.error(f"at most {len(ROLES)} requests per batch")
    if args.random_llama_1b and max(args.max_tokens, args.plain_max_tokens) > RANDOM_MAX_TOKENS:
        ap.error(f"the random model's schemas hold answers of up to {RANDOM_MAX_TOKENS} tokens")
    longest = max(args.max_tokens, args.plain_max_tokens)
    if args.random_llama_1b and args.prompt_tokens + longest > MAX_MODEL_LEN:
        ap.error(f"--prompt-tokens + max tokens must fit in {MAX_MODEL_LEN} tokens")
    return args


def resolve_model(args: argparse.Namespace) -> str:
    """The model folder: --model, else the random Llama (built if missing), else SmolLM2."""
    if args.model is not None:
        return args.model
    if args.random_llama_1b:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_engine import make_random_llama_1b

        print(f"random Llama-3.2-1B-shaped model in {args.model_dir}", flush=True)
        return str(make_random_llama_1b(Path(args.model_dir), args.device))
    from atom.config import EngineConfig
    from atom.model_loader import resolve_model as resolve

    return str(resolve(EngineConfig()))


def output_stem(args: argparse.Namespace) -> str:
    """The SmolLM2 CPU run keeps its historical name; other runs are named by device."""
    if args.device == "cpu" and not args.random_llama_1b:
        return "bench_structured_serving"
    return f"bench_structured_serving_{args.device}" + (f"_{args.tag}" if args.tag else "")


def bench(args: argparse.Namespace) -> None:
    """Start the `never` child and this process's engine, warm both up, run the interleaved
    repeats, then check and report."""
    t_start = time.monotonic()
    load_start = round(os.getloadavg()[0], 2)
    if load_start > 0.5:
        print(f"warning: 1-minute load average {load_start}: the machine is busy", flush=True)
    never = NeverProcess(args)
    engine = make_engine(args)
    timer = StepTimer(engine, grammar=True)
    if args.repeat_gates == "off":
        (runner,) = engine.executor.workers
        runner.structured_output.repeats_last_gate = lambda *_: False
    never.wait_ready()  # its load and warm-up end before this process compiles anything
    specs = admitted_specs(engine, schemas_of(args))
    if args.pin_engine_thread:
        # Only this thread (Linux affinity is per thread; threads it starts later inherit it),
        # once admission started the grammar processes: ``split_cores`` reads the affinity of
        # the thread that starts them.
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    prompts = {n: prompts_for(engine, n, args) for n in args.batch_sizes}
    rows = {(k, n): setting_specs(spec, n) for k, spec in specs.items() for n in args.batch_sizes}
    for n in args.batch_sizes:  # warm up: bind, mask buffers, the plain path
        for kind in specs:
            run(engine, timer, prompts[n], rows[kind, n]["mixed"], args)
        run(engine, timer, prompts[n], [None] * n, args)
    raw = measure(engine, timer, never, prompts, rows, args)
    state = {
        "engine": engine_info(engine),
        "placement": placement(engine, timer),
        "gates": {k: v for k, v in worker_stats(engine).items() if "gates" in k},
        "structured_output_stats_after": engine.structured_output_stats(),
        "preemptions": {"parent": timer.scheduler.num_preemptions},
    }
    engine.shutdown()
    never_end = never.finish()
    state["preemptions"]["never"] = never_end["preemptions"]
    state["never_process_imported"] = never_end["imported"]
    state["loadavg_1m_start_end"] = [load_start, round(os.getloadavg()[0], 2)]
    state["wall_s"] = round(time.monotonic() - t_start, 1)
    report(args, raw, rows, state)


def report(
    args: argparse.Namespace,
    raw: dict[Row, dict[str, list[dict]]],
    rows: dict[Row, dict[str, list]],
    state: dict,
) -> None:
    """Checks, tables, the JSON and the plot; fails (after writing them) if a check failed."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_serving import git_state, machine

    failures: list[str] = []
    if state["never_process_imported"]:
        failures.append(f"the `never` process imported {state['never_process_imported']}")
    if any(state["preemptions"].values()):
        failures.append("preemption happened (KV cache too small): batches were not full")
    per_schema: dict[str, dict[str, dict]] = {}
    for (kind, n), specs in rows.items():
        row = summarize_row(raw[kind, n], specs, f"{kind} batch {n}", failures)
        per_schema.setdefault(kind, {})[str(n)] = row
    result = {
        "command": " ".join(["python", "benchmarks/bench_structured_serving.py", *sys.argv[1:]]),
        "git": git_state(),
        "device": device_name(args.device),
        "machine": machine(args.device),
        "model": "random Llama-3.2-1B shape" if args.random_llama_1b else Path(args.model).name,
        "model_path": args.model,
        "batch_sizes": args.batch_sizes,
        "repeats": args.repeats,
        "max_tokens_constrained": args.max_tokens,
        "max_tokens_unconstrained": args.plain_max_tokens,
        "prompt_tokens": args.prompt_tokens if args.random_llama_1b else "chat prompts",
        "schemas": schemas_of(args),
        "tpot_definition": (
            "mean wall time of LLMEngine.step() over the first K steps that schedule and read "
            "decode-only batches of all n requests, before any request finished (K common to "
            "the five settings of a repeat)"
        ),
        "per_schema": per_schema,
        "failures": failures,
    } | state
    print_tables(result)
    print_checks(result)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / output_stem(args)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")
    if failures:
        raise SystemExit("FAILED:\n  " + "\n  ".join(failures))


def main() -> None:
    args = parse_args()
    args.model = resolve_model(args)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.child:
        child(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
