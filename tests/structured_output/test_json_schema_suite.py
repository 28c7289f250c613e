"""JSON Schema Test Suite (draft 2020-12) against the preflight, llguidance and final validator.

Every group is either rejected by the preflight/compiler with a clear message or compiled; for a
compiled group no invalid instance may be a success (the grammar or the final validator rejects
it) and the final validator agrees with the suite. Per-group outcomes are ratcheted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("re2")

from atom.structured_output.backend_guidance import JSON_OPTIONS as COMPILE_OPTIONS  # noqa: E402
from atom.structured_output.json_validator import re2_validator  # noqa: E402
from atom.structured_output.schema import SchemaError, prepare_schema  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT.parent / "shared" / "data" / "json-schema-test-suite" / "draft2020-12"
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


def run_group(group: dict, tokenizer) -> dict:
    """Outcome of one suite group; ``problems`` lists every unsafe or disagreeing instance."""
    from llguidance import LLMatcher

    try:
        prepared = prepare_schema(group["schema"])
    except SchemaError as exc:
        assert exc.message and exc.pointer is not None
        return {"outcome": "rejected", "reason": exc.message}
    grammar = LLMatcher.grammar_from_json_schema(prepared.lowered, overrides=COMPILE_OPTIONS)
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        return {"outcome": "rejected", "reason": "llguidance: " + error.splitlines()[0][:120]}
    validator = re2_validator(group["schema"])
    problems, format_asserted = [], 0
    for test in group["tests"]:
        text = json.dumps(test["data"], ensure_ascii=False, separators=(",", ":"))
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        grammar_ok = matcher.consume_tokens(tokenizer.tokenize_bytes(text.encode())) and (
            matcher.is_accepting()
        )
        final_ok = validator.is_valid(test["data"])
        if grammar_ok and final_ok and not test["valid"]:
            problems.append(f"INVALID SUCCESS: {test['description']}")
        elif final_ok != test["valid"]:
            # Formats are asserted on purpose (the suite treats them as annotations).
            if test["valid"] and _uses_format(group["schema"]):
                format_asserted += 1
            else:
                problems.append(f"validator disagrees: {test['description']}")
    return {"outcome": "compiled", "problems": problems, "format_asserted": format_asserted}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    if not SUITE.is_dir():
        pytest.skip(f"JSON Schema Test Suite not found at {SUITE}")
    tokenizer = byte_tokenizer()
    result = {}
    for path in sorted(SUITE.glob("*.json")):
        for index, group in enumerate(json.loads(path.read_text())):
            outcome = run_group(group, tokenizer)
            outcome["description"] = group["description"]
            outcome["instances"] = len(group["tests"])
            result[f"{path.stem}/{index}"] = outcome
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
    compiled = sum(o["outcome"] == "compiled" for o in outcomes.values())
    return {
        "suite": "json-schema-test-suite draft2020-12 (44401e0)",
        "summary": {
            "groups": len(outcomes),
            "compiled": compiled,
            "rejected": len(outcomes) - compiled,
        },
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
