"""Preflight rules of schema.py: each rejection rule has a case that fails without it, and each
lowering is checked for exactness against the grammar llguidance compiles from it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("re2")

from test_json_schema_suite import COMPILE_OPTIONS, byte_tokenizer  # noqa: E402

from atom.structured_output import json_validator as V  # noqa: E402
from atom.structured_output import regex as R  # noqa: E402
from atom.structured_output import schema as S  # noqa: E402
from atom.structured_output.json_validator import re2_validator  # noqa: E402
from atom.structured_output.regex import compile_re2  # noqa: E402
from atom.structured_output.schema import BudgetError, SchemaError, prepare_schema  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def rejects(schema: object, pointer: str, words: str = "") -> SchemaError:
    with pytest.raises(SchemaError) as info:
        prepare_schema(schema)
    assert info.value.pointer == pointer, info.value
    assert words.lower() in info.value.message.lower(), info.value.message
    assert pointer in str(info.value) and info.value.message in str(info.value)
    return info.value


def accepts(schema: object, value: object, tokenizer) -> bool:
    from llguidance import LLMatcher

    lowered = R.translate_schema_patterns(prepare_schema(schema).lowered)
    grammar = LLMatcher.grammar_from_json_schema(lowered, overrides=COMPILE_OPTIONS)
    assert not LLMatcher.validate_grammar(grammar, tokenizer)
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return (
        matcher.consume_tokens(tokenizer.tokenize_bytes(text.encode())) and matcher.is_accepting()
    )


def assert_exact(schema: object, values: list, tokenizer) -> None:
    """The grammar accepts exactly the instances the (RE2) JSON Schema validator accepts."""
    validator = re2_validator(schema)
    for value in values:
        assert accepts(schema, value, tokenizer) == validator.is_valid(value), value


# -- dialect -------------------------------------------------------------------------------------


def test_dialect_only_2020_12() -> None:
    prepare_schema({"type": "integer"})
    prepare_schema({"$schema": S.DIALECT, "type": "integer"})
    rejects({"$schema": "http://json-schema.org/draft-07/schema#"}, "/$schema", "2020-12")


def test_nested_dialect_cannot_switch() -> None:
    schema = {
        "$ref": "#/$defs/old",
        "$defs": {"old": {"$id": "old", "$schema": "http://json-schema.org/draft-07/schema#"}},
    }
    rejects(schema, "/$defs/old/$schema", "2020-12")


# -- references ----------------------------------------------------------------------------------


def test_local_references(tokenizer) -> None:
    schema = {
        "$defs": {"int": {"type": "integer"}, "named": {"$anchor": "txt", "type": "string"}},
        "properties": {
            "a": {"$ref": "#/$defs/int"},
            "b": {"$ref": "#txt"},
            "c": {"$ref": "inner"},
        },
        "$comment": "an embedded resource",
        "items": {"$id": "inner", "type": "boolean"},
    }
    assert_exact(schema, [{"a": 1, "b": "x", "c": True}, {"a": "x"}, {"b": 1}, {"c": 1}], tokenizer)


def test_pointer_into_literal_const_is_followed_transitively(tokenizer) -> None:
    schema = {
        "$defs": {"lit": {"const": {"$ref": "#/$defs/int"}}, "int": {"type": "integer"}},
        "$ref": "#/$defs/lit/const",
    }
    assert_exact(schema, [1, "x"], tokenizer)


def test_external_reference_rejected_without_retrieval(monkeypatch) -> None:
    calls = []
    refuse = V._refuse
    monkeypatch.setattr(V, "_refuse", lambda uri: calls.append(uri) or refuse(uri))
    rejects({"$ref": "http://localhost:1234/draft2020-12/integer.json"}, "/$ref", "non-local")
    rejects({"properties": {"a": {"$ref": "other.json"}}}, "/properties/a/$ref", "non-local")
    # bundled meta-schemas are not in the registry either (draft-07 would validate with re)
    rejects({"$ref": "http://json-schema.org/draft-07/schema#"}, "/$ref", "non-local")
    assert calls == [
        "http://localhost:1234/draft2020-12/integer.json",
        "other.json",
        "http://json-schema.org/draft-07/schema",
    ]


def test_registry_refuses_retrieval() -> None:
    from referencing.exceptions import NoSuchResource

    registry, _ = V.make_registry({"type": "integer"})
    with pytest.raises(NoSuchResource):
        registry.get_or_retrieve("http://example.com/schema.json")


def test_recursive_reference_kept_for_llguidance(tokenizer) -> None:
    tree = {"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "$ref": "#/$defs/t"}
    lowered = prepare_schema(tree).lowered
    assert "$defs" in lowered and "$ref" in lowered
    assert_exact(tree, [[], [[], [[]]], [1], [[1]]], tokenizer)


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "/$defs/a/$ref"),
        ({"$ref": "#"}, "/$ref"),
        (
            {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {}]}}, "$ref": "#/$defs/a"},
            "/$defs/a/anyOf/0/$ref",
        ),
        ({"properties": {"a": {"$ref": "#"}}, "not": {"$ref": "#"}}, "/not/$ref"),
    ],
)
def test_reference_cycle_without_descent_rejected(schema: dict, pointer: str) -> None:
    rejects(schema, pointer, "cycle")


def test_recursive_reference_cannot_be_negated() -> None:
    tree = {"$defs": {"t": {"type": "array", "items": {"not": {"$ref": "#/$defs/t"}}}}}
    rejects({**tree, "$ref": "#/$defs/t"}, "/$defs/t/items/not", "recursive")


# -- RE2 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["a(?=b)", "(?<!a)b", r"(a)\1"])
def test_lookaround_and_backreference_rejected(pattern: str) -> None:
    rejects({"pattern": pattern}, "/pattern", "unsupported")
    rejects({"patternProperties": {pattern: {}}}, "/patternProperties/" + pattern, "unsupported")
    rejects({"propertyNames": {"pattern": pattern}}, "/propertyNames/pattern", "unsupported")


def test_pattern_length_limit() -> None:
    rejects({"pattern": "a" * (R.MAX_PATTERN_CHARS + 1)}, "/pattern", "longer")


def test_re2_memory_limit() -> None:
    import re2

    options = re2.Options()
    options.max_mem = 64 << 20
    re2.compile(r"\pL{1000}", options)  # fine with more memory
    rejects({"pattern": r"\p{L}{1000}"}, "/pattern", "RE2")


def test_re2_cache_bounded() -> None:
    for i in range(R.RE2_CACHE_SIZE + 8):
        compile_re2(f"^x{i}$")
    assert R._compile_re2.cache_info().currsize <= R.RE2_CACHE_SIZE


def test_ecma_unicode_escape_is_translated() -> None:
    assert R.re2_search(r"^\u0041$", "A")


# -- x-guidance, pathological input --------------------------------------------------------------


def test_x_guidance_rejected() -> None:
    rejects({"x-guidance": {"lenient": True}, "contains": {}}, "/x-guidance", "x-guidance")
    rejects({"x-guidance": {"item_separator": ", "}}, "/x-guidance", "x-guidance")


def test_deep_nesting_is_a_schema_error() -> None:
    deep: object = {}
    for _ in range(3000):
        deep = {"items": deep}
    err = rejects(deep, "/items" * (S.MAX_DEPTH + 1), "deeper")
    assert isinstance(err, SchemaError)


def test_non_json_numbers_rejected() -> None:
    rejects({"const": float("nan")}, "/const", "finite")


# -- keywords llguidance would ignore or cannot enforce --------------------------------------------


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"contains": {"type": "integer"}}, "/contains"),
        ({"$dynamicRef": "#meta"}, "/$dynamicRef"),
        ({"format": "idn-email"}, "/format"),
        ({"anyOf": [{}], "unevaluatedProperties": False}, "/unevaluatedProperties"),
        ({"not": {"pattern": "a"}}, "/not"),
        ({"uniqueItems": True}, "/uniqueItems"),
        ({"uniqueItems": True, "items": {"type": "integer"}}, "/uniqueItems"),
        (
            {
                "propertyNames": {"maxLength": 3},
                "properties": {"a": {}},
                "additionalProperties": {"type": "number"},
            },
            "/propertyNames",
        ),
        ({"not": {"type": "integer"}}, "/not"),
    ],
)
def test_unenforceable_keywords_rejected(schema: dict, pointer: str) -> None:
    rejects(schema, pointer)


def test_annotations_and_unknown_keywords_stripped() -> None:
    schema = {
        "title": "t",
        "additionalItems": False,
        "minContains": 2,
        "then": {"$ref": "http://example.com/ignored-without-if"},
        "contentSchema": {"type": "string"},
        "format": "custom-annotation",
        "type": "array",
    }
    assert prepare_schema(schema).lowered == {"type": "array"}


# -- exact lowerings -----------------------------------------------------------------------------


def test_draft7_dependencies_are_enforced(tokenizer) -> None:
    """Not a 2020-12 keyword, but what a client writing it means: never silently ignored."""
    schema = {"dependencies": {"a": ["b"], "c": {"required": ["d"]}}}
    values = [{}, {"a": 1}, {"a": 1, "b": 2}, {"c": 1}, {"c": 1, "d": 2}, {"b": 1}]
    assert_exact(schema, values, tokenizer)
    assert not re2_validator(schema).is_valid({"a": 1})


def test_numeric_boolean_null_negation(tokenizer) -> None:
    assert_exact({"not": {"minimum": 3}}, [2, 3, 2.5, "x", None], tokenizer)
    assert_exact(
        {"not": {"enum": [1, 2.5, True, None]}},
        [0, 1, 2, 2.5, 3, True, False, None, "1"],
        tokenizer,
    )
    assert_exact({"not": {"type": ["null", "boolean"]}}, [None, True, 0, "a", [], {}], tokenizer)


def test_literal_string_negation(tokenizer) -> None:
    values = ["", "ab", "abc", "abcd", "abd", "x", "ab\n", 1]
    assert_exact({"not": {"const": "abc"}}, values, tokenizer)
    assert_exact({"type": "string", "not": {"enum": ["", "ab"]}}, values, tokenizer)
    rejects({"not": {"const": "x" * (S.MAX_NEGATED_LITERAL + 1)}}, "/not", "longer")
    for text in ["", "a", "ab\n", "\U0001f600é"]:
        assert R.not_string_regex_len(text) == len(R.not_string_regex(text))


def test_array_and_object_literal_negation(tokenizer) -> None:
    values = [[], [1], [1, 2], [1, 3], [1, 2, 3], {}, {"a": 1}, {"a": 2}, {"b": 1}, {"a": [1]}, 1]
    assert_exact({"not": {"enum": [[1, 2], {"a": 1}, 1]}}, values, tokenizer)
    assert_exact({"not": {"const": {"a": [1]}}}, values, tokenizer)


def test_length_cardinality_and_property_negation(tokenizer) -> None:
    assert_exact({"not": {"minLength": 2}}, ["", "a", "ab", 5], tokenizer)
    assert_exact({"not": {"maxItems": 1}}, [[], [1], [1, 2]], tokenizer)
    assert_exact({"not": {"required": ["a"]}}, [{}, {"a": 1}, {"b": 1}, 3], tokenizer)
    assert_exact({"not": {"properties": {"a": False}}}, [{}, {"a": 1}, 3], tokenizer)
    assert_exact(
        {"not": {"properties": {"a": {"type": "string"}}}}, [{}, {"a": 1}, {"a": "s"}], tokenizer
    )


def test_if_then_else_with_complementable_guard(tokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
        "if": {"properties": {"kind": {"const": "big"}}, "required": ["kind"]},
        "then": {"properties": {"n": {"minimum": 100}}},
        "else": {"properties": {"n": {"maximum": 9}}},
    }
    values = [
        {"kind": "big", "n": 100},
        {"kind": "big", "n": 5},
        {"kind": "small", "n": 5},
        {"kind": "small", "n": 100},
        {"n": 5},
        {"n": 50},
    ]
    assert_exact(schema, values, tokenizer)


def test_if_then_else_finite_enumeration(tokenizer) -> None:
    schema = {"enum": ["a", "ab", "abc", 1], "if": {"pattern": "b"}, "then": {"minLength": 3}}
    assert prepare_schema(schema).lowered["allOf"] == [{"enum": ["a", "abc", 1]}]
    assert_exact(schema, ["a", "ab", "abc", 1, "x"], tokenizer)
    rejects({"if": {"pattern": "b"}, "then": {"minLength": 3}}, "/if", "finite")


def test_numeric_interval_llguidance_gets_wrong_is_rejected(tokenizer) -> None:
    rejects({"exclusiveMinimum": 2, "maximum": 2.5}, "", "numeric bounds")
    rejects({"allOf": [{"exclusiveMinimum": 0}, {"exclusiveMaximum": 0.5}]}, "", "numeric bounds")
    rejects({"properties": {"a": {"exclusiveMaximum": -2, "minimum": -2.5}}}, "/properties/a")
    rejects({"not": {"enum": [2, 2.5]}}, "", "numeric bounds")
    assert_exact({"exclusiveMinimum": 2, "maximum": 3.5}, [2, 2.5, 3, 3.5, 4], tokenizer)
    assert_exact({"type": "integer", "exclusiveMinimum": 2, "maximum": 3.5}, [2, 3], tokenizer)


def test_numeric_interval_guard_follows_references(tokenizer) -> None:
    """llguidance merges bounds through $ref too: without the guard, 2 would be accepted."""
    defs = {"$defs": {"low": {"maximum": 2.5}, "wrapped": {"allOf": [{"maximum": 2.5}]}}}
    rejects({"$ref": "#/$defs/low", "exclusiveMinimum": 2, **defs}, "", "numeric bounds")
    rejects({"allOf": [{"exclusiveMinimum": 2}, {"$ref": "#/$defs/low"}], **defs}, "")
    nested = {"properties": {"x": {"$ref": "#/$defs/wrapped", "exclusiveMinimum": 2}}, **defs}
    rejects(nested, "/properties/x", "numeric bounds")
    assert_exact(
        {"$ref": "#/$defs/up", "exclusiveMinimum": 2, "$defs": {"up": {"maximum": 3.5}}},
        [2, 2.5, 3, 3.5, 4],
        tokenizer,
    )


def test_all_of_and_multiple_of_compiled(tokenizer) -> None:
    schema = {"allOf": [{"type": "integer", "multipleOf": 3}, {"minimum": 0, "maximum": 10}]}
    assert_exact(schema, [0, 3, 4, 9, 12, -3], tokenizer)


def test_dependent_required_and_schemas(tokenizer) -> None:
    schema = {"dependentRequired": {"a": ["b"]}, "dependentSchemas": {"c": {"required": ["d"]}}}
    values = [{}, {"a": 1}, {"a": 1, "b": 2}, {"c": 1}, {"c": 1, "d": 2}, 5]
    assert_exact(schema, values, tokenizer)


def test_one_of_lowered_when_complementable(tokenizer) -> None:
    schema = {"oneOf": [{"minimum": 2}, {"maximum": 5}]}
    assert_exact(schema, [1, 2, 5, 6, "x"], tokenizer)


def test_one_of_with_disjoint_branches_is_any_of(tokenizer) -> None:
    """Provably disjoint branches (types, finite domains, a required discriminator) make oneOf
    an anyOf of the input branches: exact, nothing generated, no complements needed."""
    finite = {"oneOf": [{"oneOf": [{"enum": ["a", "b"]}, {"enum": ["c"]}]}, {"enum": ["d"]}]}
    assert prepare_schema(finite).lowered == {
        "anyOf": [{"anyOf": [{"enum": ["a", "b"]}, {"enum": ["c"]}]}, {"enum": ["d"]}]
    }
    assert_exact(finite, ["a", "c", "d", "e", 1], tokenizer)
    tagged = {
        "oneOf": [
            {"type": "object", "required": ["k", "v"], "properties": {"k": {"const": "x"}}},
            {"type": "object", "required": ["k"], "properties": {"k": {"const": "y"}}},
        ]
    }
    assert "anyOf" in prepare_schema(tagged).lowered
    assert_exact(tagged, [{"k": "x", "v": 1}, {"k": "x"}, {"k": "y"}, {"k": "z"}, 3], tokenizer)
    by_type = {"oneOf": [{"type": "string", "pattern": "^a"}, {"type": "integer"}]}
    assert_exact(by_type, ["ab", "b", 3, 2.5, None], tokenizer)
    # Not disjoint: a non-object satisfies both (required applies to objects only).
    untyped = {"oneOf": [{"required": ["k"]}, {"required": ["j"]}]}
    assert "anyOf" not in prepare_schema(untyped).lowered
    assert_exact(untyped, [{"k": 1}, {"j": 1}, {"k": 1, "j": 2}, {}, 5], tokenizer)


def test_unique_items_finite_domains(tokenizer) -> None:
    schema = {
        "type": "array",
        "prefixItems": [{"enum": ["x", 1]}],
        "items": {"enum": [1, 2]},
        "uniqueItems": True,
    }
    values = [[], ["x"], ["x", 1, 2], [1, 2], [1, 1], ["x", 2, 2], [2], ["x", 1, 2, 1]]
    assert_exact(schema, values, tokenizer)


def test_contains_over_bounded_arrays(tokenizer) -> None:
    values = [[], [1], [5], [1, 5], [5, 5], [5, 1, 5], [1, 1, 1], [5, 5, 5], "x"]
    assert_exact({"contains": {"minimum": 5}, "maxItems": 3}, values, tokenizer)
    assert_exact({"contains": {"minimum": 5}, "minContains": 2, "maxItems": 3}, values, tokenizer)
    bounded = {
        "contains": {"minimum": 5},
        "maxContains": 1,
        "prefixItems": [{}] * 3,
        "items": False,
    }
    assert_exact(bounded, values, tokenizer)
    rejects({"contains": {"minimum": 5}}, "/contains", "bounded")
    with pytest.raises(BudgetError):
        prepare_schema({"contains": {"minimum": 5}, "minContains": 10**9, "maxItems": 10**9})


def test_unevaluated_properties_through_all_of_and_ref(tokenizer) -> None:
    schema = {
        "$defs": {"base": {"properties": {"b": {"type": "integer"}}}},
        "$ref": "#/$defs/base",
        "allOf": [{"properties": {"c": True}}],
        "properties": {"a": True},
        "unevaluatedProperties": {"type": "string"},
    }
    values = [{"a": 1}, {"b": 1}, {"c": 1}, {"d": "x"}, {"d": 1}, {"b": "x"}]
    assert_exact(schema, values, tokenizer)
    opened = {"allOf": [{"additionalProperties": True}], "unevaluatedProperties": False}
    assert_exact(opened, [{"x": 1}], tokenizer)
    nested = {"allOf": [{"patternProperties": {"^a": {}}}], "unevaluatedProperties": False}
    rejects(nested, "/unevaluatedProperties", "patternProperties")


def test_double_negation(tokenizer) -> None:
    assert_exact({"not": {"not": {"pattern": "^a"}}}, ["a", "b", 1], tokenizer)


def test_property_names_lowerings(tokenizer) -> None:
    assert_exact({"propertyNames": {"enum": ["a", "b"]}}, [{}, {"a": 1}, {"c": 1}], tokenizer)
    assert_exact({"propertyNames": {"maxLength": 1}}, [{"a": 1}, {"ab": 1}], tokenizer)
    assert_exact({"propertyNames": {"pattern": "^x"}}, [{"xa": 1}, {"ax": 1}], tokenizer)
    numbers = {"propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "number"}}
    assert_exact(numbers, [{"ab": 1}, {"abc": 1}, {"ab": "x"}], tokenizer)


# -- budget --------------------------------------------------------------------------------------


def _dependent(count: int, prefix: str = "k") -> dict:
    return {"dependentRequired": {f"{prefix}{i}": ["z"] for i in range(count)}}


def test_entry_budget_exhausted() -> None:
    prepare_schema(_dependent(S.BUDGET_ENTRIES // 2))
    with pytest.raises(BudgetError) as info:
        prepare_schema(_dependent(S.BUDGET_ENTRIES // 2 + 1))
    assert info.value.pointer.startswith("/dependentRequired/")


def test_budget_shared_by_siblings_and_nested() -> None:
    half = _dependent(S.BUDGET_ENTRIES // 4)
    prepare_schema({"properties": {"a": half, "b": half}})
    with pytest.raises(BudgetError):
        prepare_schema({"properties": {"a": half, "b": half, "c": {"items": half}}})


def test_input_branches_not_charged() -> None:
    prepare_schema({"anyOf": [{"const": i} for i in range(S.BUDGET_ENTRIES * 2)]})


def test_evaluation_budget_exhausted() -> None:
    schema = {
        "type": "array",
        "items": {"enum": list(range(80))},
        "maxItems": 2,
        "uniqueItems": True,
    }
    with pytest.raises(BudgetError, match="budget"):
        prepare_schema(schema)


def test_regex_budget_exhausted() -> None:
    words = [f"w{i:03d}" + "x" * 250 for i in range(80)]
    with pytest.raises(BudgetError, match="regex"):
        prepare_schema({"not": {"enum": words}})


def test_exhaustion_never_falls_back_to_enumeration() -> None:
    spent = _dependent(S.BUDGET_ENTRIES // 2 - 1)
    schema = {**spent, "enum": [1, 2, 3], "if": {"minimum": 2}, "then": {"maximum": 2}}
    with pytest.raises(BudgetError):
        prepare_schema(schema)
    prepare_schema({"enum": [1, 2, 3], "if": {"minimum": 2}, "then": {"maximum": 2}})


def test_key_is_stable_and_content_addressed() -> None:
    a = prepare_schema({"type": "integer", "title": "x"})
    b = prepare_schema({"title": "y", "type": "integer"})
    assert a.key == b.key and len(a.key) == 64
    assert a.key != prepare_schema({"type": "string"}).key


def test_complement_budget_is_reserved_before_building(monkeypatch) -> None:
    """Each branch of a complement is charged before it is built: with members worth two entries
    each (the member's branch and its bound's), the budget pays for half as many members and the
    next member's complement is never built."""
    calls = []
    original = S._Lowerer.negate
    monkeypatch.setattr(
        S._Lowerer, "negate", lambda self, *a: calls.append(1) or original(self, *a)
    )
    members = [{"minimum": i} for i in range(S.BUDGET_ENTRIES)]
    with pytest.raises(BudgetError):
        prepare_schema({"type": "number", "not": {"allOf": members}})
    assert len(calls) == 1 + S.BUDGET_ENTRIES // 2
    with pytest.raises(BudgetError):
        prepare_schema({"type": "object", "not": {"required": [f"p{i}" for i in range(300)]}})


def test_a_member_without_complement_falls_back_before_the_budget_is_spent() -> None:
    """``not allOf`` of 300 patterns over a finite domain: the first pattern has no complement,
    so the finite enumeration applies instead of a budget error."""
    patterns = [{"pattern": f"^v[0-9]$|z{i}"} for i in range(300)]
    lowered = prepare_schema({"enum": ["v1", "w"], "not": {"allOf": patterns}}).lowered
    assert lowered["allOf"] == [{"enum": ["w"]}]


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"type": "integer", "minimum": 2**63 - 2}, "/minimum"),
        ({"type": "integer", "exclusiveMinimum": 2**63 - 2}, "/exclusiveMinimum"),
        ({"type": "integer", "maximum": -(2**63) + 1}, "/maximum"),
        ({"properties": {"n": {"type": "number", "minimum": 1.5e19}}}, "/properties/n/minimum"),
        ({"maximum": 1.5e19}, "/maximum"),  # untyped bounds are float ranges
        ({"type": "number", "multipleOf": 0.123456789}, "/multipleOf"),
        ({"type": "integer", "multipleOf": 4294967296}, "/multipleOf"),
        (
            {"anyOf": [{"type": "integer"}, {"type": "number", "multipleOf": 1e-15}]},
            "/anyOf/1/multipleOf",
        ),
    ],
)
def test_bounds_the_grammar_compiler_cannot_build_are_refused_with_a_pointer(schema, pointer):
    # Was: accepted here, then refused by the compile on the ranks without a pointer.
    rejects(schema, pointer, "cannot be enforced by the grammar compiler")


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "maximum": 2**64 - 1},
        {"type": "integer", "minimum": -(2**62), "maximum": 2**62},
        {"type": "number", "multipleOf": 0.01, "minimum": 0.28, "maximum": 0.3},
        {"type": "number", "multipleOf": 4294967295},
        {"type": "number", "maximum": 1e-300, "minimum": 0},
    ],
)
def test_bounds_the_grammar_compiler_builds_are_accepted(schema):
    prepare_schema(schema)
