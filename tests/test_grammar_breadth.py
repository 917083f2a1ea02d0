"""Breadth of grammar-constrained decoding beyond test_grammar.py: JSON schemas built in Python
(boolean schemas with a whitespace style, non-finite numbers, cyclic dicts, numpy scalars), a
grammar that is complete exactly at max_tokens on a model without an EOS id, and a sweep of
schema keywords (enum/const, nested objects, prefixItems, formats, exclusive bounds, multipleOf,
anyOf/allOf, $ref, type lists, unicode) whose finished completions must validate with jsonschema."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tinyloop as tl

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from conftest import write_tiny  # noqa: E402
from test_grammar_whitespace import accepts  # noqa: E402


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model(None, backend="cpu", max_seq_len=256)
    yield m
    tl.free_model(m)


# =============================================================================== boolean schemas
@pytest.mark.parametrize("whitespace", ["flexible", "compact", "spaced"])
def test_the_true_schema_is_any_json_under_every_whitespace_style(demo, whitespace):
    """`true` is a valid JSON schema (any value): with compact / spaced it was a ConfigError
    "Expecting object schema to apply options" (llguidance applies the style to an object only)."""
    for schema in (True, "true"):
        g = tl.Grammar.json_schema(schema, whitespace)
        assert accepts(g, demo, '{"a":[1,2]}' if whitespace != "spaced" else '{"a": [1, 2]}')
        assert pickle.loads(pickle.dumps(g)) == g and "true" in repr(g)
    st = tl.GenerateStats()
    text = tl.generate_text(demo, "v = ", tl.GenerateConfig(max_tokens=24, grammar={"json_schema": True,
                                                                                     "whitespace": whitespace}),
                            stats=st)
    if st.stop_reason == tl.StopReason.EOS:
        json.loads(text)


@pytest.mark.parametrize("whitespace", ["flexible", "compact", "spaced"])
def test_the_false_schema_is_refused_as_unsatisfiable(whitespace):
    for schema in (False, "false"):
        with pytest.raises(tl.ConfigError, match="[Uu]nsatisfiable.*false"):
            tl.Grammar.json_schema(schema, whitespace)


# =============================================================================== Python-built schemas
@pytest.mark.parametrize("schema, what", [
    ({"const": float("inf")}, "inf"),
    ({"enum": [float("nan"), 1]}, "nan"),
    ({"type": "number", "maximum": float("-inf")}, "inf"),
    ('{"const": Infinity}', "inf"),                  # Python's json.loads (and so a server) accepts it
    ('{"enum": [NaN, 1]}', "nan"),
])
def test_non_finite_numbers_are_refused(demo, schema, what):
    """JSON has no NaN / Infinity: llguidance turned them into null, so {"const": Infinity} made
    the model write `null` and end with EOS (valid under the grammar, invalid under the schema)."""
    with pytest.raises(tl.ConfigError, match=rf"(?i)not valid JSON.*{what}|{what}.*not valid JSON"):
        tl.Grammar.json_schema(schema)


def test_a_cyclic_schema_is_a_config_error_not_a_crash():
    """A dict that contains itself crashed the interpreter (llguidance's serializer overflowed
    the stack: SIGSEGV). Run in a child process so a crash fails the test instead of the run."""
    code = textwrap.dedent("""
        import tinyloop as tl
        s = {"type": "object"}
        s["properties"] = {"child": s}
        try:
            tl.Grammar.json_schema(s)
        except tl.ConfigError as e:
            print("ConfigError:", e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])
    assert "ConfigError:" in r.stdout and "ircular" in r.stdout, r.stdout


def test_numpy_scalars_and_int_keys_give_a_usable_grammar(demo):
    """Bounds computed with numpy (np.int64, np.float32) and non-string keys were taken by
    llguidance, but the Grammar's repr raised TypeError (json.dumps of the source)."""
    schema = {"type": "object",
              "properties": {"n": {"type": "integer", "minimum": np.int64(2), "maximum": np.int64(5)},
                             "x": {"type": "number", "maximum": np.float32(1.5)},
                             "f": {"enum": list(np.array([1, 2]))}},
              "required": ["n"], "additionalProperties": False}
    g = tl.Grammar.json_schema(schema, "compact")
    assert repr(g).startswith("Grammar.json_schema(") and g.source["properties"]["n"]["maximum"] == 5
    assert pickle.loads(pickle.dumps(g)) == g
    assert accepts(g, demo, '{"n":3,"x":1.5,"f":2}') and not accepts(g, demo, '{"n":6}')
    mixed = tl.Grammar.json_schema({"properties": {1: {"type": "integer"}, "b": {}}})   # sorted in repr
    assert '"1"' in repr(mixed) and mixed.source["properties"]["1"] == {"type": "integer"}
    with pytest.raises(tl.ConfigError, match="not valid JSON"):
        tl.Grammar.json_schema({"enum": [{1, 2}]})


# =============================================================================== ends
@pytest.fixture(scope="module")
def no_eos(tmp_path_factory):
    path = tmp_path_factory.mktemp("breadth") / "m.tinyloop"
    write_tiny(path, vocab_size=300, eos_id=None)
    m = tl.load_model(str(path), max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_complete_at_max_tokens_is_grammar_complete_without_eos(no_eos, temperature):
    """On a model without an EOS id GRAMMAR_COMPLETE is the only sign that the output is finished;
    a grammar complete with the last allowed token was reported MAX_TOKENS ("ran out"), which
    says the output was cut."""
    kw = dict(temperature=temperature, sample_seed=3) if temperature else {}
    g = tl.Grammar.regex("abc")
    for max_tokens in (3, 4):
        st = tl.GenerateStats()
        out = tl.generate(no_eos, [1, 2], tl.GenerateConfig(max_tokens=max_tokens, grammar=g, **kw), stats=st)
        assert bytes(out[2:]) == b"abc" and st.stop_reason == tl.StopReason.GRAMMAR_COMPLETE, st.stop_reason
        stats = []
        lanes = tl.generate_batch(no_eos, [[1, 2], [3]], tl.GenerateConfig(max_tokens=max_tokens, **kw),
                                  grammars=[g, g], stats=stats)
        assert [bytes(x[len(p):]) for x, p in zip(lanes, ([1, 2], [3]))] == [b"abc", b"abc"]
        assert [s.stop_reason for s in stats] == [tl.StopReason.GRAMMAR_COMPLETE] * 2
    st = tl.GenerateStats()
    out = tl.generate(no_eos, [1, 2], tl.GenerateConfig(max_tokens=2, grammar=g, **kw), stats=st)
    assert bytes(out[2:]) == b"ab" and st.stop_reason == tl.StopReason.MAX_TOKENS       # really cut
    st = tl.GenerateStats()      # a grammar that could go on ("a+") is not complete at max_tokens
    out = tl.generate(no_eos, [1, 2], tl.GenerateConfig(max_tokens=3, grammar=tl.Grammar.regex("a+"), **kw),
                      stats=st)
    assert bytes(out[2:]) == b"aaa" and st.stop_reason == tl.StopReason.MAX_TOKENS


# =============================================================================== a schema sweep
SWEEP = [
    {"enum": ["red", "green", "blue"]},
    {"const": {"a": 1, "b": [True, None]}},
    {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string", "maxLength": 3}},
              "required": ["x"], "additionalProperties": False},
        "b": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 3}], "items": False},
    {"type": "string", "minLength": 3, "maxLength": 5},
    {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "email"},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3}]},
    {"oneOf": [{"type": "integer", "maximum": 99}, {"type": "boolean"}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]},
               {"properties": {"b": {"type": "string", "maxLength": 2}}, "required": ["b"]}]},
    {"$defs": {"t": {"type": "object", "properties": {"v": {"type": "integer", "maximum": 9},
                                                      "kids": {"type": "array", "items": {"$ref": "#/$defs/t"},
                                                               "maxItems": 2}},
                     "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/t"},
    {"type": ["string", "null"], "maxLength": 4},
    {"enum": ["café", "日本語", "😀"]},
    {"type": "object", "properties": {"ключ": {"type": "string", "maxLength": 2}}, "required": ["ключ"],
     "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SWEEP, ids=lambda s: json.dumps(s, ensure_ascii=False)[:40])
def test_schema_sweep_completions_validate(demo, schema):
    g = tl.Grammar.json_schema(schema, "compact")
    checker = jsonschema.FormatChecker()
    for prompt in ("data = ", "def f():\n    return "):
        for kw in ({}, dict(temperature=1.2, sample_seed=11)):
            st = tl.GenerateStats()
            text = tl.generate_text(demo, prompt, tl.GenerateConfig(max_tokens=40, grammar=g, **kw), stats=st)
            if st.stop_reason == tl.StopReason.EOS:
                jsonschema.validate(json.loads(text), schema, format_checker=checker)
            else:
                assert st.stop_reason == tl.StopReason.MAX_TOKENS and st.tokens_emitted == 40


@pytest.mark.xfail(strict=False, reason="llguidance 1.9.1: a number range with an exclusive integer lower "
                   "bound N and an upper bound below N + 1 accepts N itself (upstream; TinyLoop cannot fix it)")
def test_exclusive_lower_bound_of_a_fractional_range(demo):
    schema = {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.1}
    assert not accepts(tl.Grammar.json_schema(schema, "compact"), demo, "0")
