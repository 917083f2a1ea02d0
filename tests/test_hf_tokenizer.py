"""HFTokenizer (a Hugging Face tokenizer.json) against the `tokenizers` library it is built on, and
against transformers / llguidance where installed: encode equals the library's, decode equals the
library's decode(skip_special_tokens=True), token_bytes are the bytes llguidance derives, the stream
decoder's pieces add up to decode, the embedded form round-trips, resolve_tokenizer finds it, and
every failure is a TokenizerError. The tokenizers are trained here (no downloads): a byte-level BPE
(GPT-2 / Llama-3 / Qwen2 layout) and a SentencePiece-style BPE with byte fallback (Llama-2 /
Mistral layout). Where the library's decode differs from the byte rule, a test says so."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")

from tokenizers import Tokenizer as Lib  # noqa: E402
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

from tinyloop.errors import TokenizerError  # noqa: E402
from tinyloop.model.tokenizer import (  # noqa: E402
    EMBEDDED_TYPES, TOKENIZER_ENV, BPETokenizer, HFTokenizer, StreamDecoder, load_tokenizer_dir,
    resolve_tokenizer, tokenizer_from_embedded)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

CORPUS = [
    "hello world, hello there. The quick brown fox jumps over the lazy dog.",
    "héllo wörld — naïve café façade, déjà vu",
    "日本語のテキスト 中文 한국어",
    "emoji 😀 😀😀 👍🏽 family 👨‍👩‍👧",
    "tabs\tand\nnewlines  double  spaces   triple\n\n",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
]

# fixed tricky texts: leading / multiple spaces, newlines, emoji, characters outside the training
# alphabet (byte fallback in the SentencePiece tokenizer), literal special-token text
TEXTS = ["hello world", "", " ", "  ", " leading space", "  two leading", "trailing  ", "a  b   c",
         "\n", "\nnewline first", "tabs\tand\nnewlines\n\n", "héllo wörld 😀", "日本語 and 🦀 crab",
         "👨‍👩‍👧 zwj", "ünïcödé ∑∫√ ☃ \u00a0nbsp", "a" * 50, "x<|endoftext|>y", "<s>hi</s>",
         "\u2581literal metaspace", "ﬁ ligature", "\x00\x01 control", "é" * 7, "€ 🦀🦀 ∞"]

TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)


def _train(tok, trainer):
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


def byte_level_json() -> str:
    """GPT-2 style: BPE + ByteLevel pre-tokenizer and decoder, special and non-special added tokens."""
    tok = Lib(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    _train(tok, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                    special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken("<think>", normalized=False), AddedToken("café", normalized=False)])
    return tok.to_str()


def sentencepiece_json(decoder=None, prepend_scheme="first", legacy=False, split=False) -> str:
    """Llama-2 style: BPE with byte_fallback and <unk>, Metaspace pre-tokenizer, the decoder
    Sequence [Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0)], and <0x00>..<0xFF> in the
    vocabulary at ids 3..258 (after <unk> <s> </s>), as in Llama-2's tokenizer.json. `legacy`: the
    older layout with a Prepend/Replace normalizer and no pre-tokenizer."""
    tok = Lib(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme,
                                                 split=split)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    # a small alphabet so that rarer characters (CJK, emoji, accents) need byte fallback: the
    # corpus's ASCII characters and "▁", given, so that the trainer's choice among characters of
    # equal count (each CJK character occurs as often as "q") cannot let CJK in on some runs
    alphabet = sorted({c for t in CORPUS for c in t if ord(c) < 128 and c != " "} | {"▁"})
    _train(tok, trainers.BpeTrainer(vocab_size=420, show_progress=False, limit_alphabet=len(alphabet),
                                    initial_alphabet=alphabet, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    order = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for i, (t, _) in enumerate(order[:3])}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in order[3:]:
        vocab.setdefault(t, len(vocab))
    spec["model"]["vocab"] = vocab
    for at in spec["added_tokens"]:
        at["id"] = vocab[at["content"]]
    if decoder is not None:
        spec["decoder"] = decoder
    if legacy:
        spec["pre_tokenizer"] = None
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "},
                                                  "content": "▁"}]}
    return json.dumps(spec, ensure_ascii=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}
    for name, text in [("byte_level", byte_level_json()), ("sentencepiece", sentencepiece_json())]:
        d = tmp_path_factory.mktemp(name)
        (d / "tokenizer.json").write_text(text, encoding="utf-8")
        out[name] = str(d / "tokenizer.json")
    return out


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def pair(request, files):
    """(HFTokenizer, the library's Tokenizer) for one tokenizer.json."""
    path = files[request.param]
    return HFTokenizer.from_file(path), Lib.from_file(path)


def stream(tok, ids, **kw):
    d = StreamDecoder(tok, **kw) if kw else tok.stream_decoder()
    pieces = [d.push(i) for i in ids]
    return pieces, d.flush()


def lib_ids(lib, text):
    return lib.encode(text, add_special_tokens=False).ids


def check_text(tok, lib, text):
    ids = tok.encode(text)
    assert ids == lib_ids(lib, text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    want = lib.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids) == want
    pieces, rest = stream(tok, ids)
    assert "".join(pieces) + rest == want


# ------------------------------------------------------------------------------ structure
def test_kinds(files):
    bl = HFTokenizer.from_file(files["byte_level"])
    sp = HFTokenizer.from_file(files["sentencepiece"])
    assert (bl.kind, bl.strip_leading_spaces) == ("byte_level", 0)
    assert (sp.kind, sp.strip_leading_spaces) == ("sentencepiece", 1)
    assert bl.name == f"hf:{files['byte_level']}"
    for tok, lib in ((bl, Lib.from_file(files["byte_level"])), (sp, Lib.from_file(files["sentencepiece"]))):
        full = lib.get_vocab(with_added_tokens=True)
        assert tok.vocab_size == max(full.values()) + 1
        assert repr(tok).startswith("<HFTokenizer hf:")
    # merges are used (not byte by byte), and the byte tokens are single bytes
    assert len(bl.encode("hello world")) < 5
    assert sp.token_bytes(3 + 0xE2) == b"\xe2" and sp.token_bytes(3 + 0x20) == b" "
    assert sp.token_bytes(sp.encode("hello")[0]).startswith(b" ")     # "▁hello" -> b" hello"
    assert bl.token_bytes(bl.encode(" hello")[0]).startswith(b" ")    # "Ġhello" -> b" hello"


def test_special_and_added_tokens(files):
    bl = HFTokenizer.from_file(files["byte_level"])
    lib = Lib.from_file(files["byte_level"])
    eot = lib.token_to_id("<|endoftext|>")
    assert bl.token_bytes(eot) == b"" and eot in bl.special_ids
    assert bl.encode("a<|endoftext|>b") == lib_ids(lib, "a<|endoftext|>b")   # matched in text
    assert eot in bl.encode("a<|endoftext|>b")
    think = lib.token_to_id("<think>")
    assert bl.token_bytes(think) == b"<think>" and think not in bl.special_ids
    # a non-special added token goes through the ByteLevel decoder like any token, as the library
    # does: "café" is all in GPT-2's byte alphabet, so it stands for b"caf\xe9" (not UTF-8). The
    # library's decode gives the same "caf\ufffd"; encode("café") does not round-trip, in both.
    cafe = lib.token_to_id("café")
    assert bl.token_bytes(cafe) == b"caf\xe9"
    assert bl.encode("café") == [cafe]
    assert bl.decode([cafe]) == lib.decode([cafe]) == "caf\ufffd"
    # ids without a token decode to nothing; negative ids are errors
    assert bl.token_bytes(bl.vocab_size + 3) == b""
    assert bl.decode(bl.encode("hi") + [10 ** 6]) == "hi"


# ------------------------------------------------------------------------- vs the library
@pytest.mark.parametrize("text", TEXTS)
def test_fixed_texts_match_library(pair, text):
    check_text(*pair, text)


@settings(max_examples=200, **SETTINGS)
@given(text=TEXT)
def test_random_texts_match_library(pair, text):
    check_text(*pair, text)


@settings(max_examples=100, **SETTINGS)
@given(text=TEXT)
def test_byte_level_round_trips(files, text):
    tok = HFTokenizer.from_file(files["byte_level"])
    if "<|" not in text and "<think>" not in text and "café" not in text:
        assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_byte_fallback_and_leading_space(files):
    tok = HFTokenizer.from_file(files["sentencepiece"])
    lib = Lib.from_file(files["sentencepiece"])
    for text in ["🦀", "a🦀b", "日本語", " x"]:
        ids = tok.encode(text)
        if text != " x":
            assert any(3 <= i < 259 for i in ids), "expected byte-fallback tokens"
        check_text(tok, lib, text)
    # Metaspace prepends "▁" to the text; the decoder's Strip removes exactly one leading space
    assert tok.decode(tok.encode("hi")) == "hi"
    assert tok.decode(tok.encode(" hi")) == "hi" == lib.decode(lib_ids(lib, " hi"))
    assert tok.decode(tok.encode("  hi")) == " hi" == lib.decode(lib_ids(lib, "  hi"))
    # the strip applies to the start of the text, after special tokens and byte-fallback spaces
    s, sp_byte, a = lib.token_to_id("<s>"), 3 + 0x20, lib.token_to_id("a")
    for ids in ([s, sp_byte, a], [s, s, sp_byte, sp_byte, a], [sp_byte], [s], []):
        want = lib.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids) == want
        pieces, rest = stream(tok, ids)
        assert "".join(pieces) + rest == want
    # a continuation (text after a prompt) keeps its leading space with strip_leading_spaces=0
    cont = tok.encode("world")                  # "▁world": how a completion after "hello" starts
    pieces, rest = stream(tok, cont, strip_leading_spaces=0)
    assert "".join(pieces) + rest == " world"
    assert tok.decode(cont) == "world" == lib.decode(cont)        # decode alone drops it, as HF does


def test_library_quirk_invalid_byte_runs(files):
    """The library's ByteFallback turns a run of <0xNN> tokens that is not valid UTF-8 into one
    U+FFFD per token (the run's valid bytes too); the byte rule decodes the bytes with Python's
    UTF-8 replacement, as every other tokenizer here does (and as streaming must)."""
    tok = HFTokenizer.from_file(files["sentencepiece"])
    lib = Lib.from_file(files["sentencepiece"])
    b = lambda x: 3 + x  # noqa: E731
    euro_head = [b(0xE2), b(0x82)]                  # the first two bytes of "€"
    assert tok.decode(euro_head) == "\ufffd"
    assert lib.decode(euro_head) == "\ufffd\ufffd"
    assert tok.decode([b(0x41), b(0xE2)]) == "A\ufffd"
    assert lib.decode([b(0x41), b(0xE2)]) == "\ufffd\ufffd"
    assert tok.decode(euro_head + [b(0xAC)]) == lib.decode(euro_head + [b(0xAC)]) == "€"


def test_metaspace_decoder(tmp_path):
    """T5-style decoder Metaspace(prepend_scheme="always") (and a splitting Metaspace
    pre-tokenizer): one leading space is stripped. The library drops *every* "▁" of the first token
    instead (a first token "▁▁" or "▁a▁b" loses all of them), and, with no ByteFallback step,
    prints <0xNN> tokens literally; the byte rule gives bytes."""
    text = sentencepiece_json(decoder={"type": "Metaspace", "replacement": "▁",
                                       "prepend_scheme": "always", "split": True},
                              prepend_scheme="always", split=True)
    tok, lib = HFTokenizer.from_json(text, name="t5ish"), Lib.from_str(text)
    assert (tok.kind, tok.strip_leading_spaces, tok.name) == ("sentencepiece", 1, "t5ish")
    for t in ["hello world", "a  b", "the lazy dog", "tabs\tand\nnewlines", "日本語"]:
        if any(3 <= i < 259 for i in tok.encode(t)):      # byte fallback: see below
            assert tok.decode(tok.encode(t)) == t != lib.decode(tok.encode(t))
        else:
            check_text(tok, lib, t)
    ids = tok.encode("🦀")
    assert tok.decode(ids) == "🦀"
    assert "<0xF0>" in lib.decode(ids)
    two = lib.token_to_id("▁▁")
    if two is not None:
        assert tok.decode([two]) == " " and lib.decode([two]) == ""
    a = lib.token_to_id("a")
    b = lib.token_to_id("▁b") or lib.token_to_id("▁")
    assert tok.decode([a, b]) == lib.decode([a, b])          # only the first token is affected
    never = sentencepiece_json(decoder={"type": "Metaspace", "replacement": "▁",
                                        "prepend_scheme": "never", "split": True})
    assert HFTokenizer.from_json(never).strip_leading_spaces == 0


def test_legacy_llama_layout():
    """The older Llama-2 tokenizer.json: a Prepend("▁") + Replace(" ", "▁") normalizer and no
    pre-tokenizer; the decoder decides the byte rule."""
    text = sentencepiece_json(legacy=True)
    tok, lib = HFTokenizer.from_json(text), Lib.from_str(text)
    assert (tok.kind, tok.strip_leading_spaces) == ("sentencepiece", 1)
    for t in TEXTS:
        check_text(tok, lib, t)


def test_truncation_and_padding_are_off():
    spec = json.loads(byte_level_json())
    spec["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    tok = HFTokenizer.from_json(json.dumps(spec))
    text = "the quick brown fox jumps over the lazy dog"
    assert len(Lib.from_str(json.dumps(spec)).encode(text, add_special_tokens=False).ids) == 64
    ids = tok.encode(text)
    assert 3 < len(ids) < 64 and tok.decode(ids) == text


def test_against_transformers(pair):
    transformers = pytest.importorskip("transformers")
    tok, lib = pair
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Lib.from_str(lib.to_str()))
    for text in TEXTS:
        ids = tok.encode(text)
        assert fast.encode(text, add_special_tokens=False) == ids
        assert tok.decode(ids) == fast.decode(ids, skip_special_tokens=True,
                                              clean_up_tokenization_spaces=False)
    # transformers' clean_up_tokenization_spaces rewrites " ." to "." and such: a text-level
    # cosmetic, not what the tokens stand for; the runtime never applies it. (transformers 4.x
    # applies it when asked; 5.x ignores it for BPE tokenizers, with a warning.)
    ids = tok.encode("a . b , c")
    assert tok.decode(ids) == "a . b , c"
    cleaned = fast.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=True)
    assert cleaned in ("a . b , c", "a. b, c")


def test_tokenizer_file_in_transformers(files):
    transformers = pytest.importorskip("transformers")
    for path in files.values():
        tok = HFTokenizer.from_file(path)
        fast = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        for text in ["hello world", " 日本語 🦀", "  two"]:
            ids = tok.encode(text)
            assert tok.decode(ids) == fast.decode(ids, skip_special_tokens=True,
                                                  clean_up_tokenization_spaces=False)


def test_token_bytes_match_llguidance(files):
    """llguidance derives token bytes from a tokenizer.json itself: they agree with token_bytes on
    every non-special token (llguidance uses byte 0xFF as its special-token marker, so it gives
    the token <0xFF> no bytes)."""
    llg = pytest.importorskip("llguidance")
    for path in files.values():
        tok = HFTokenizer.from_file(path)
        lt = llg.LLTokenizer(path)
        for i in range(tok.vocab_size):
            if i in tok.special_ids or tok.token_bytes(i) == b"\xff":
                continue
            assert lt.decode_bytes([i]) == tok.token_bytes(i), i


def test_grammar_uses_token_bytes(files):
    pytest.importorskip("llguidance")
    from tinyloop.runtime.grammar import Grammar
    for path in files.values():
        tok = HFTokenizer.from_file(path)
        lib = Lib.from_file(path)
        eos = lib.token_to_id("</s>") if tok.kind == "sentencepiece" else lib.token_to_id("<|endoftext|>")
        assert eos is not None and tok.token_bytes(eos) == b""
        m = Grammar.regex("[a-z ]+").matcher(tok, tok.vocab_size, eos)
        ids = tok.encode("hello world")
        assert m.validate_tokens(ids) == len(ids)
        m2 = Grammar.regex("[0-9]+").matcher(tok, tok.vocab_size, eos)
        assert m2.validate_tokens(ids) < len(ids)


# ------------------------------------------------------------------------------ streaming
@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_stream_equals_decode_random_ids(pair, data):
    """Arbitrary ids: special tokens, byte tokens that split or never finish a character, ids
    without a token; the pieces plus flush equal decode, and the pieces never hold a U+FFFD that
    decode does not have."""
    tok, lib = pair
    special = sorted(tok.special_ids)
    ident = st.one_of(st.integers(0, tok.vocab_size + 5), st.sampled_from(special),
                      st.integers(3, 258))   # <0xNN> in the SentencePiece tokenizer
    ids = data.draw(st.lists(ident, max_size=16))
    pieces, rest = stream(tok, ids)
    full = tok.decode(ids)
    assert "".join(pieces) + rest == full
    assert "".join(pieces).count("\ufffd") <= full.count("\ufffd")


@settings(max_examples=100, **SETTINGS)
@given(text=TEXT)
def test_stream_never_emits_partial_characters(pair, text):
    tok, _ = pair
    ids = tok.encode(text)
    pieces, rest = stream(tok, ids)
    if "\ufffd" not in tok.decode(ids):
        assert all("\ufffd" not in p for p in pieces) and rest == ""


def test_stream_flush_resets(files):
    tok = HFTokenizer.from_file(files["sentencepiece"])
    d = tok.stream_decoder()
    assert "".join(d.push(i) for i in tok.encode("hi") + [3 + 0xF0]) == "hi"
    assert d.flush() == "\ufffd"
    assert d.flush() == ""
    # the leading-space strip starts over after flush
    assert "".join(d.push(i) for i in tok.encode(" again")) + d.flush() == "again"
    with pytest.raises(TokenizerError):
        StreamDecoder(tok, strip_leading_spaces=-1)


# ------------------------------------------------------------------------------ embedded
def test_embedded_round_trip(pair):
    tok, _ = pair
    d = tok.to_embedded()
    assert set(d) == {"type", "json"} and d["type"] == "hf" and isinstance(d["json"], str)
    t2 = tokenizer_from_embedded(json.loads(json.dumps(d)))
    assert isinstance(t2, HFTokenizer) and t2.name == "hf:embedded"
    assert (t2.vocab_size, t2.kind, t2.strip_leading_spaces) == (tok.vocab_size, tok.kind,
                                                                  tok.strip_leading_spaces)
    assert [t2.token_bytes(i) for i in range(tok.vocab_size)] == \
        [tok.token_bytes(i) for i in range(tok.vocab_size)]
    for text in TEXTS:
        assert t2.encode(text) == tok.encode(text)
    assert HFTokenizer.from_embedded(d).encode("hello") == tok.encode("hello")


def test_embedded_bpe_still_dispatches(tmp_path):
    from tokenizers import pre_tokenizers as pt
    lib = Lib(models.BPE())
    lib.pre_tokenizer = pt.ByteLevel(add_prefix_space=False)
    _train(lib, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                    initial_alphabet=pt.ByteLevel.alphabet()))
    lib.model.save(str(tmp_path))
    bpe = BPETokenizer.from_dir(str(tmp_path))
    t = tokenizer_from_embedded(bpe.to_embedded())
    assert isinstance(t, BPETokenizer) and t.encode("hello") == bpe.encode("hello")
    assert BPETokenizer.from_embedded(bpe.to_embedded()).encode("hi") == bpe.encode("hi")
    assert bpe.strip_leading_spaces == 0


def test_embedded_errors(files):
    good = HFTokenizer.from_file(files["byte_level"]).to_embedded()
    with pytest.raises(TokenizerError, match=r"'wordpiece'.*allowed: 'bpe', 'hf'"):
        tokenizer_from_embedded({"type": "wordpiece"})
    assert EMBEDDED_TYPES == ("bpe", "hf")
    with pytest.raises(TokenizerError, match="allowed"):
        tokenizer_from_embedded({})
    with pytest.raises(TokenizerError, match="mapping"):
        tokenizer_from_embedded(["hf"])
    with pytest.raises(TokenizerError, match="'json'"):
        tokenizer_from_embedded({"type": "hf"})
    with pytest.raises(TokenizerError, match="'json'"):
        tokenizer_from_embedded({"type": "hf", "json": json.loads(good["json"])})   # an object, not text
    with pytest.raises(TokenizerError, match="unknown key"):
        tokenizer_from_embedded(dict(good, vocab={}))
    with pytest.raises(TokenizerError, match="hf:embedded: not valid JSON"):
        tokenizer_from_embedded({"type": "hf", "json": "{nope"})
    with pytest.raises(TokenizerError, match="not 'hf'"):
        HFTokenizer.from_embedded({"type": "bpe", "json": good["json"]})


# ------------------------------------------------------------------------------- resolve
def test_resolve(files, tmp_path, monkeypatch):
    monkeypatch.delenv(TOKENIZER_ENV, raising=False)
    emb = HFTokenizer.from_file(files["byte_level"]).to_embedded()
    t = resolve_tokenizer(emb, None, 1000)
    assert isinstance(t, HFTokenizer) and t.name == "hf:embedded"
    d = os.path.dirname(files["sentencepiece"])
    t = resolve_tokenizer(emb, d, 1000)                         # the directory beats the header
    assert isinstance(t, HFTokenizer) and t.kind == "sentencepiece"
    assert t.name == f"hf:{os.path.join(d, 'tokenizer.json')}"
    monkeypatch.setenv(TOKENIZER_ENV, d)
    assert resolve_tokenizer(emb, None, 1000).kind == "sentencepiece"
    monkeypatch.delenv(TOKENIZER_ENV)
    with pytest.raises(TokenizerError, match="vocab_size is 100"):
        resolve_tokenizer(emb, None, 100)
    with pytest.raises(TokenizerError, match="embedded in the model file is invalid.*allowed"):
        resolve_tokenizer({"type": "sentencepiece"}, None, 1000)
    with pytest.raises(TokenizerError, match="embedded in the model file is invalid"):
        resolve_tokenizer({"type": "hf", "json": "[]"}, None, 1000)


def test_load_tokenizer_dir(files, tmp_path):
    # tokenizer.json is preferred over vocab.json + merges.txt in the same directory
    both = tmp_path / "both"
    both.mkdir()
    lib = Lib.from_file(files["byte_level"])
    lib.model.save(str(both))
    assert (both / "vocab.json").is_file() and (both / "merges.txt").is_file()
    assert isinstance(load_tokenizer_dir(str(both)), BPETokenizer)
    (both / "tokenizer.json").write_text(open(files["byte_level"], encoding="utf-8").read(),
                                         encoding="utf-8")
    t = load_tokenizer_dir(both)
    assert isinstance(t, HFTokenizer) and t.kind == "byte_level"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.json.*vocab.json"):
        load_tokenizer_dir(str(empty))
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer_dir(str(tmp_path / "missing"))
    only_vocab = tmp_path / "only_vocab"
    only_vocab.mkdir()
    (only_vocab / "vocab.json").write_text("{}", encoding="utf-8")
    with pytest.raises(TokenizerError, match="merges.txt"):
        load_tokenizer_dir(str(only_vocab))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"bad.tokenizer\.json: not valid JSON"):
        load_tokenizer_dir(str(bad))


# -------------------------------------------------------------------------------- errors
def test_file_errors(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        HFTokenizer.from_file(tmp_path / "nope.json")
    with pytest.raises(TokenizerError, match="is a directory"):
        HFTokenizer.from_file(tmp_path)
    p = tmp_path / "tokenizer.json"
    p.write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match=rf"{p.name}: not valid JSON"):
        HFTokenizer.from_file(p)
    p.write_bytes(b"\xff\xfe{}")
    with pytest.raises(TokenizerError, match="not UTF-8"):
        HFTokenizer.from_file(p)
    p.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(TokenizerError, match="not a tokenizer.json"):
        HFTokenizer.from_file(p)
    p.write_text(json.dumps({"model": {"type": "NoSuchModel"}}), encoding="utf-8")
    with pytest.raises(TokenizerError, match="tokenizers library refuses it"):
        HFTokenizer.from_file(p)
    with pytest.raises(TokenizerError, match="as text"):
        HFTokenizer.from_json(b"{}")


def test_input_errors(pair):
    tok, _ = pair
    for bad in (b"bytes", None, 3, ["a"]):
        with pytest.raises(TokenizerError, match="needs a str"):
            tok.encode(bad)
    with pytest.raises(TokenizerError, match="encode failed"):
        tok.encode("lone surrogate \ud800")
    with pytest.raises(TokenizerError):
        tok.decode([-1])
    with pytest.raises(TokenizerError):
        tok.decode([1.5])
    with pytest.raises(TokenizerError):
        tok.token_bytes(-2)
    with pytest.raises(TokenizerError):
        tok.stream_decoder().push(-3)


def _with_decoder(decoder, base=None):
    spec = json.loads(base or sentencepiece_json())
    spec["decoder"] = decoder
    return json.dumps(spec)


R, BF, F = ({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"})
S = {"type": "Strip", "content": " ", "start": 1, "stop": 0}


@pytest.mark.parametrize("decoder, match", [
    ({"type": "WordPiece", "prefix": "##", "cleanup": True}, "WordPiece is not supported"),
    ({"type": "CTC", "pad_token": "<pad>", "word_delimiter_token": "|", "cleanup": True}, "CTC"),
    ({"type": "Sequence", "decoders": [R, BF, S, F]}, "after Fuse|Strip before Fuse"),
    ({"type": "Sequence", "decoders": [R, BF, S]}, "Strip before Fuse"),
    ({"type": "Sequence", "decoders": [BF, R, F, S]}, "after ByteFallback"),
    ({"type": "Sequence", "decoders": [R, F, BF]}, "after Fuse"),
    ({"type": "Sequence", "decoders": [R, BF, F, dict(S, stop=1)]}, r"Strip\(content=' ', start=1, stop=1\)"),
    ({"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"Regex": "▁+"}, "content": " "},
                                       BF, F]}, "Regex"),
    ({"type": "Sequence", "decoders": [F]}, "neither ByteLevel nor SentencePiece"),
    ({"type": "Sequence", "decoders": [{"type": "ByteLevel", "add_prefix_space": True,
                                        "trim_offsets": True, "use_regex": True}, S]}, "ByteLevel combined"),
    (None, None),  # no decoder, Metaspace pre-tokenizer: accepted (see below)
])
def test_unsupported_decoders(decoder, match):
    text = _with_decoder(decoder)
    if match is None:
        t = HFTokenizer.from_json(text)
        assert (t.kind, t.strip_leading_spaces) == ("sentencepiece", 1)
        assert t.decode(t.encode("héllo 🦀")) == "héllo 🦀"   # the library would join tokens with " "
        return
    with pytest.raises(TokenizerError, match=rf"unsupported tokenizer decoder.*({match})"):
        HFTokenizer.from_json(text, name="x.json")


def test_unsupported_models():
    wp = Lib(models.WordPiece(unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    wp.normalizer = normalizers.BertNormalizer()
    wp.decoder = decoders.WordPiece()
    _train(wp, trainers.WordPieceTrainer(vocab_size=200, show_progress=False, special_tokens=["[UNK]"]))
    with pytest.raises(TokenizerError, match="unsupported tokenizer model WordPiece"):
        HFTokenizer.from_json(wp.to_str(), name="bert")
    suffix = Lib(models.BPE(end_of_word_suffix="</w>"))
    suffix.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    suffix.decoder = decoders.BPEDecoder(suffix="</w>")
    _train(suffix, trainers.BpeTrainer(vocab_size=300, show_progress=False, end_of_word_suffix="</w>"))
    with pytest.raises(TokenizerError, match="end_of_word_suffix"):
        HFTokenizer.from_json(suffix.to_str(), name="clipish")
    plain = json.loads(suffix.to_str())
    plain["model"]["end_of_word_suffix"] = None
    plain["decoder"] = None
    plain["pre_tokenizer"] = {"type": "Whitespace"}
    with pytest.raises(TokenizerError, match="no decoder"):
        HFTokenizer.from_json(json.dumps(plain))



def test_read_chat_template_forms(tmp_path):
    """A directory's chat template: chat_template.jinja first, else tokenizer_config.json's text or
    its list of named templates ("default"); none without; unreadable or malformed ones are
    TokenizerErrors naming the file."""
    import json as _json
    from tinyloop.errors import TokenizerError
    from tinyloop.model.tokenizer import read_chat_template
    d = tmp_path / "t"
    d.mkdir()
    assert read_chat_template(str(d)) is None
    (d / "tokenizer_config.json").write_text(_json.dumps({"chat_template": "{{ messages }}"}))
    assert read_chat_template(str(d)) == "{{ messages }}"
    (d / "tokenizer_config.json").write_text(_json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert read_chat_template(str(d)) == "D"
    (d / "chat_template.jinja").write_text("J")
    assert read_chat_template(str(d)) == "J"
    (d / "chat_template.jinja").unlink()
    for bad, match in (([{"name": "rag", "template": "R"}], "none named 'default'"), (5, "Jinja template"),
                       ("  ", "Jinja template")):
        (d / "tokenizer_config.json").write_text(_json.dumps({"chat_template": bad}))
        with pytest.raises(TokenizerError, match=match):
            read_chat_template(str(d))
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        read_chat_template(str(d))
