"""Grammar-constrained decoding (tinyloop.Grammar, the grammar processor plugin) against outside
references: completions of the demo model under random JSON schemas validate with jsonschema,
under random regexes match with re, under a Lark arithmetic grammar parse with lark; every
context compat.yaml allows; the ends (EOS, GRAMMAR_COMPLETE, GRAMMAR_DEAD_END); typed errors."""

from __future__ import annotations

import json
import re

import numpy as np

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop as tl

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
lark = pytest.importorskip("lark")

from conftest import write_tiny  # noqa: E402

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model(None, backend="cpu", max_seq_len=320)
    yield m
    tl.free_model(m)


def completion(m, ids, out):
    """The generated text without EOS."""
    gen = [t for t in out[len(ids):] if t != m.cfg.eos_id]
    return m.tokenizer.decode(gen)


def valid_prefix(grammar, m, tokens):
    """The tokens are a prefix the grammar can continue (an outside check of an unfinished output)."""
    mt = grammar.matcher(m.tokenizer, m.cfg.vocab_size, m.cfg.eos_id)
    return mt.validate_tokens(list(tokens)) == len(tokens)


# =============================================================================== JSON schemas
LEAF = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 12)),
    st.builds(lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w}, st.integers(-50, 50),
              st.integers(0, 100)),
    st.builds(lambda lo, w: {"type": "number", "minimum": lo, "maximum": lo + w}, st.integers(-5, 5),
              st.integers(1, 10)),
    st.just({"type": "boolean"}),
    st.builds(lambda xs: {"enum": xs}, st.lists(st.sampled_from(["red", "green", "blue", 1, 2, None, True]),
                                                min_size=1, max_size=4, unique=True)),
)


def _object(children):
    return st.dictionaries(st.sampled_from(["a", "id", "name", "size", "tags", "ok"]), children,
                           min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})


SCHEMAS = st.recursive(LEAF, lambda children: st.one_of(
    _object(children),
    st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n}, children, st.integers(0, 3))),
    max_leaves=5)


@settings(max_examples=25, **SETTINGS)
@given(schema=SCHEMAS, temperature=st.sampled_from([0.0, 0.9]), seed=st.integers(0, 1000))
def test_json_schema_completions_validate(demo, schema, temperature, seed):
    g = tl.Grammar.json_schema(schema)
    ids = demo.tokenizer.encode("data = ")
    kw = dict(temperature=temperature, sample_seed=seed) if temperature else {}
    st_ = tl.GenerateStats()
    out = tl.generate(demo, ids, tl.GenerateConfig(max_tokens=160, grammar=g, **kw), stats=st_)
    if st_.stop_reason == tl.StopReason.EOS:
        jsonschema.validate(json.loads(completion(demo, ids, out)), schema)
    else:
        assert st_.stop_reason == tl.StopReason.MAX_TOKENS and valid_prefix(g, demo, out[len(ids):])


def test_any_json_and_dict_or_text_schemas(demo):
    ids = demo.tokenizer.encode("config = ")
    st_ = tl.GenerateStats()
    out = tl.generate(demo, ids, tl.GenerateConfig(max_tokens=120, grammar=tl.Grammar.json()), stats=st_)
    if st_.stop_reason == tl.StopReason.EOS:
        json.loads(completion(demo, ids, out))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert tl.Grammar.json_schema(schema) == tl.Grammar.json_schema(json.dumps(schema))
    assert tl.GenerateConfig(grammar={"json_schema": schema}).grammar == tl.Grammar.json_schema(schema)


# =============================================================================== regexes
PIECES = st.sampled_from(["[a-z]", "[0-9]", "[A-F]", "x", "-", "ab", "(cat|dog)", "[a-z0-9_]"])
REGEXES = st.lists(st.tuples(PIECES, st.sampled_from(["", "+", "?", "{1,3}", "{2}", "*"])),
                   min_size=1, max_size=4).map(lambda parts: "".join(p + q for p, q in parts))


@settings(max_examples=25, **SETTINGS)
@given(pattern=REGEXES, temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 1000))
def test_regex_completions_match(demo, pattern, temperature, seed):
    g = tl.Grammar.regex(pattern)
    ids = demo.tokenizer.encode("key = ")
    kw = dict(temperature=temperature, sample_seed=seed) if temperature else {}
    st_ = tl.GenerateStats()
    out = tl.generate(demo, ids, tl.GenerateConfig(max_tokens=40, grammar=g, **kw), stats=st_)
    text = completion(demo, ids, out)
    if st_.stop_reason == tl.StopReason.EOS:
        assert re.fullmatch(pattern, text), (pattern, text)
    else:
        assert st_.stop_reason == tl.StopReason.MAX_TOKENS and valid_prefix(g, demo, out[len(ids):])


# =============================================================================== Lark
ARITH = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


@pytest.mark.parametrize("seed", range(6))
def test_lark_arithmetic_outputs_parse_with_lark(demo, seed):
    g = tl.Grammar.lark(ARITH)
    parser = lark.Lark(ARITH, start="start")
    ids = demo.tokenizer.encode("x = ")
    cfg = tl.GenerateConfig(max_tokens=24, grammar=g, temperature=1.0 if seed else 0.0,
                            sample_seed=seed if seed else 0)
    st_ = tl.GenerateStats()
    out = tl.generate(demo, ids, cfg, stats=st_)
    text = completion(demo, ids, out)
    if st_.stop_reason == tl.StopReason.EOS:
        parser.parse(text)
    else:
        assert valid_prefix(g, demo, out[len(ids):])


# =============================================================================== contexts
def test_every_allowed_context_gives_the_same_tokens(demo):
    g = tl.Grammar.regex(r"[a-z_]+\([a-z, ]*\):")
    ids = demo.tokenizer.encode("def ")
    cfg = tl.GenerateConfig(max_tokens=16, grammar=g, loops=3)
    base = tl.generate(demo, ids, cfg)
    assert tl.generate_stream(demo, ids, cfg, on_token=lambda t, p: True) == base
    assert ids + list(tl.generate_iter(demo, ids, cfg)) == base
    pc = tl.build_prefix_cache(demo, ids[:-1], loops=3)
    assert tl.generate_from_prefix_cache(demo, pc, ids[-1:], cfg) == base
    tl.free_prefix_cache(pc)
    h = tl.build_resume_handle(demo, ids, 1)
    assert tl.resume_generate(h, 3, tl.GenerateConfig(max_tokens=16, grammar=g)) == base
    tl.free_resume_handle(h)
    lanes = tl.generate_batch(demo, [ids, ids, ids], tl.GenerateConfig(max_tokens=16, loops=3),
                              grammars=[g, None, {"regex": "[0-9]+"}])
    assert lanes[0] == base
    assert lanes[1] == tl.generate(demo, ids, tl.GenerateConfig(max_tokens=16, loops=3))
    assert re.fullmatch("[0-9]+", completion(demo, ids, lanes[2]))


def test_rejected_contexts(demo):
    g = tl.Grammar.regex("[a-z]+")
    ids = demo.tokenizer.encode("x = ")
    with pytest.raises(tl.IncompatibleModesError, match="grammar.*rejected in speculative"):
        tl.generate(demo, ids, tl.GenerateConfig(grammar=g, decoder="speculative", loops=4,
                                                 options={"draft_loops": 2}))
    with pytest.raises(tl.IncompatibleModesError, match="grammar"):
        tl.generate(demo, ids, tl.GenerateConfig(grammar=g, beam_size=2))


# =============================================================================== ends
class TinyVocab(tl.Tokenizer):
    """Three tokens: "a", "b", "ab" (a tokenizer that cannot write "c")."""

    name = "tiny-vocab"
    pieces = [b"a", b"b", b"ab"]

    @property
    def vocab_size(self):
        return 3

    def encode(self, text):     # what it cannot write it leaves out (llguidance encodes with it)
        return [self.pieces.index(c.encode()) for c in text if c.encode() in self.pieces]

    def token_bytes(self, token_id):
        return self.pieces[token_id] if token_id < 3 else b""

    def decode(self, ids):
        return b"".join(self.token_bytes(i) for i in ids).decode()


@pytest.fixture(scope="module")
def no_eos(tmp_path_factory):
    path = tmp_path_factory.mktemp("grammar") / "m.tinyloop"
    write_tiny(path, vocab_size=300, eos_id=None)
    m = tl.load_model(str(path), max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


def test_complete_grammar_on_a_model_without_eos(no_eos):
    st_ = tl.GenerateStats()
    out = tl.generate(no_eos, [1, 2], tl.GenerateConfig(max_tokens=20, grammar=tl.Grammar.regex("abc")), stats=st_)
    assert bytes(out[2:]) == b"abc" and st_.stop_reason == tl.StopReason.GRAMMAR_COMPLETE


def test_dead_end_when_the_tokenizer_cannot_continue(tmp_path):
    path = tmp_path / "m.tinyloop"
    write_tiny(path, vocab_size=97, eos_id=None)
    m = tl.load_model(str(path), max_seq_len=64, backend="cpu", tokenizer=TinyVocab())
    try:
        st_ = tl.GenerateStats()
        out = tl.generate(m, [0], tl.GenerateConfig(max_tokens=10, grammar=tl.Grammar.regex("ac")), stats=st_)
        # "a" can only lead to a dead end ("c" has no token): llguidance forbids it at once or after it
        out = tl.generate(m, [0], tl.GenerateConfig(max_tokens=10, grammar=tl.Grammar.regex("ac")), stats=st_)
        assert out in ([0], [0, 0]) and st_.stop_reason == tl.StopReason.GRAMMAR_DEAD_END
        out = tl.generate(m, [0], tl.GenerateConfig(max_tokens=10, grammar=tl.Grammar.regex("c")), stats=st_)
        assert out == [0] and st_.stop_reason == tl.StopReason.GRAMMAR_DEAD_END and st_.tokens_emitted == 0
    finally:
        tl.free_model(m)


# =============================================================================== bad input
@pytest.mark.parametrize("make, match", [
    (lambda: tl.Grammar.regex("("), "invalid regex grammar"),
    (lambda: tl.Grammar.regex(""), "non-empty"),
    (lambda: tl.Grammar.lark("start: missing_rule"), "invalid lark grammar"),
    (lambda: tl.Grammar.lark(3), "non-empty text"),
    (lambda: tl.Grammar.json_schema("{not json"), "not valid JSON"),
    (lambda: tl.Grammar.json_schema([1, 2]), "must be an object"),
    (lambda: tl.Grammar.json_schema({"type": 5}), "invalid json_schema grammar"),
    (lambda: tl.GenerateConfig(grammar="root ::= 'a'"), "grammar must be a tinyloop.Grammar"),
    (lambda: tl.GenerateConfig(grammar={"yaml": 1}), "exactly one of"),
    (lambda: tl.GenerateConfig(grammar={"regex": "a", "lark": "b"}), "exactly one of"),
])
def test_bad_grammars_are_config_errors(make, match):
    with pytest.raises(tl.ConfigError, match=match):
        make()


def test_a_model_without_a_usable_tokenizer_is_refused_before_allocation(tiny_model, monkeypatch):
    allocations = []
    real = tiny_model.backend.alloc_cache
    monkeypatch.setattr(tiny_model.backend, "alloc_cache", lambda *a: allocations.append(a) or real(*a))
    with pytest.raises(tl.TokenizerError):
        tl.generate(tiny_model, [1, 2], tl.GenerateConfig(grammar=tl.Grammar.regex("[a-z]+")))
    assert allocations == []


def test_batch_grammars_must_match_the_prompts(demo):
    with pytest.raises(tl.InvalidInputError, match="one grammar"):
        tl.generate_batch(demo, [[1], [2]], grammars=[None])
    with pytest.raises(tl.ConfigError, match=r"grammars\[1\]"):
        tl.generate_batch(demo, [[1], [2]], grammars=[None, "x"])


def test_missing_llguidance_names_the_extra(monkeypatch):
    import builtins
    from tinyloop.runtime import grammar
    real = builtins.__import__

    def no_llg(name, *a, **kw):
        if name == "llguidance" or name.startswith("llguidance."):
            raise ImportError("no llguidance")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_llg)
    with pytest.raises(tl.ConfigError, match=r"pip install tinyloop\[grammar\]"):
        grammar.Grammar.regex("a")


def test_grammar_survives_pickling_and_is_reusable(demo):
    import pickle
    g = tl.Grammar.regex("[0-9]{2}")
    g2 = pickle.loads(pickle.dumps(g))
    assert g2 == g and hash(g2) == hash(g)
    ids = demo.tokenizer.encode("n = ")
    a = tl.generate(demo, ids, tl.GenerateConfig(max_tokens=6, grammar=g))
    assert tl.generate(demo, ids, tl.GenerateConfig(max_tokens=6, grammar=g2)) == a
    assert re.fullmatch("[0-9]{2}", completion(demo, ids, a))


def test_run_config_grammar_files(tmp_path, capsys):
    from tinyloop.cli.main import main
    (tmp_path / "s.json").write_text(json.dumps({"type": "object", "properties": {"k": {"enum": [1, 2]}},
                                                 "required": ["k"], "additionalProperties": False}))
    out = tmp_path / "o.jsonl"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f'model: ""\nbackend: cpu\nmax_seq_len: 128\nstream: false\nprompts: ["v = "]\n'
                   f'generate: {{max_tokens: 30, grammar: {{json_schema: s.json}}}}\noutput_jsonl: "{out}"\n')
    assert main(["run", str(cfg)]) == 0
    rec = json.loads(out.read_text().splitlines()[0])
    assert rec["stats"]["stop_reason"] == "EOS" and json.loads(rec["completion"])["k"] in (1, 2)
    cfg.write_text('model: ""\nbackend: cpu\nprompts: ["v = "]\ngenerate: {grammar: {lark: nowhere.lark}}\n')
    assert main(["run", str(cfg)]) == 2
    assert "nowhere.lark" in capsys.readouterr().err


def test_worker_and_inline_masks_agree(demo, monkeypatch):
    """Masks computed on the worker thread (overlapping the forward) or inline give the same tokens."""
    from tinyloop.plugins.processors import grammar as plugin
    ids = demo.tokenizer.encode("value = ")
    cfgs = [tl.GenerateConfig(max_tokens=40, grammar=tl.Grammar.json()),
            tl.GenerateConfig(max_tokens=40, grammar=tl.Grammar.json(), temperature=0.9, sample_seed=4)]
    want = [tl.generate(demo, ids, c) for c in cfgs]
    monkeypatch.setattr(plugin, "INLINE_MASK_S", -1.0)          # every mask on the worker
    for _ in range(3):
        assert [tl.generate(demo, ids, c) for c in cfgs] == want


def test_text_api_ends_at_eos(demo):
    """generate_text / stream_text stop at EOS without its marker text: a finished JSON completion
    parses as it is."""
    st_ = tl.GenerateStats()
    cfg = tl.GenerateConfig(max_tokens=40, grammar={"json_schema": {"enum": ["yes", "no"]}})
    text = tl.generate_text(demo, "answer = ", cfg, stats=st_)
    assert st_.stop_reason == tl.StopReason.EOS and json.loads(text) in ("yes", "no")
    assert "".join(tl.stream_text(demo, "answer = ", cfg)) == text


def test_device_mask_path_equals_the_host_path(demo, monkeypatch):
    """Greedy grammar decoding applies the mask where the logits live (backend token_masks:
    launch_masked_argmax); without that capability the logits row comes to the host and the
    processor's apply() masks it. Same tokens and stop reasons, over schemas, regexes and a
    dead end; allowed_words and apply agree on every step."""
    from tinyloop.plugins.processors.grammar import GrammarMask
    be = demo.backend
    assert be.supports("token_masks")
    calls = []
    real = type(be).launch_masked_argmax
    monkeypatch.setattr(type(be), "launch_masked_argmax", lambda self, ws, w: (calls.append(1), real(self, ws, w)))
    checked = []
    real_apply = GrammarMask.apply

    def apply(self, logits):                       # the host path's mask == the packed words
        words, before = self.allowed_words().copy(), logits.copy()
        real_apply(self, logits)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:len(logits)]
        assert np.array_equal(logits[bits == 1], before[bits == 1])
        assert np.isneginf(logits[bits == 0]).all()
        checked.append(1)
    monkeypatch.setattr(GrammarMask, "apply", apply)
    cases = [("value = ", tl.Grammar.json()), ("def ", tl.Grammar.regex(r"[a-z_]+\([a-z, ]*\):")),
             ("x = ", {"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                       "required": ["n"]}}),
             ("x = ", tl.Grammar.regex("q+"))]
    want = []
    for prompt, g in cases:
        st_ = tl.GenerateStats()
        ids = demo.tokenizer.encode(prompt)
        out = tl.generate(demo, ids, tl.GenerateConfig(max_tokens=24, grammar=g, loops=2), stats=st_)
        want.append((out, st_.stop_reason))
    assert calls and not checked                  # greedy never brought the logits to the host
    monkeypatch.setattr(type(be), "supports", lambda self, c: c != "token_masks" and c in self.capabilities)
    calls.clear()
    for (prompt, g), (out, reason) in zip(cases, want):
        st_ = tl.GenerateStats()
        ids = demo.tokenizer.encode(prompt)
        assert tl.generate(demo, ids, tl.GenerateConfig(max_tokens=24, grammar=g, loops=2), stats=st_) == out
        assert st_.stop_reason == reason
    assert checked and not calls
