"""The parallel mask fill (llguidance's executor over the rows of different requests) writes the
same bits as the serial fill (``threads=1``), post-filters and errors included: many requests on
several schemas stepped along their answers, with free keys (the repeated-key guard), draft rows,
reasoning before an end marker, finished and failed requests."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("llguidance")

from llguidance import LLParserLimits  # noqa: E402
from llguidance.torch import fill_next_token_bitmask  # noqa: E402

from atom.structured_output.manager import StructuredOutputManager  # noqa: E402
from atom.structured_output.utils import num_mask_words  # noqa: E402

FREE_INTS = {"type": "object", "additionalProperties": {"type": "integer"}}
SCHEMAS = {
    "open": FREE_INTS,
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "tags": {"type": "object", "additionalProperties": {"type": "string"}},
            "items": {"type": "array", "items": FREE_INTS},
        },
        "required": ["id", "tags", "items"],
        "additionalProperties": False,
    },
    "strings": {"type": "object", "additionalProperties": {"type": "string"}},
    "ints": {"type": "array", "items": {"type": "integer"}},
    "only-a": {
        "type": "object",
        "patternProperties": {"^a$": {"type": "integer"}},
        "additionalProperties": False,
    },
    "fuel": {"type": "object"},  # compiled with no lexer fuel: its first mask fails
}
ANSWERS = {
    "open": '{"a":1,"b":2,"ab":3,"b ":4,"":5,",":6,"abc":7}',
    "nested": '{"id":7,"tags":{"x":"y","xy":"z","":"e"},"items":[{"q":1,"qq":2},{"q":3,"":4}]}',
    "strings": '{"k\\"":"v\\n","k":"\\u00e9","\\u006bb":"w","kb ":"x"}',
    "ints": "[12, -40, 7, 100003, 0, 5]",
    "only-a": '{"a":1,"a":2}',  # the second "a" can only repeat the first: an error
    "fuel": '{"a":1}',
}
MARKER = b"</think>"
STEPS = 24


def spec(key: str, end_marker: bytes | None = None) -> SimpleNamespace:
    """Shaped like ``spec.StructuredOutputSpec`` (what admission and binding read)."""
    return SimpleNamespace(key=key, lowered=SCHEMAS[key], end_marker=end_marker)


def starved(limits: LLParserLimits) -> LLParserLimits:
    """``limits`` with no lexer fuel per step: a matcher's first mask computation fails."""
    names = [n for n in dir(limits) if not n.startswith("_")]
    return LLParserLimits(**{**{n: getattr(limits, n) for n in names}, "step_lexer_fuel": 1})


@pytest.fixture(scope="module")
def managers(smollm2_dir):
    """(parallel, serial): the same tokenizer and grammars, 4 executor threads against 1."""
    from transformers import AutoTokenizer

    from atom.structured_output import grammar_lanes

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    # One template per grammar, as on the serial side: the starved "fuel" grammar fails through
    # the lexer its copies share, which a fresh lane would not (lanes: test_grammar_lanes.py).
    lanes_off = pytest.MonkeyPatch()
    lanes_off.setattr(grammar_lanes, "LANE_COMPILE_LIMIT_S", -1.0)
    made = [StructuredOutputManager(hf, vocab_size=len(hf), threads=t) for t in (4, 1)]
    for mgr in made:
        for key in SCHEMAS:
            normal = mgr.backend.limits
            mgr.backend.limits = starved(normal) if key == "fuel" else normal
            admitted = mgr.admit(spec(key), mgr.fingerprint, len(hf), wait_s=60)
            mgr.backend.limits = normal
            assert admitted.status == "ready", admitted.message
    yield made
    for mgr in made:
        mgr.shutdown()
    lanes_off.undo()


@dataclass
class Request:
    """One request stepped along its answer (committed up to ``at``), drafting ahead."""

    rid: str
    key: str
    tokens: list[int]
    at: int
    drafts: int  # draft rows per step
    marker: bool

    def next_drafts(self, mgr: StructuredOutputManager, step: int) -> list[int]:
        """The answer's next tokens; every third step the last one is a token the grammar
        rejects or, on free keys, the drafts would repeat a key."""
        drafts = self.tokens[self.at : self.at + self.drafts]
        if drafts and step % 3 == 1:
            bad = '"a":9' if self.key in ("open", "only-a") else "}}x"
            drafts = drafts[:-1] + mgr.backend.tokenize_bytes(bad.encode())
        return drafts


def requests(mgr: StructuredOutputManager, count: int) -> list[Request]:
    """``count`` requests over every schema, at spread positions; some reason first."""
    eos = mgr.backend.stop_token_ids[0]
    made = []
    for i in range(count):
        key = list(SCHEMAS)[i % len(SCHEMAS)]
        marker = i % 5 == 2
        text = ("Let me think.\n</think>\n" if marker else "") + ANSWERS[key]
        tokens = mgr.backend.tokenize_bytes(text.encode()) + [eos]
        at = 0 if key == "fuel" else (i * 7) % len(tokens)  # fuel: fails on its first mask
        drafts = 0 if i % 4 == 0 else 1 + i % 3
        made.append(Request(f"r{i}", key, tokens, at, drafts, marker))
    return made


def bind(mgr: StructuredOutputManager, request: Request) -> None:
    marker = MARKER if request.marker else None
    assert mgr.prepare(request.rid, spec(request.key, marker)).status == "ready"
    mgr.commit(request.rid, request.tokens[: request.at])  # may fail: a failed request


def raw_differs(mgr: StructuredOutputManager, rid: str, row: torch.Tensor) -> bool:
    """Whether the manager's row differs from llguidance's own mask (a post-filter acted)."""
    state = mgr.state(rid)
    if not state.active or state.error is not None or state.matcher.is_stopped():
        return False
    raw = torch.zeros((1, row.numel()), dtype=torch.int32)
    fill_next_token_bitmask(state.matcher, raw, 0)
    return not torch.equal(raw[0], row)


def test_parallel_fill_is_bit_identical_to_serial(managers) -> None:
    """60 requests stepped 24 times on both managers: the same rows, errors and commits."""
    parallel, serial = managers
    assert parallel.threads == 4 and parallel.mask_executor is not None
    assert serial.threads == 1 and serial.mask_executor is None
    reqs = requests(parallel, 60)
    for mgr in managers:
        for r in reqs:
            bind(mgr, r)
    words = num_mask_words(parallel.lm_head_size)
    capacity = sum(1 + r.drafts + 4 for r in reqs)
    rows = [torch.empty((capacity, words), dtype=torch.int32) for _ in managers]
    filtered, errors = 0, set()
    try:
        for step in range(STEPS):
            batch = [(r.rid, r.next_drafts(parallel, step)) for r in reqs]
            rows[0].fill_(-1)  # different garbage on each side: every row must be written
            rows[1].fill_(0x5A5A5A5A)
            filled = [
                mgr.fill_masks(buffer, batch) for mgr, buffer in zip(managers, rows, strict=True)
            ]
            assert filled[0] == filled[1] == len(batch) + sum(len(d) for _, d in batch)
            assert torch.equal(rows[0][: filled[0]], rows[1][: filled[0]]), step
            assert [parallel.error(r.rid) for r in reqs] == [serial.error(r.rid) for r in reqs]
            first = 0
            for r, (_, drafts) in zip(reqs, batch, strict=True):
                if r.key != "fuel":  # a starved matcher's mask may differ when computed again
                    filtered += raw_differs(parallel, r.rid, rows[0][first])
                first += 1 + len(drafts)
            errors |= {parallel.error(r.rid) for r in reqs} - {None}
            # A decode step commits one token a request; some accept a draft too (two tokens).
            updates = [
                (r.rid, r.tokens[r.at : r.at + 1 + (i % 7 == step % 7)]) for i, r in enumerate(reqs)
            ]
            parallel.commit_many(updates)
            for (rid, tokens), r in zip(updates, reqs, strict=True):
                assert serial.commit(rid, tokens) == (parallel.error(rid) is None)
                r.at += len(tokens)
    finally:
        for mgr in managers:
            for r in reqs:
                mgr.release(r.rid)
    assert filtered > 0  # the repeated-key filter acted on rows of the parallel fill
    assert any("grammar failure" in e for e in errors)  # a matcher failed computing its mask
    assert any("repeats an object key" in e for e in errors)
    assert parallel.num_live_states == serial.num_live_states == 0


def test_failures_while_masking(managers) -> None:
    """A matcher failing on its mask and a state whose every continuation repeats a key: the
    stop mask and the error, on both paths; the other requests' rows are unaffected."""
    for mgr in managers:
        stop = mgr.masks["stop"]
        plan = [("fuel", ""), ("only-a", '{"a":1,"a'), ("open", '{"a":1,"'), ("fuel", "")]
        for i, (key, text) in enumerate(plan):
            assert mgr.prepare(f"f{i}", spec(key)).status == "ready"
            assert mgr.commit(f"f{i}", mgr.backend.tokenize_bytes(text.encode()))
        rows = torch.zeros((4, num_mask_words(mgr.lm_head_size)), dtype=torch.int32)
        try:
            assert mgr.fill_masks(rows, [(f"f{i}", []) for i in range(4)]) == 4
            for failed in (0, 1, 3):
                assert torch.equal(rows[failed], stop), failed
            assert "grammar failure" in mgr.error("f0") and "grammar failure" in mgr.error("f3")
            assert "repeats an object key" in mgr.error("f1")
            assert mgr.error("f2") is None and not torch.equal(rows[2], stop)
        finally:
            for i in range(4):
                mgr.release(f"f{i}")


def test_a_request_listed_twice(managers) -> None:
    """The executor refuses one matcher twice in a call; the rows are then filled (and the
    tokens committed, in order) one by one, as the serial path does."""
    filled = []
    for mgr in managers:
        assert mgr.prepare("twice", spec("open")).status == "ready"
        first, *rest = mgr.backend.tokenize_bytes(b'{"a":1,"')
        mgr.commit_many([("twice", [first]), ("twice", rest)])  # in order: "{" first
        rows = torch.zeros((3, num_mask_words(mgr.lm_head_size)), dtype=torch.int32)
        try:
            assert mgr.error("twice") is None
            assert mgr.fill_masks(rows, [("twice", []), ("twice", [])]) == 2
        finally:
            mgr.release("twice")
        filled.append(rows)
    assert torch.equal(filled[0], filled[1]) and torch.equal(filled[0][0], filled[0][1])


def test_commit_many_with_nothing_for_the_executor(managers) -> None:
    """Steps without a one-token commit of a bound request: nothing, unknown requests, several
    tokens at once (these commit one by one)."""
    parallel, _ = managers
    parallel.commit_many([])
    parallel.commit_many([("never-bound", [1])])
    assert parallel.prepare("multi", spec("ints")).status == "ready"
    try:
        eos = parallel.backend.stop_token_ids[0]
        parallel.commit_many([("multi", parallel.backend.tokenize_bytes(b"[1, 2"))])
        parallel.commit_many([("multi", parallel.backend.tokenize_bytes(b"]") + [eos])])
        assert parallel.error("multi") is None and parallel.state("multi").finished
    finally:
        parallel.release("multi")


def test_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least one"):
        StructuredOutputManager(None, vocab_size=8, threads=0)


def test_worker_passes_the_configured_threads(smollm2_dir) -> None:
    from transformers import AutoConfig

    from atom.config import EngineConfig
    from atom.structured_output.worker import StructuredOutputWorker

    config = EngineConfig(model=str(smollm2_dir), structured_output_threads=3)
    model = SimpleNamespace(lm_head=SimpleNamespace(org_vocab_size=49152))
    hf_config = AutoConfig.from_pretrained(smollm2_dir)
    worker = StructuredOutputWorker(config, smollm2_dir, hf_config, model, torch.device("cpu"), 0)
    worker._initialize()  # what the background initialization thread runs
    try:
        assert worker.manager is not None and worker.manager.threads == 3
    finally:
        worker.shutdown()
