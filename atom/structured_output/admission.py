"""The API side of admission: before a constrained request is queued, every worker rank checks
the API's tokenizer fingerprint and vocabulary against its LM head and compiles the grammar.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atom.structured_output.spec import StructuredOutputSpec

ADMISSION_TIMEOUT_S = 120.0
_POLL_FIRST_S, _POLL_MAX_S = 0.002, 0.05


class AdmissionError(ValueError):
    """A worker rank refused the constraint (fingerprint, vocabulary, LM head, compilation)."""


_fingerprints: dict[tuple[int, tuple[int, ...], int], tuple[Any, str]] = {}
_fingerprints_lock = threading.Lock()


def api_fingerprint(tokenizer: Any, stop_token_ids: list[int], vocab_size: int) -> str:
    """The API side of the tokenizer check, computed once per tokenizer (it hashes the vocab)."""
    from atom.structured_output.backend_guidance import tokenizer_fingerprint

    key = (id(tokenizer), tuple(sorted(stop_token_ids)), vocab_size)
    with _fingerprints_lock:
        hit = _fingerprints.get(key)
    if hit is not None and hit[0] is tokenizer:  # the entry keeps its tokenizer alive
        return hit[1]
    fingerprint = tokenizer_fingerprint(tokenizer, stop_token_ids, vocab_size)
    with _fingerprints_lock:
        _fingerprints[key] = (tokenizer, fingerprint)
    return fingerprint


def rank_results_ready(results: list[dict]) -> bool:
    """Whether every rank's admission answer is ready (``AdmissionError`` when one refused)."""
    for r in results:
        if r["status"] == "error":
            raise AdmissionError(f"rank {r.get('rank', '?')}: {r['message']}")
    return bool(results) and all(r["status"] == "ready" for r in results)


async def admit_on_workers(
    rpc: Any,
    spec: StructuredOutputSpec,
    fingerprint: str,
    vocab_size: int,
    *,
    timeout_s: float = ADMISSION_TIMEOUT_S,
) -> None:
    """Admission on every rank through ``await rpc(method, *args) -> list[dict]``.

    Each rank checks the fingerprint and vocabulary against its LM head and compiles the
    grammar in its background executor; a cold compile answers ``pending`` and is polled with
    short ``asyncio.sleep``s (the event loop never blocks, the engine loop never waits for a
    compile). Any rank error raises ``AdmissionError``.
    """
    deadline = time.monotonic() + timeout_s
    delay = _POLL_FIRST_S
    while True:
        results = await rpc("structured_output_admit", spec, fingerprint, vocab_size)
        if rank_results_ready(results):
            return
        if time.monotonic() > deadline:
            raise AdmissionError(f"grammar compilation did not finish within {timeout_s:.0f} s")
        await asyncio.sleep(delay)
        delay = min(2 * delay, _POLL_MAX_S)
