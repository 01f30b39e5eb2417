"""JSON Schema -> regex, checked against jsonschema both ways on hypothesis-generated schemas:
  - every text the compiled automaton accepts (random walks through it) parses and validates;
  - every instance built to satisfy the schema, written compactly with properties in schema order, is accepted.
"""
from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from minillm import StructuredOutputsParams as S
from minillm.structured.automata import DEAD, DFA, compile_regex
from minillm.structured.json_schema import SchemaError, json_object_regex, schema_to_regex

FORMAT_EXAMPLES = {"date": ["2024-02-28", "1999-12-31"], "date-time": ["2024-01-05T10:20:30Z",
                                                                        "2023-07-31T23:59:59.5+02:00"],
                   "email": ["a.b@example.com", "x_1@mail.co"], "uuid": ["123e4567-e89b-12d3-a456-426614174000"],
                   "time": ["08:00:00Z"], "ipv4": ["192.168.0.1", "8.8.8.8"]}
PATTERNS = [r"[a-z]{2,5}", r"\d{3}-\d{4}", r"(red|green|blue)"]
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text(max_size=4))


def leaf():
    string = st.fixed_dictionaries({"type": st.just("string")}, optional={
        "minLength": st.integers(0, 2), "maxLength": st.integers(2, 5)})
    return st.one_of(
        string,
        st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(sorted(FORMAT_EXAMPLES))),
        st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
        st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
                         {"type": ["integer", "null"]}]),
        st.builds(lambda vs: {"enum": vs}, st.lists(SCALAR, min_size=1, max_size=3, unique_by=json.dumps)),
        st.builds(lambda v: {"const": v}, SCALAR),
    )


def containers(children):
    obj = st.builds(
        lambda props, req: {"type": "object", "properties": props,
                            "required": [k for k, r in zip(props, req) if r]},
        st.dictionaries(st.sampled_from(["a", "bb", "név", "x y", 'q"t']), children, min_size=1, max_size=3),
        st.lists(st.booleans(), min_size=3, max_size=3))
    arr = st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + extra},
                    children, st.integers(0, 2), st.integers(0, 2))
    any_of = st.builds(lambda a, b: {"anyOf": [a, b]}, children, children)
    return st.one_of(obj, arr, any_of)


SCHEMAS = st.recursive(leaf(), containers, max_leaves=6)


def instance(schema, rnd: random.Random):
    """A value satisfying `schema` (the subset SCHEMAS generates)."""
    if "anyOf" in schema:
        return instance(rnd.choice(schema["anyOf"]), rnd)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rnd.choice(schema["enum"])
    t = schema["type"]
    if isinstance(t, list):
        t = rnd.choice(t)
    if t == "string":
        if "format" in schema:
            return rnd.choice(FORMAT_EXAMPLES[schema["format"]])
        if "pattern" in schema:
            return {PATTERNS[0]: "abc", PATTERNS[1]: "555-1234", PATTERNS[2]: "green"}[schema["pattern"]]
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", 5)
        return "".join(rnd.choice('ab"\\é\n中') for _ in range(rnd.randint(lo, hi)))
    if t == "integer":
        return rnd.randint(-50, 50)
    if t == "number":
        return rnd.choice([0, -3, 2.5, 1e-7, 12345.0])
    if t == "boolean":
        return rnd.random() < 0.5
    if t == "null":
        return None
    if t == "object":
        return {k: instance(v, rnd) for k, v in schema["properties"].items()
                if k in schema["required"] or rnd.random() < 0.5}
    if t == "array":
        return [instance(schema["items"], rnd) for _ in range(rnd.randint(schema["minItems"], schema["maxItems"]))]
    raise AssertionError(schema)


def random_matches(dfa: DFA, rnd: random.Random, n: int, budget: int = 80) -> list[bytes]:
    """n texts the DFA accepts: random byte walks that head for the nearest accepting state once over budget."""
    S_ = dfa.num_states
    dist = np.where(dfa.accepting, 0, 10 ** 9)
    for _ in range(S_):                                    # Bellman-Ford on "bytes to an accepting state"
        nxt = np.where(dfa.transitions == DEAD, 10 ** 9, dist[np.maximum(dfa.transitions, 0)] + 1).min(1)
        new = np.minimum(dist, nxt)
        if (new == dist).all():
            break
        dist = new
    out = []
    for _ in range(n):
        s, text = dfa.start, bytearray()
        while True:
            moves = np.flatnonzero(dfa.transitions[s] != DEAD).tolist()
            if dfa.accepting[s] and (not moves or rnd.random() < 0.15 or len(text) > budget):
                break
            if len(text) > budget:
                moves = [b for b in moves if dist[dfa.transitions[s, b]] < dist[s]]
            b = rnd.choice(moves)
            text.append(b)
            s = int(dfa.transitions[s, b])
        out.append(bytes(text))
    return out


FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.mark.slow    # ~4-7 s: the quick subset stays under 3 minutes
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SCHEMAS, st.randoms(use_true_random=False))
def test_accepted_texts_validate_and_valid_instances_are_accepted(schema, rnd):
    dfa = compile_regex(schema_to_regex(schema))
    for text in random_matches(dfa, rnd, 8):
        value = json.loads(text.decode("utf-8"))
        jsonschema.validate(value, schema, format_checker=FORMATS)
    for _ in range(8):
        value = instance(schema, rnd)
        jsonschema.validate(value, schema, format_checker=FORMATS)         # the generator itself is right
        for sep in ((",", ":"), (", ", ": ")):                              # the default whitespace: 0 or 1 space
            text = json.dumps(value, ensure_ascii=False, separators=sep)
            assert dfa.matches(text), (schema, text)


@settings(max_examples=30, deadline=None)
@given(SCHEMAS, st.randoms(use_true_random=False))
def test_invalid_instances_are_rejected(schema, rnd):
    """A valid instance mutated until jsonschema rejects it must not be accepted either."""
    dfa = compile_regex(schema_to_regex(schema))
    for _ in range(6):
        value = instance(schema, rnd)
        bad = rnd.choice([[value], {"zz": value}, "s" if not isinstance(value, str) else 7, 0.5, None, True])
        if jsonschema.Draft202012Validator(schema, format_checker=FORMATS).is_valid(bad):
            continue
        assert not dfa.matches(json.dumps(bad, separators=(",", ":"))), (schema, bad)


def test_object_properties_keep_schema_order_and_optional_ones_may_go():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"},
                                               "c": {"type": "null"}}, "required": ["b"]}
    dfa = compile_regex(schema_to_regex(schema))
    for text, ok in [('{"b":true}', True), ('{"a":1,"b":false,"c":null}', True), ('{"b":true,"c":null}', True),
                     ('{"a":1,"b":true}', True), ('{"a":1}', False), ('{"b":true,"a":1}', False), ("{}", False),
                     ('{ "a": 1, "b": true }', True), ('{"a":1,  "b":true}', False), ('{"a":1,"b":true,}', False)]:
        assert dfa.matches(text) is ok, text
    all_optional = compile_regex(schema_to_regex({"properties": {"a": {"type": "integer"}}}))
    assert all_optional.matches("{}") and all_optional.matches('{"a":-0}') \
        and all_optional.matches('{"a":01}') is False


def test_refs_defs_and_json_object():
    schema = {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
              "type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 2}
    dfa = compile_regex(schema_to_regex(schema))
    assert dfa.matches('[{"x":1.5},{"x":-2e3}]') and not dfa.matches('[{"x":1},{"x":2},{"x":3}]')
    obj = compile_regex(json_object_regex())
    for text in random_matches(obj, random.Random(0), 30):
        assert isinstance(json.loads(text), dict)
    assert obj.matches('{"a": [1, "x"], "c": {"d": null}}') and not obj.matches("[1]")


@pytest.mark.parametrize("schema, words", [
    ({"type": "integer", "minimum": 0}, "minimum"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "patternProperties": {}}, "patternProperties"),
    ({"type": "string", "format": "hostname"}, "hostname"),
    ({"type": "decimal"}, "unknown type"),
    ({"enum": []}, "non-empty"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "no value"),
    ({"$ref": "#/$defs/nope"}, "points nowhere"),
    ({"$ref": "https://example.com/s.json"}, "local"),
    ({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"}, "recursive"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "single-schema"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "no schema"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True}, "set it to false"),
    ({"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}, "only the listed properties"),
    ({"type": "object", "additionalProperties": 3}, "true, false or a schema"),
    (False, "false"),
    ([1], "object"),
])
def test_unsupported_or_broken_schemas_name_the_problem(schema, words):
    with pytest.raises(SchemaError, match=words):
        schema_to_regex(schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "additionalProperties": False},                  # exactly {}
    {"type": "object", "additionalProperties": {"type": "integer"}},    # any keys, integer values
    {"additionalProperties": {"enum": ["x", None]}},
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "additionalProperties": False},
])
def test_additional_properties_mean_what_json_schema_says(schema):
    """A differential check against jsonschema: what the DFA accepts validates, and valid texts are accepted."""
    dfa = compile_regex(schema_to_regex(schema))
    texts = ["{}", '{"x":1}', '{"x":"s"}', '{"a":true}', '{"x":1,"y":2}', '{"x":null}', '{"x":"x"}', '{"a":1}']
    for text in texts:
        valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        assert dfa.matches(text) is valid, (schema, text)
    for text in random_matches(dfa, random.Random(1), 20):
        jsonschema.validate(json.loads(text), schema)


def test_params_compile_each_mode():
    assert compile_regex(S(choice=["a.b", "c|d"]).to_regex()).matches("c|d")
    assert not compile_regex(S(choice=["a.b"]).to_regex()).matches("axb")
    tight = compile_regex(S(json={"type": "array", "items": {"type": "integer"}}, whitespace_pattern="").to_regex())
    assert tight.matches("[1,2]") and not tight.matches("[1, 2]")
    assert compile_regex(S(json='{"type": "boolean"}').to_regex()).matches("false")
