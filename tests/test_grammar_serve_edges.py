"""Edges of grammar-constrained decoding and of the HTTP server's response_format handling: a
model's extra_eos_ids never end a grammar-constrained sequence the grammar does not accept; an
OpenAI json_schema wrapper without a schema, response_format fields the type does not read, and
stream_options without stream are 400s, never silently ignored (in-process through ASGI)."""

from __future__ import annotations

import json
import re

import pytest

import tinyloop as tl

pytest.importorskip("llguidance")
pytest.importorskip("fastapi")
pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from conftest import write_tiny  # noqa: E402


# =============================================================================== extra EOS ids
@pytest.fixture(scope="module")
def extra_eos(tmp_path_factory):
    """Raw-byte tokens, eos_id 299 and "\\n" (id 10) as an extra end-of-sequence id."""
    path = tmp_path_factory.mktemp("eos") / "m.tinyloop"
    write_tiny(path, vocab_size=300, eos_id=299, extra_eos_ids=(10,))
    m = tl.load_model(str(path), max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.mark.parametrize("pattern", ["a\nb", "[a\n]{1,6}b", "ab"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_extra_eos_id_never_ends_an_unfinished_grammar(extra_eos, pattern, temperature):
    """An EOS ending is a complete grammar: the text before it matches, with every EOS id the
    model declares (an extra one ends the sequence like eos_id does, so the mask must treat it
    as EOS, not as the bytes "\\n"). "a\\nb" cannot be written without id 10: a dead end."""
    m = extra_eos
    kw = dict(temperature=temperature, sample_seed=5) if temperature else {}
    g = tl.Grammar.regex(pattern)
    st = tl.GenerateStats()
    gen = tl.generate(m, [1, 2], tl.GenerateConfig(max_tokens=20, grammar=g, **kw), stats=st)[2:]
    if st.stop_reason == tl.StopReason.EOS:
        assert gen[-1] in m.cfg.eos_ids and all(t < 256 for t in gen[:-1]), gen
        assert re.fullmatch(pattern, bytes(gen[:-1]).decode()), (pattern, gen)
    else:
        assert st.stop_reason in (tl.StopReason.GRAMMAR_DEAD_END, tl.StopReason.MAX_TOKENS), st.stop_reason
        assert not any(t in m.cfg.eos_ids for t in gen), gen
    if pattern == "a\nb":
        assert st.stop_reason == tl.StopReason.GRAMMAR_DEAD_END and bytes(gen) == b"a"
    elif pattern == "ab":
        assert st.stop_reason == tl.StopReason.EOS and gen == [97, 98, 299]
    # the lockstep batch lanes use the same mask
    lanes = tl.generate_batch(m, [[1, 2], [3]], tl.GenerateConfig(max_tokens=20, **kw), grammars=[g, g])
    for prompt, lane in zip(([1, 2], [3]), lanes):
        gen = lane[len(prompt):]
        if gen and gen[-1] in m.cfg.eos_ids:
            assert re.fullmatch(pattern, bytes(gen[:-1]).decode()), (pattern, gen)


# =============================================================================== the server
@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient
    from tinyloop.serve import ServeConfig, create_app
    app = create_app(ServeConfig(backend="cpu", max_seq_len=160, queue_size=8, max_tokens_default=4))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    app.state.served.close()


def post(client, **body):
    return client.post("/v1/completions", json={"model": "demo", "prompt": "data = ", "temperature": 0,
                                                **body})


def assert_400(r, needle):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and needle in err["message"], err


SCHEMA = {"type": "object",
          "properties": {"user": {"type": "object",
                                  "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
                                                 "age": {"type": "integer", "minimum": 18, "maximum": 99}},
                                  "required": ["name", "age"], "additionalProperties": False},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 3},
                         "score": {"type": "number", "minimum": 0.5, "maximum": 2.5}},
          "required": ["user", "tags", "score"], "additionalProperties": False}


def test_json_schema_wrapper_without_a_schema_is_a_400(client):
    """OpenAI's {"name", "strict"} wrapper with no "schema" was taken as the schema itself (any
    JSON: the constraint silently dropped)."""
    for spec in ({"name": "person"}, {"name": "person", "strict": True}, {"strict": True, "description": "x"}):
        r = post(client, max_tokens=8, response_format={"type": "json_schema", "json_schema": spec})
        assert_400(r, "schema")
    # the wrapper with its schema, streamed: the text is JSON valid under the schema
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": SCHEMA}}
    r = post(client, prompt="person = ", max_tokens=120, stream=True, response_format=fmt)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["stop"]
    jsonschema.validate(json.loads(text), SCHEMA)
    # a bare schema (TinyLoop's shorthand) still works
    r = post(client, max_tokens=12, response_format={"type": "json_schema",
                                                     "json_schema": {"type": "integer", "minimum": 3, "maximum": 7}})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
    assert 3 <= json.loads(r.json()["choices"][0]["text"]) <= 7


@pytest.mark.parametrize("fmt", [
    {"type": "text", "regex": "[0-9]+"},
    {"type": "json_object", "json_schema": {"name": "n", "schema": {"type": "integer"}}},
    {"type": "regex", "regex": "[0-9]+", "lark": "start: /[a-z]+/"},
    {"type": "lark", "lark": "start: /[a-z]+/", "json_schema": {"type": "integer"}},
    {"type": "json_schema", "json_schema": {"type": "integer"}, "regex": "[a-z]+"},
])
def test_response_format_fields_the_type_does_not_read_are_400s(client, fmt):
    """A constraint given under a field its type does not read was silently dropped (a 200 with
    unconstrained or differently constrained text)."""
    assert_400(post(client, max_tokens=4, response_format=fmt), "does not use")


def test_stream_options_without_stream_is_a_400(client):
    """OpenAI refuses stream_options on a non-streamed request; it was silently ignored."""
    r = post(client, max_tokens=2, stream_options={"include_usage": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    r = post(client, max_tokens=2, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and '"usage"' in r.text and r.text.endswith("data: [DONE]\n\n")


# ------------------------------------------------------------------ the engine's own failure
def test_a_grammar_engine_error_is_not_reported_as_a_dead_end():
    """A regex whose repeat count passes llguidance's size limit fails lazily, as the text grows:
    the request ends with GRAMMAR_ERROR and llguidance's message as a RuntimeWarning, not with
    GRAMMAR_DEAD_END (which says the grammar allows nothing more)."""
    m = tl.load_model("demo", backend="cpu", max_seq_len=64)
    try:
        st = tl.GenerateStats()
        with pytest.warns(RuntimeWarning, match="too many expressions"):
            out = tl.generate_text(m, "x = ", tl.GenerateConfig(max_tokens=6, grammar={"regex": "a{1000000}"}),
                                   stats=st)
        assert st.stop_reason == tl.StopReason.GRAMMAR_ERROR and set(out) == {"a"}
        st = tl.GenerateStats()
        assert tl.generate_text(m, "x = ", tl.GenerateConfig(max_tokens=6, grammar={"regex": "a{3}"}),
                                stats=st) == "aaa"
        assert st.stop_reason in (tl.StopReason.EOS, tl.StopReason.GRAMMAR_COMPLETE)
    finally:
        tl.free_model(m)


# ------------------------------------------------------------------ a tokenizer is not kept alive
def test_a_grammar_does_not_keep_a_freed_tokenizer_alive():
    """llguidance's tokenizer is cached per tokenizer (weakly keyed): the cache value must not hold
    the tokenizer itself, or every tokenizer ever used with a grammar lives as long as the process;
    a grammar drops its compiled template for a freed tokenizer at its next use."""
    import gc
    import weakref
    from tinyloop.model.tokenizer import tokenizer_from_embedded
    m = tl.load_model("demo", backend="cpu", max_seq_len=32)
    try:
        emb, V, eos = m.tokenizer.to_embedded(), m.cfg.vocab_size, m.cfg.eos_id
    finally:
        tl.free_model(m)
    g = tl.Grammar.regex("[a-z]+")
    tok = tokenizer_from_embedded(emb)
    g.matcher(tok, V, eos)
    ref = weakref.ref(tok)
    del tok
    gc.collect()
    assert ref() is None
    other = tokenizer_from_embedded(emb)
    g.matcher(other, V, eos)
    assert len(g._templates) == 1
