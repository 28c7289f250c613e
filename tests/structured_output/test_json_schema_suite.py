"""JSON Schema Test Suite (draft 2020-12, required and optional groups) against the preflight,
llguidance and the final validator.

Every group is either rejected by the preflight/compiler with a clear message or compiled; for a
compiled group no invalid instance may be a success (the grammar or the final validator rejects
it) and the final validator agrees with the suite on every instance. The one tolerated
disagreement: required groups treat ``format`` as an annotation, and we assert formats on
purpose (the ``optional/format`` groups check the assertions). Instances are given as JSON text
with their numbers exactly as the suite writes them. Per-group outcomes are ratcheted.
"""

from __future__ import annotations

import json
import os
from decimal import Decimal
from pathlib import Path

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("re2")

from atom.structured_output.answer import answer_error  # noqa: E402
from atom.structured_output.backend_guidance import JSON_OPTIONS as COMPILE_OPTIONS  # noqa: E402
from atom.structured_output.regex import translate_schema_patterns  # noqa: E402
from atom.structured_output.schema import SchemaError, prepare_schema  # noqa: E402

SUITE = Path(__file__).resolve().parents[1] / "data" / "json-schema-test-suite" / "draft2020-12"
RATCHET = Path(__file__).with_name("json_schema_suite_ratchet.json")
UPDATE_ENV = "ATOM_UPDATE_SCHEMA_RATCHET"


def byte_tokenizer():
    """One token per byte plus EOS: feeding an instance byte by byte tests the grammar exactly."""
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    class Bytes:
        eos_token_id = 256
        bos_token_id = None
        tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        special_token_ids = [256]

        def __call__(self, text: bytes | str) -> list[int]:
            return list(text if isinstance(text, bytes) else text.encode())

    return llguidance.LLTokenizer(TokenizerWrapper(Bytes()))


def _uses_format(node: object) -> bool:
    if isinstance(node, dict):
        return "format" in node or any(_uses_format(v) for v in node.values())
    if isinstance(node, list):
        return any(_uses_format(v) for v in node)
    return False


def json_text(value: object) -> str:
    """Compact JSON of a value whose numbers are ``Decimal`` (the suite's exact digits)."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(json_text(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{json.dumps(k, ensure_ascii=False)}:{json_text(v)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    return json.dumps(value, ensure_ascii=False)


def run_group(group: dict, texts: list[str], tokenizer, optional: bool) -> dict:
    """Outcome of one suite group; ``problems`` lists every unsafe or disagreeing instance.
    ``texts`` are the instances as JSON text."""
    from llguidance import LLMatcher

    try:
        prepared = prepare_schema(group["schema"])
    except SchemaError as exc:
        assert exc.message and exc.pointer is not None
        return {"outcome": "rejected", "reason": exc.message}
    lowered = translate_schema_patterns(prepared.lowered)  # as GuidanceBackend.grammar() does
    grammar = LLMatcher.grammar_from_json_schema(lowered, overrides=COMPILE_OPTIONS)
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        return {"outcome": "rejected", "reason": "llguidance: " + error.splitlines()[0][:120]}
    problems, format_asserted = [], 0
    for test, text in zip(group["tests"], texts, strict=True):
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        grammar_ok = matcher.consume_tokens(tokenizer.tokenize_bytes(text.encode())) and (
            matcher.is_accepting()
        )
        final_ok = answer_error("json_schema", group["schema"], text) is None
        if grammar_ok and final_ok and not test["valid"]:
            problems.append(f"INVALID SUCCESS: {test['description']}")
        elif final_ok != test["valid"]:
            if test["valid"] and not optional and _uses_format(group["schema"]):
                format_asserted += 1
            else:
                problems.append(f"validator disagrees: {test['description']}")
    return {"outcome": "compiled", "problems": problems, "format_asserted": format_asserted}


def suite_files() -> list[Path]:
    return sorted(SUITE.glob("*.json")) + sorted(SUITE.glob("optional/**/*.json"))


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    assert SUITE.is_dir(), f"the vendored JSON Schema Test Suite is missing at {SUITE}"
    tokenizer = byte_tokenizer()
    result = {}
    for path in suite_files():
        name = path.relative_to(SUITE).with_suffix("").as_posix()
        exact = json.loads(path.read_text(), parse_float=Decimal)
        for index, group in enumerate(json.loads(path.read_text())):
            texts = [json_text(t["data"]) for t in exact[index]["tests"]]
            outcome = run_group(group, texts, tokenizer, name.startswith("optional/"))
            outcome["description"] = group["description"]
            outcome["instances"] = len(group["tests"])
            result[f"{name}/{index}"] = outcome
    return result


def test_no_invalid_success_and_validator_agrees(outcomes: dict[str, dict]) -> None:
    problems = {gid: o["problems"] for gid, o in outcomes.items() if o.get("problems")}
    assert not problems, json.dumps(problems, indent=1)


def test_rejections_are_clear(outcomes: dict[str, dict]) -> None:
    for gid, o in outcomes.items():
        if o["outcome"] == "rejected":
            assert o["reason"].strip(), gid


def _ratchet_view(outcomes: dict[str, dict]) -> dict:
    groups = {
        gid: {
            "description": o["description"],
            "outcome": o["outcome"],
            "instances": o["instances"],
            **({"reason": o["reason"]} if o["outcome"] == "rejected" else {}),
            **({"format_asserted": o["format_asserted"]} if o.get("format_asserted") else {}),
        }
        for gid, o in outcomes.items()
    }

    def summary(ids: list[str]) -> dict:
        compiled = sum(outcomes[gid]["outcome"] == "compiled" for gid in ids)
        return {"groups": len(ids), "compiled": compiled, "rejected": len(ids) - compiled}

    optional = [gid for gid in outcomes if gid.startswith("optional/")]
    required = [gid for gid in outcomes if not gid.startswith("optional/")]
    return {
        "suite": "json-schema-test-suite draft2020-12 (44401e0), required and optional groups",
        "summary": {"required": summary(required), "optional": summary(optional)},
        "groups": groups,
    }


def test_ratchet(outcomes: dict[str, dict]) -> None:
    """Compiled groups stay compiled; improvements are reported with the update command."""
    current = _ratchet_view(outcomes)
    if os.environ.get(UPDATE_ENV) == "1":
        RATCHET.write_text(json.dumps(current, indent=1, ensure_ascii=False) + "\n")
        return
    assert RATCHET.exists(), f"no ratchet file; create it with {UPDATE_ENV}=1"
    recorded = json.loads(RATCHET.read_text())["groups"]
    regressed = [
        gid
        for gid, old in recorded.items()
        if old["outcome"] == "compiled"
        and current["groups"].get(gid, {}).get("outcome") != "compiled"
    ]
    assert not regressed, f"groups no longer compile: {regressed}"
    improved = [
        gid
        for gid, new in current["groups"].items()
        if new["outcome"] == "compiled" and recorded.get(gid, {}).get("outcome") != "compiled"
    ]
    if improved:
        print(
            f"\n{len(improved)} suite group(s) now compile: {improved}\nrecord them with: "
            f"{UPDATE_ENV}=1 pytest tests/structured_output/test_json_schema_suite.py"
        )
