"""The JSON grammars' whitespace styles (Grammar.json_schema / Grammar.json ``whitespace=``, the
mapping form, run configs, the server's response_format): what each style accepts, checked with
llguidance's own matcher on texts built here, and what the demo model generates under it, checked
by a JSON scanner written here and by jsonschema."""

from __future__ import annotations

import json
import pickle

import pytest

import tinyloop as tl

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model(None, backend="cpu", max_seq_len=256)
    yield m
    tl.free_model(m)


def accepts(grammar, m, text):
    """llguidance's matcher for `grammar` takes the whole of `text`'s tokens and may stop there."""
    mt = grammar.matcher(m.tokenizer, m.cfg.vocab_size, m.cfg.eos_id)
    ids = list(m.tokenizer.encode(text))
    return mt.try_consume_tokens(ids) == len(ids) and not mt.is_error() and mt.is_accepting()


def separators_outside_strings(text):
    """The runs of whitespace outside JSON strings, each with the character before it."""
    out, in_str, esc, i = [], False, False, 0
    while i < len(text):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
            i += 1
            continue
        if c == '"':
            in_str = True
            i += 1
            continue
        if c in " \t\r\n":
            j = i
            while j < len(text) and text[j] in " \t\r\n":
                j += 1
            out.append((text[i - 1] if i else "", text[i:j]))
            i = j
            continue
        i += 1
    return out


def test_what_each_style_accepts(demo):
    texts = {"compact": '{"name":"Al","age":3,"tags":[1,2]}',
             "spaced": '{"name": "Al", "age": 3, "tags": [1, 2]}',
             "pretty": '{\n  "name": "Al",\n  "age": 3,\n  "tags": [1, 2]\n}',
             "loose": '{ "name" : "Al" , "age":3,"tags":[ 1,2 ] }'}
    want = {"flexible": {"compact", "spaced", "pretty", "loose"}, "compact": {"compact"}, "spaced": {"spaced"}}
    for style, ok in want.items():
        g = tl.Grammar.json_schema(SCHEMA, whitespace=style)
        assert g.whitespace == style
        for name, text in texts.items():
            assert json.loads(text)                       # every text is JSON valid under the schema
            jsonschema.validate(json.loads(text), SCHEMA)
            assert accepts(g, demo, text) == (name in ok), (style, name)
    # any JSON value, the same styles
    for style, ok, bad in [("compact", "[1,{\"a\":null}]", "[1, {\"a\": null}]"),
                           ("spaced", "[1, {\"a\": null}]", "[1,{\"a\":null}]")]:
        g = tl.Grammar.json(whitespace=style)
        assert accepts(g, demo, ok) and not accepts(g, demo, bad)
    # the strings themselves keep their spaces
    assert accepts(tl.Grammar.json_schema(SCHEMA, "compact"), demo, '{"name":"A l  ","age":3,"tags":[]}')


def test_flexible_is_the_default_and_unchanged():
    import llguidance as llg
    g = tl.Grammar.json_schema(SCHEMA)
    assert g == tl.Grammar.json_schema(SCHEMA, "flexible") and hash(g) == hash(tl.Grammar.json_schema(SCHEMA))
    assert g._ll == llg.LLMatcher.grammar_from_json_schema(SCHEMA)          # llguidance's own default
    assert tl.Grammar.json()._ll == llg.LLMatcher.grammar_from_json_schema({})
    assert g != tl.Grammar.json_schema(SCHEMA, "compact") != tl.Grammar.json_schema(SCHEMA, "spaced")
    assert tl.Grammar.regex("[0-9]+").whitespace is None


@pytest.mark.parametrize("prompt", ["person = ", "def f():\n    return ", "x", "{"])
def test_generated_json_has_the_styles_whitespace(demo, prompt):
    """Greedy and sampled completions under each style: outside strings, compact has no whitespace
    and spaced exactly one space after each ',' and ':'; every finished output validates."""
    ids = demo.tokenizer.encode(prompt)
    for style in ("compact", "spaced"):
        for kw in ({}, {"temperature": 0.9, "top_k": 40, "sample_seed": 7}):
            cfg = tl.GenerateConfig(max_tokens=60, grammar=tl.Grammar.json_schema(SCHEMA, style), **kw)
            st = tl.GenerateStats()
            out = tl.generate(demo, ids, cfg, stats=st)
            gen = [t for t in out[len(ids):] if t not in demo.cfg.eos_ids]
            text = demo.tokenizer.decode(gen)
            runs = separators_outside_strings(text)
            if style == "compact":
                assert runs == [], (prompt, kw, text)
            else:
                assert all(ws == " " and before in ",:" for before, ws in runs), (prompt, kw, text)
            if st.stop_reason in (tl.StopReason.EOS, tl.StopReason.GRAMMAR_COMPLETE):
                jsonschema.validate(json.loads(text), SCHEMA)


def test_mapping_form_pickle_and_config(demo):
    g = tl.Grammar.from_mapping({"json_schema": SCHEMA, "whitespace": "compact"})
    assert g == tl.Grammar.json_schema(SCHEMA, "compact")
    assert tl.Grammar.from_mapping({"json": {}, "whitespace": "spaced"}) == tl.Grammar.json("spaced")
    cfg = tl.GenerateConfig(grammar={"json_schema": SCHEMA, "whitespace": "compact"})
    assert cfg.grammar == g
    back = pickle.loads(pickle.dumps(g))
    assert back == g and back.whitespace == "compact"
    assert pickle.loads(pickle.dumps(tl.Grammar.json("spaced"))) == tl.Grammar.json("spaced")
    assert "whitespace='compact'" in repr(g) and "whitespace" not in repr(tl.Grammar.json_schema(SCHEMA))


@pytest.mark.parametrize("call, match", [
    (lambda: tl.Grammar.json_schema(SCHEMA, whitespace="tight"), "whitespace='tight' is not one of flexible, compact, spaced"),
    (lambda: tl.Grammar.json_schema(SCHEMA, whitespace=None), "whitespace=None is not one of"),
    (lambda: tl.Grammar.json(whitespace=1), "whitespace=1 is not one of"),
    (lambda: tl.Grammar.from_mapping({"regex": "[0-9]+", "whitespace": "compact"}), "not regex"),
    (lambda: tl.Grammar.from_mapping({"lark": "start: /a/", "whitespace": "compact"}), "not lark"),
    (lambda: tl.Grammar.from_mapping({"json_schema": SCHEMA, "indent": 2}), "exactly one of"),
    (lambda: tl.Grammar.from_mapping({"whitespace": "compact"}), "exactly one of"),
    (lambda: tl.Grammar.from_mapping({"json": {}, "regex": "a"}), "exactly one of"),
    (lambda: tl.GenerateConfig(grammar={"json_schema": SCHEMA, "whitespace": "tabs"}), "whitespace='tabs'"),
])
def test_bad_whitespace_is_a_config_error(call, match):
    with pytest.raises(tl.ConfigError, match=match):
        call()


def test_run_config_schema_file_with_a_whitespace(tmp_path):
    from tinyloop.runtime.config import load_run_config
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "run.yaml").write_text("generate:\n  max_tokens: 8\n  grammar:\n    json_schema: s.json\n"
                                       "    whitespace: spaced\nprompts: ['x']\n")
    cfg = load_run_config(str(tmp_path / "run.yaml"))
    assert cfg.generate.grammar == tl.Grammar.json_schema(SCHEMA, "spaced")
    (tmp_path / "bad.yaml").write_text("generate:\n  grammar:\n    regex: '[0-9]+'\n    whitespace: compact\n"
                                       "prompts: ['x']\n")
    with pytest.raises(tl.ConfigError, match="not regex"):
        load_run_config(str(tmp_path / "bad.yaml"))


# =============================================================================== the server
@pytest.fixture(scope="module")
def client():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from tinyloop.serve import ServeConfig, create_app
    app = create_app(ServeConfig(backend="cpu", max_seq_len=200, queue_size=4, max_tokens_default=4))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    app.state.served.close()


def test_server_response_format_whitespace(client):
    body = {"model": "demo", "prompt": "person = ", "temperature": 0, "max_tokens": 60}
    for fmt, check in [
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}, "whitespace": "compact"},
         lambda runs: runs == []),
        ({"type": "json_object", "whitespace": "spaced"},
         lambda runs: all(ws == " " and b in ",:" for b, ws in runs)),
    ]:
        r = client.post("/v1/completions", json={**body, "response_format": fmt})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert check(separators_outside_strings(choice["text"])), choice["text"]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["text"])
            if fmt["type"] == "json_schema":
                jsonschema.validate(value, SCHEMA)
            else:
                assert isinstance(value, dict)
    for fmt in ({"type": "regex", "regex": "[0-9]+", "whitespace": "compact"}, {"type": "text", "whitespace": "compact"}):
        r = client.post("/v1/completions", json={**body, "response_format": fmt})
        assert r.status_code == 400 and "whitespace applies to the JSON types" in r.json()["error"]["message"], r.text
    r = client.post("/v1/completions", json={**body, "response_format": {"type": "json_object", "whitespace": "tabs"}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("response_format"), r.text


def test_an_explicit_style_overrides_the_schemas_own_settings(demo):
    """A schema's own llguidance settings ("x-guidance") keep their meaning under the default
    (flexible) style; an explicit compact or spaced style is what the caller gets."""
    own = {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}
    assert accepts(tl.Grammar.json_schema(own), demo, '{"name": "Al", "age": 3, "tags": []}')
    compact = tl.Grammar.json_schema(own, "compact")
    assert accepts(compact, demo, '{"name":"Al","age":3,"tags":[]}')
    assert not accepts(compact, demo, '{"name": "Al", "age": 3, "tags": []}')
    pattern = {**SCHEMA, "x-guidance": {"whitespace_pattern": "[ ]*", "item_separator": ";"}}
    spaced = tl.Grammar.json_schema(pattern, "spaced")
    assert accepts(spaced, demo, '{"name": "Al", "age": 3, "tags": [1, 2]}')
    assert not accepts(spaced, demo, '{"name":  "Al", "age": 3, "tags": [1, 2]}')
