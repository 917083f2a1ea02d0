"""Tokenizers: byte-level BPE round trips, the streaming decoder, the byte fallback, and the
precedence rules of resolve_tokenizer. Needs only the `tokenizers` library (no model files)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")

from tinyloop.errors import TokenizerError  # noqa: E402
from tinyloop.model.tokenizer import (  # noqa: E402
    TOKENIZER_ENV, BPETokenizer, ByteTokenizer, Tokenizer, resolve_tokenizer)

CORPUS = [
    "hello world, hello there. The quick brown fox jumps over the lazy dog.",
    "héllo wörld — naïve café façade",
    "日本語のテキスト 中文 한국어",
    "emoji 😀 😀😀 👍🏽 family 👨‍👩‍👧",
    "tabs\tand\nnewlines  double  spaces",
]


def train_dir(path, vocab_size=320, corpus=CORPUS):
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers
    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 20, trainer=trainer)
    os.makedirs(path, exist_ok=True)
    tok.model.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return train_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def bpe(tokdir):
    return BPETokenizer.from_dir(tokdir)


def stream(tok: Tokenizer, ids):
    d = tok.stream_decoder()
    pieces = [d.push(i) for i in ids]
    return pieces, d.flush()


# ------------------------------------------------------------------------------------ BPE
TEXTS = ["hello world", "", " leading space", "héllo wörld 😀", "日本語 and 🦀 crab",
         "tabs\tand\nnewlines", "a" * 50, "👨‍👩‍👧 zwj"]


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_round_trip(bpe, text):
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text
    pieces, rest = stream(bpe, ids)
    assert "".join(pieces) + rest == text
    assert rest == ""


def test_bpe_merges_are_used(bpe):
    assert len(bpe.encode("hello world")) < len("hello world")
    assert bpe.vocab_size > 256
    assert isinstance(bpe.name, str) and bpe.name.startswith("bpe:")


def test_stream_holds_split_emoji(bpe):
    # 🦀 is not in the training corpus: its 4 UTF-8 bytes are separate byte tokens
    ids = bpe.encode("a🦀b")
    pieces, rest = stream(bpe, ids)
    assert "".join(pieces) == "a🦀b" and rest == ""
    assert "" in pieces                      # nothing emitted for the incomplete prefix
    assert all("\ufffd" not in p for p in pieces)
    assert any(p.endswith("🦀") or p.startswith("🦀") for p in pieces)


def test_stream_flush_replaces_incomplete(bpe):
    ids = bpe.encode("🦀")
    assert len(ids) > 1
    d = bpe.stream_decoder()
    assert [d.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.flush() == "\ufffd"
    assert d.flush() == ""                   # reset after flush
    assert bpe.decode(ids[:-1]) == "\ufffd"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_stream_equals_full_decode_random_text(bpe, text):
    ids = bpe.encode(text)
    pieces, rest = stream(bpe, ids)
    assert bpe.decode(ids) == text
    assert "".join(pieces) + rest == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 400), max_size=12))
def test_stream_equals_full_decode_random_ids(bpe, ids):
    # arbitrary id sequences (invalid UTF-8 and ids without a token included)
    pieces, rest = stream(bpe, ids)
    assert "".join(pieces) + rest == bpe.decode(ids)


def test_ids_without_token_decode_to_nothing(bpe):
    assert bpe.decode([bpe.vocab_size + 5]) == ""
    assert bpe.decode(bpe.encode("hi") + [10 ** 6]) == "hi"
    with pytest.raises(TokenizerError):
        bpe.decode([-1])
    with pytest.raises(TokenizerError):
        bpe.stream_decoder().push(-3)


def test_embedded_round_trip(bpe):
    d = bpe.to_embedded()
    assert d["type"] == "bpe" and isinstance(d["vocab"], dict)
    assert all(isinstance(m, str) and len(m.split(" ")) == 2 for m in d["merges"])
    json.dumps(d)  # header-serializable
    t2 = BPETokenizer.from_embedded(json.loads(json.dumps(d)))
    for text in TEXTS:
        assert t2.encode(text) == bpe.encode(text)
    assert t2.vocab_size == bpe.vocab_size


def test_from_dir_errors(tmp_path, tokdir):
    with pytest.raises(TokenizerError, match="does not exist"):
        BPETokenizer.from_dir(tmp_path / "nope")
    d = tmp_path / "only_vocab"
    d.mkdir()
    (d / "vocab.json").write_text(open(os.path.join(tokdir, "vocab.json"), encoding="utf-8").read(),
                                  encoding="utf-8")
    with pytest.raises(TokenizerError, match="merges.txt"):
        BPETokenizer.from_dir(d)
    d2 = tmp_path / "only_merges"
    d2.mkdir()
    (d2 / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="vocab.json"):
        BPETokenizer.from_dir(d2)
    (d2 / "vocab.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="vocab.json.*not valid JSON"):
        BPETokenizer.from_dir(d2)
    (d2 / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}), encoding="utf-8")
    (d2 / "merges.txt").write_text("#version: 0.2\na b\nb  c\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"merges.txt:3"):
        BPETokenizer.from_dir(d2)
    (d2 / "merges.txt").write_text("a b\nab c\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        BPETokenizer.from_dir(d2)
    (d2 / "merges.txt").write_text("b a\n", encoding="utf-8")   # result "ba" missing
    with pytest.raises(TokenizerError, match="'ba'"):
        BPETokenizer.from_dir(d2)
    (d2 / "vocab.json").write_text(json.dumps({"a": 0, "b": 0}), encoding="utf-8")
    (d2 / "merges.txt").write_text("", encoding="utf-8")
    with pytest.raises(TokenizerError, match="share id 0"):
        BPETokenizer.from_dir(d2)


def test_embedded_errors():
    with pytest.raises(TokenizerError, match="not supported"):
        BPETokenizer.from_embedded({"type": "wordpiece", "vocab": {}, "merges": []})
    with pytest.raises(TokenizerError, match="merges"):
        BPETokenizer.from_embedded({"type": "bpe", "vocab": {"a": 0}})
    with pytest.raises(TokenizerError, match="merge #0"):
        BPETokenizer.from_embedded({"type": "bpe", "vocab": {"a": 0}, "merges": ["abc"]})
    with pytest.raises(TokenizerError, match="non-negative"):
        BPETokenizer.from_embedded({"type": "bpe", "vocab": {"a": -1}, "merges": []})


def test_vocab_missing_bytes_refuses_to_encode_lossily():
    tok = BPETokenizer({"a": 0, "b": 1, "ab": 2}, [("a", "b")])
    assert tok.encode("abab") == [2, 2]
    with pytest.raises(TokenizerError, match="no token for byte"):
        tok.encode("abz")


def test_token_outside_byte_alphabet_decodes_verbatim():
    # the ByteLevel decoder keeps a token containing a non-alphabet char as its UTF-8 text
    from tinyloop.model.tokenizer import byte_to_unicode
    vocab = {c: b for b, c in byte_to_unicode().items()}
    vocab["☃x"] = 256
    tok = BPETokenizer(vocab, [])
    ids = [ord("a"), 256, 0xE2, 0x82, 0xAC, 256]
    pieces, rest = stream(tok, ids)
    assert tok.decode(ids) == "".join(pieces) + rest == "a☃x€☃x"


def test_missing_library_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(TokenizerError, match=r"pip install tinyloop\[tokenizer\]"):
        BPETokenizer({"a": 0}, [])


# ------------------------------------------------------------------------------- bytes
def test_byte_tokenizer():
    t = ByteTokenizer(300)
    assert t.vocab_size == 256 and t.name == "bytes"
    text = "héllo 😀"
    ids = t.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert t.decode(ids) == text
    pieces, rest = stream(t, ids)
    assert "".join(pieces) == text and rest == ""
    assert pieces[-4:-1] == ["", "", ""] and pieces[-1] == "😀"
    # ids >= 256 have no byte: they decode to nothing
    assert t.decode([104, 256, 299, 105]) == "hi"
    assert stream(t, [0xF0, 0x9F])[1] == "\ufffd"
    with pytest.raises(TokenizerError, match="vocab_size >= 256"):
        ByteTokenizer(100)


# ---------------------------------------------------------------------------- resolve
@pytest.fixture(scope="module")
def two_dirs(tmp_path_factory):
    a = train_dir(tmp_path_factory.mktemp("tokA"), vocab_size=300)
    b = train_dir(tmp_path_factory.mktemp("tokB"), vocab_size=330)
    return a, b


def test_resolve_precedence(two_dirs, monkeypatch):
    a, b = two_dirs
    emb = BPETokenizer.from_dir(a).to_embedded()
    monkeypatch.delenv(TOKENIZER_ENV, raising=False)
    # nothing configured -> bytes
    assert isinstance(resolve_tokenizer(None, None, 512), ByteTokenizer)
    # embedded
    t = resolve_tokenizer(emb, None, 512)
    assert t.name == "bpe:embedded"
    # env beats embedded
    monkeypatch.setenv(TOKENIZER_ENV, b)
    t = resolve_tokenizer(emb, None, 512)
    assert t.name == f"bpe:{b}"
    # explicit dir beats env and embedded
    t = resolve_tokenizer(emb, a, 512)
    assert t.name == f"bpe:{a}"
    # empty env var counts as unset
    monkeypatch.setenv(TOKENIZER_ENV, "")
    assert resolve_tokenizer(emb, None, 512).name == "bpe:embedded"


def test_resolve_broken_configuration_is_an_error(two_dirs, tmp_path, monkeypatch):
    a, _ = two_dirs
    monkeypatch.delenv(TOKENIZER_ENV, raising=False)
    with pytest.raises(TokenizerError, match="does not exist"):
        resolve_tokenizer(None, str(tmp_path / "missing"), 512)
    monkeypatch.setenv(TOKENIZER_ENV, str(tmp_path / "missing"))
    with pytest.raises(TokenizerError, match=TOKENIZER_ENV):
        resolve_tokenizer(None, None, 512)           # no silent byte fallback
    monkeypatch.delenv(TOKENIZER_ENV)
    with pytest.raises(TokenizerError, match="embedded"):
        resolve_tokenizer({"type": "bpe", "vocab": {"a": 0}, "merges": ["a q"]}, None, 512)
    with pytest.raises(TokenizerError, match="vocab_size is 100"):
        resolve_tokenizer(None, a, 100)              # tokenizer ids exceed the model's vocab
    with pytest.raises(TokenizerError, match="vocab_size >= 256"):
        resolve_tokenizer(None, None, 200)           # byte fallback needs 256 ids
