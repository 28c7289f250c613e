"""`atom schema-check SCHEMA.json...`: would these schemas be accepted for structured output?

Each file goes through the same preflight and strict llguidance compile as a request. Whatever
a file holds, the result is a line per file and an exit status, never a traceback.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 16 << 20


def _compiler(spec: str | None) -> Callable[[dict], object]:
    """The worker's strict compile for an HF folder/name or a .gguf (default: embedded SmolLM2)."""
    from transformers import AutoTokenizer

    from atom.structured_output.backend_guidance import GuidanceBackend

    if spec is None or spec.endswith(".gguf"):
        from atom.model_loader.resolve import embedded_gguf

        path = embedded_gguf() if spec is None else Path(spec)
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        hf = AutoTokenizer.from_pretrained(spec)
    return GuidanceBackend(hf, lm_head_size=len(hf)).grammar


def check_file(path: str, compile_grammar: Callable[[dict], object]) -> dict:
    """One result object: {"file", "ok", "error", "pointer", "compile_ms"}."""
    from atom.structured_output.schema import SchemaError, prepare_schema

    result: dict[str, Any] = {"file": path, "ok": False, "error": None, "pointer": None}
    result["compile_ms"] = None
    try:
        raw = Path(path).read_bytes()
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"file larger than {MAX_FILE_BYTES} bytes")
        schema = json.loads(raw)
    except RecursionError:
        result["error"] = "cannot read a JSON document: nested too deeply"
        return result
    except (OSError, ValueError) as exc:
        result["error"] = f"cannot read a JSON document: {exc}"[:500]
        return result
    start = time.perf_counter()
    try:
        compile_grammar(prepare_schema(schema).lowered)
    except SchemaError as exc:
        result.update(error=exc.message, pointer=exc.pointer)
    except Exception as exc:  # GrammarError, and anything else: the command reports, never crashes
        result["error"] = str(exc)[:500] or type(exc).__name__
    else:
        result.update(ok=True, compile_ms=round((time.perf_counter() - start) * 1000, 3))
    return result


def run_schema_check(files: list[str], tokenizer: str | None = None, as_json: bool = False) -> int:
    """Check every file; exit status 0 when all are accepted, 1 otherwise."""
    try:
        compile_grammar = _compiler(tokenizer)
    except Exception as exc:
        print(f"schema-check: cannot load tokenizer {tokenizer!r}: {exc}", file=sys.stderr)
        return 1
    all_ok = True
    for path in files:
        result = check_file(path, compile_grammar)
        all_ok &= result["ok"]
        if as_json:
            print(json.dumps(result, ensure_ascii=False))
        elif result["ok"]:
            print(f"{path}: ok ({result['compile_ms']:.1f} ms)")
        else:
            where = f" at {result['pointer']!r}" if result["pointer"] is not None else ""
            print(f"{path}: error{where}: {result['error']}")
    return 0 if all_ok else 1
