"""The tokenizer and text layer against outside references, on adversarial inputs the other
tokenizer tests leave out.

References: the Hugging Face ``tokenizers`` library (encode, decode(skip_special_tokens=True), its
streaming ``DecodeStream``) and ``transformers``' tokenizers (PreTrainedTokenizerFast over the same
tokenizer.json, GPT2TokenizerFast over the demo model's vocab.json + merges.txt). Tokenizer layouts
built here (none in tests/test_hf_tokenizer.py): Llama-3 (a Split regex + ByteLevel(use_regex=False),
ignore_merges, an NFKC normalizer, added tokens with lstrip / rstrip / single_word / normalized),
a ByteLevel with add_prefix_space under an NFD + StripAccents + Lowercase normalizer, a Unigram
with a Metaspace decoder (T5 style), Gemma (a Replace normalizer, no pre-tokenizer, no Strip, an
added non-special "<0x41>" and "▁tab▁"), Llama-2 with extra added tokens. Texts: random unicode
mixed with emoji (ZWJ, skin tones), combining marks, CJK, RTL, control characters, NUL, "\\r\\n",
long runs of whitespace, literal special-token text.

Documented choices these tests pin (module docstring of tinyloop.model.tokenizer):

* Special tokens written in the text are matched as specials by HFTokenizer, as the library and
  transformers do by default (``split_special_tokens=False``); decode drops them (the library's
  ``skip_special_tokens=True``). A GPT-2 vocab.json + merges.txt pair (BPETokenizer, the demo model)
  has no special tokens: "<|endoftext|>" in the text is ordinary text and the EOS id decodes to its
  text, where transformers' GPT2TokenizerFast adds "<|endoftext|>" as a special token by default.
* Stop sequences are token ids matched in the output only (a stop sequence in the prompt, or one
  spanning the prompt's end, does not stop); the stopping token is part of the output and its
  text is part of generate_text's text, a character it cuts ends as U+FFFD.
* The server's text stop strings cut the text before the stop string it completes first, the same
  whatever pieces the tokens make (checked against the text arriving a character at a time).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from tokenizers import Tokenizer as Lib  # noqa: E402

import tinyloop as tl  # noqa: E402
from tinyloop.api import _pieces  # noqa: E402
from tinyloop.errors import TinyLoopError, TokenizerError  # noqa: E402
from tinyloop.model.tokenizer import BPETokenizer, ByteTokenizer, HFTokenizer  # noqa: E402

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

CORPUS = [
    "hello world, hello there. The quick brown fox jumps over the lazy dog.",
    "héllo wörld — naïve café façade, déjà vu",
    "日本語のテキスト 中文 한국어 שלום עולם مرحبا",
    "emoji 😀 😀😀 👍🏽 family 👨‍👩‍👧",
    "tabs\tand\nnewlines  double  spaces   triple\n\n\r\n",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
]

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# pieces an adversarial text is made of (besides random characters)
FRAGMENTS = ["<|begin_of_text|>", "<|eot_id|>", "<|endoftext|>", "<s>", "</s>", "<start_of_turn>",
             "<0x41>", "▁tab▁", "▁", " spaced ", "word", "Hello", "\r\n", "\r", "\n\n", "\x00", "\t",
             " " * 17, " " * 64, "\u3000\u00a0", "e\u0301\u0301", "\u05e9\u05dc\u05d5\u05dd", "\u200f\u202e",
             "👨‍👩‍👧", "👍🏽", "🦀", "日本語", "ＡＢＣ", "ﬁ", "\ufeff", "\ufffd",
             "\U0010ffff", "€"]
CHARS = st.characters(exclude_categories=("Cs",))
TEXT = st.lists(st.one_of(st.text(CHARS, max_size=8), st.sampled_from(FRAGMENTS)), max_size=8).map("".join)


def _train(tok, trainer):
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


def _added(spec, content, special, **kw):
    ids = list(spec["model"]["vocab"].values()) + [a["id"] for a in spec["added_tokens"]]
    spec["added_tokens"].append(dict({"id": max(ids) + 1, "content": content, "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False,
                                      "special": special}, **kw))


def llama3_json() -> str:
    t = Lib(models.BPE(ignore_merges=True))
    t.normalizer = normalizers.NFKC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    _train(t, trainers.BpeTrainer(vocab_size=420, show_progress=False,
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.add_special_tokens([AddedToken("<|eot_id|>", special=True, normalized=False)])
    t.add_tokens([AddedToken(" spaced", lstrip=True, rstrip=True, normalized=False),
                  AddedToken("word", single_word=True, normalized=False), AddedToken("Hello", normalized=True)])
    return t.to_str()


def prefix_lowercase_json() -> str:
    t = Lib(models.BPE())
    t.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase()])
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    t.decoder = decoders.ByteLevel()
    _train(t, trainers.BpeTrainer(vocab_size=360, show_progress=False, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return t.to_str()


def unigram_json() -> str:
    t = Lib(models.Unigram())
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    _train(t, trainers.UnigramTrainer(vocab_size=220, show_progress=False,
                                      special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    return t.to_str()


def llama2_spec() -> dict:
    from test_hf_tokenizer import sentencepiece_json
    return json.loads(sentencepiece_json())


def llama2_json() -> str:
    spec = llama2_spec()
    _added(spec, "<|eot_id|>", True)
    _added(spec, "word", False, single_word=True)
    return json.dumps(spec, ensure_ascii=False)


def gemma_json() -> str:
    spec = llama2_spec()
    spec["pre_tokenizer"] = None
    spec["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}]}
    _added(spec, "<start_of_turn>", True)
    _added(spec, "▁tab▁", False)
    _added(spec, "<0x41>", False)          # a non-special added token spelled like a byte token
    return json.dumps(spec, ensure_ascii=False)


LAYOUTS = {"llama3": llama3_json, "prefix_lowercase": prefix_lowercase_json, "unigram": unigram_json,
           "gemma": gemma_json, "llama2": llama2_json}


@pytest.fixture(scope="module")
def built():
    return {name: make() for name, make in LAYOUTS.items()}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request, built):
    """(name, HFTokenizer, the library's Tokenizer, transformers' fast tokenizer or None)."""
    text = built[request.param]
    tok, lib = HFTokenizer.from_json(text, name=request.param), Lib.from_str(text)
    try:
        import transformers
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Lib.from_str(text))
    except ImportError:                          # pragma: no cover - transformers is a dev dependency
        fast = None
    return request.param, tok, lib, fast


def stream(dec, ids):
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.flush()


def _byte(token):
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">")


def library_quirk(tok, lib, ids) -> bool:
    """True where the library's decode differs from the byte rule by a documented quirk (module
    docstring of tinyloop.model.tokenizer): a run of <0xNN> tokens that is not valid UTF-8, or a
    Metaspace decoder's first token with more than one replacement char."""
    kept = [i for i in ids if i < tok.vocab_size and i not in tok.special_ids and lib.id_to_token(i) is not None]
    run = b""
    for i in kept + [None]:
        t = lib.id_to_token(i) if i is not None else None
        if t is not None and _byte(t) and tok.kind == "sentencepiece":
            run += tok.token_bytes(i)
            continue
        try:
            run.decode("utf-8")
        except UnicodeDecodeError:
            return True
        run = b""
    dec = json.loads(lib.to_str()).get("decoder") or {}
    if dec.get("type") == "Metaspace" and kept and lib.id_to_token(kept[0]).count(dec["replacement"]) > 1:
        return True
    return False


# ----------------------------------------------------------------------- encode / decode vs reference
def check_against_references(name, tok, lib, fast, text):
    ids = tok.encode(text)
    assert ids == lib.encode(text, add_special_tokens=False).ids, (name, text)
    if fast is not None:
        assert ids == fast.encode(text, add_special_tokens=False), (name, text)
    want = lib.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids) == want, (name, text)
    if fast is not None:
        assert tok.decode(ids) == fast.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    pieces, rest = stream(tok.stream_decoder(), ids)
    assert "".join(pieces) + rest == want
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in want
    # the library's own streaming decoder (decode-the-prefix, emit the difference) ends on the same text
    from tokenizers.decoders import DecodeStream
    ds = DecodeStream(skip_special_tokens=True)
    assert "".join(ds.step(lib, i) or "" for i in ids) == want


@settings(max_examples=60, **SETTINGS)
@given(text=TEXT)
def test_random_texts_match_library_and_transformers(layout, text):
    check_against_references(*layout, text)


@pytest.mark.parametrize("text", ["", " ", " " * 300, "\r\n" * 40, "\t \n \r\n  \x00\x00 \x0b\x0c\x1c\x85\u2028",
                                  "a" + "\u0301" * 40, "😀" * 40, "\u202eRTL \u05e9\u05dc\u05d5\u05dd\u202c",
                                  "<|eot_id|><|eot_id|>x<|begin_of_text|>", "Hello word words sword",
                                  " spaced  x spaced ", "<start_of_turn>▁tab▁<0x41>A", "<s></s><unk>",
                                  "ＦＵＬＬ ﬁ ① ㎏", "\ufeffBOM", "x\U0010ffff\U000e0001y"])
def test_fixed_adversarial_texts(layout, text):
    check_against_references(*layout, text)


@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_random_ids_decode_like_library(layout, data):
    """Arbitrary ids (specials, byte tokens, added tokens, ids without a token): decode equals the
    library's decode(skip_special_tokens=True) outside its documented quirks; streaming adds up to
    decode in both the text-start and the continuation form."""
    name, tok, lib, _ = layout
    ids = data.draw(st.lists(st.one_of(st.integers(0, tok.vocab_size + 3),
                                       st.sampled_from(sorted(tok.special_ids) or [0]),
                                       st.integers(3, 258)), max_size=12))
    if not library_quirk(tok, lib, ids):
        assert tok.decode(ids) == lib.decode(ids, skip_special_tokens=True), (name, ids)
    for cont in (False, True):
        pieces, rest = stream(tok.stream_decoder(continuation=cont), ids)
        assert "".join(pieces) + rest == tok.decode(ids, continuation=cont)


def test_special_tokens_in_text_are_matched_as_specials(built):
    """The library's and transformers' default: special (and added) tokens written in the text are
    matched whole; decode drops the special ones and keeps the others."""
    transformers = pytest.importorskip("transformers")
    for name, text in built.items():
        tok, lib = HFTokenizer.from_json(text, name=name), Lib.from_str(text)
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Lib.from_str(text))
        for special in sorted(tok.special_ids):
            content = lib.id_to_token(special)
            ids = tok.encode(f"a{content}b")
            assert special in ids and ids == fast.encode(f"a{content}b", add_special_tokens=False), (name, content)
            assert content not in tok.decode(ids)
    tok, lib = HFTokenizer.from_json(built["gemma"]), Lib.from_str(built["gemma"])
    a = lib.token_to_id("<0x41>")
    # an added "<0x41>" is the vocabulary's byte token of that spelling (the library gives an added
    # token already in the vocabulary its vocabulary id); written in the text it is matched whole,
    # and it stands for the byte "A", as the library's ByteFallback decoder reads it
    assert tok.encode("<0x41>") == [a] == [3 + 0x41] and tok.token_bytes(a) == b"A" == lib.decode([a]).encode()
    tab = lib.token_to_id("▁tab▁")
    assert tok.encode("x▁tab▁") [-1] == tab and tok.decode([tab], continuation=True) == " tab "
    l3, lib3 = HFTokenizer.from_json(built["llama3"]), Lib.from_str(built["llama3"])
    # NFKC runs before a normalized added token is matched: fullwidth "Ｈｅｌｌｏ" is "Hello"
    assert l3.encode("Ｈｅｌｌｏ") == [lib3.token_to_id("Hello")]


# ------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def demo():
    m = tl.load_model("demo", backend="cpu", max_seq_len=64)
    yield m
    tl.free_model(m)


@pytest.fixture(scope="module")
def every(built, demo):
    """One tokenizer of each class: HFTokenizer byte-level and SentencePiece, BPETokenizer (the
    demo model's), ByteTokenizer."""
    return [HFTokenizer.from_json(built["llama3"]), HFTokenizer.from_json(built["llama2"]), demo.tokenizer,
            ByteTokenizer(256)]


@pytest.mark.parametrize("text, index", [("\ud800", 0), ("ab\udfff", 2), ("😀\ud83d", 1), ("\ud83d\ude00", 0)])
def test_lone_surrogates_are_refused_naming_them(every, text, index):
    """A str holding a surrogate code point is not Unicode text: every tokenizer refuses it with a
    TokenizerError that names the code point, its index and what is allowed (a surrogate pair
    written as two code points is two lone surrogates in a Python str)."""
    cp = re.escape(f"U+{ord(text[index]):04X}")
    for tok in every:
        with pytest.raises(TokenizerError, match=rf"surrogate.*{cp}.*index {index}.*U\+D800\.\.U\+DFFF"):
            tok.encode(text)


BAD_ID_SEQUENCES = [None, 5, 2.5, "12", b"ab", bytearray(b"a"), [True], [1, False], [1.0], [np.float64(2)],
                    [np.bool_(True)], ["3"], [None], [-1], [np.int64(-4)], np.array([1.0, 2.0])]


def test_bad_ids_are_typed_errors(every):
    """decode / push / token_bytes take integer token ids >= 0 (Python or numpy integers), as the
    engine's prompts do: bools, floats (even integral ones), strings, bytes, None and non-sequences
    are TokenizerErrors naming the value, never a TypeError or a silent id."""
    for tok in every:
        for bad in BAD_ID_SEQUENCES:
            with pytest.raises(TokenizerError, match=r"token id|sequence of token ids") as e:
                tok.decode(bad)
            assert "integer" in str(e.value), (tok, bad)
        for bad in (True, 1.0, "1", None, -1, np.float32(3)):
            with pytest.raises(TokenizerError, match="token id"):
                tok.token_bytes(bad)
            with pytest.raises(TokenizerError, match="token id"):
                tok.stream_decoder().push(bad)
        # numpy integers and arrays of them are token ids
        assert tok.decode(np.array([5, 6], dtype=np.int32)) == tok.decode([5, 6]) == tok.decode((np.uint8(5), 6))
        assert tok.token_bytes(np.int64(5)) == tok.token_bytes(5)


@pytest.mark.parametrize("huge", [2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64, 10 ** 30])
def test_ids_past_any_vocabulary_decode_to_nothing(every, huge):
    """Documented: an id without a token decodes to "" on every tokenizer, whatever its size (the
    library's u32 ids included), and decode equals the stream."""
    for tok in every:
        ids = tok.encode("hé 😀") + [huge]
        assert tok.decode(ids) == tok.decode(ids[:-1])
        pieces, rest = stream(tok.stream_decoder(), ids)
        assert "".join(pieces) + rest == tok.decode(ids)


def test_empty_text_and_ids(every):
    for tok in every:
        assert tok.encode("") == [] and tok.decode([]) == "" and tok.decode([], continuation=True) == ""
        assert stream(tok.stream_decoder(), []) == ([], "")


# -------------------------------------------------------------------------------- the demo model
@pytest.fixture(scope="module")
def gpt2_fast(demo, tmp_path_factory):
    """transformers' GPT-2 tokenizer over the demo tokenizer's vocab.json + merges.txt."""
    transformers = pytest.importorskip("transformers")
    e = demo.tokenizer.to_embedded()
    d = tmp_path_factory.mktemp("demo_tok")
    (d / "vocab.json").write_text(json.dumps(e["vocab"], ensure_ascii=False), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(e["merges"]) + "\n", encoding="utf-8")
    return transformers.GPT2TokenizerFast.from_pretrained(str(d))


@settings(max_examples=120, **SETTINGS)
@given(text=TEXT)
def test_demo_tokenizer_round_trips_and_matches_gpt2(demo, gpt2_fast, text):
    """The demo's byte-level BPE has every byte: any str without surrogates round-trips exactly,
    and encodes as transformers' GPT-2 tokenizer does wherever the text has no "<|endoftext|>"."""
    tok = demo.tokenizer
    assert isinstance(tok, BPETokenizer)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    pieces, rest = stream(tok.stream_decoder(), ids)
    assert "".join(pieces) == text and rest == ""
    if "<|endoftext|>" not in text:
        assert ids == gpt2_fast.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == gpt2_fast.decode(ids, clean_up_tokenization_spaces=False)


def test_demo_eos_text_is_ordinary_text(demo, gpt2_fast):
    """A vocab.json + merges.txt pair has no special tokens: "<|endoftext|>" in the text is encoded
    as text (transformers' GPT-2 tokenizer matches it as its special token by default: id 0, the
    demo's EOS), and decode gives the EOS id's text (transformers' decode default,
    skip_special_tokens=False); stream_text / generate_text leave the EOS out."""
    tok = demo.tokenizer
    eos = demo.cfg.eos_id
    assert eos == 0 and tok.token_bytes(eos) == b"<|endoftext|>"
    ids = tok.encode("a<|endoftext|>b")
    assert eos not in ids and tok.decode(ids) == "a<|endoftext|>b"
    want = [tok.encode("a")[0], eos, tok.encode("b")[0]]
    assert gpt2_fast.encode("a<|endoftext|>b", add_special_tokens=False) == want
    assert tok.decode([eos]) == gpt2_fast.decode([eos]) == "<|endoftext|>"
    assert "".join(_pieces(tok.stream_decoder(continuation=True), (t for t in ids + [eos]), demo.cfg.eos_ids)) == \
        "a<|endoftext|>b"
    assert all(len(tok.encode(bytes([b]).decode("latin-1"))) >= 1 for b in range(256))


# ---------------------------------------------------------------------- text API and stop sequences
@pytest.fixture(scope="module")
def sp_model(built, tmp_path_factory):
    """A tiny random model whose tokenizer is the Llama-2 layout (EOS "</s>" = 2, byte tokens 3..258)."""
    from conftest import write_tiny
    tok = HFTokenizer.from_json(built["llama2"], name="llama2")
    path = tmp_path_factory.mktemp("sp") / "sp.tinyloop"
    write_tiny(path, seed=5, vocab_size=tok.vocab_size, eos_id=2)
    m = tl.load_model(str(path), backend="cpu", max_seq_len=128, tokenizer=tok)
    yield m
    tl.free_model(m)


def _new(m, prompt, cfg):
    ids = m.tokenizer.encode(prompt)
    return tl.generate(m, prompt, cfg)[len(ids):]


def _text_of(m, new):
    return m.tokenizer.decode([t for t in new if t not in m.cfg.eos_ids], continuation=True)


@pytest.mark.parametrize("prompt", ["hello world", "日本語 🦀", "def f"])
def test_stop_sequences_at_token_and_character_edges(sp_model, prompt):
    m, tok = sp_model, sp_model.tokenizer
    base = tl.GenerateConfig(max_tokens=24, loops=2, temperature=1.0, sample_seed=3)
    new = _new(m, prompt, base)
    assert tl.generate_text(m, prompt, base) == _text_of(m, new)
    # transformers' text-generation pipeline (return_full_text=False) cuts the prompt's text off the
    # whole decoded text: the same completion text, its leading space kept
    ids = tok.encode(prompt)
    full = tok.decode(ids + [t for t in new if t not in m.cfg.eos_ids])
    assert full[len(tok.decode(ids)):] == tl.generate_text(m, prompt, base)
    # a stop sequence of every length 1..3 at every position: the output ends at its first occurrence
    for n in (1, 2, 3):
        for k in range(0, len(new) - n + 1, 3):
            stop = new[k:k + n]
            end = next(j + n for j in range(len(new)) if new[j:j + n] == stop)
            cfg = tl.GenerateConfig(max_tokens=24, loops=2, temperature=1.0, sample_seed=3,
                                    stop_sequences=[stop])
            got = _new(m, prompt, cfg)
            assert got == new[:end], (stop, got)
            text = tl.generate_text(m, prompt, cfg)
            assert text == _text_of(m, got)
            pieces = list(tl.stream_text(m, prompt, cfg))
            assert "".join(pieces) == text
            # a stop that ends inside a character leaves its bytes as one U+FFFD at the end; no piece
            # before the last holds a U+FFFD the text does not have
            assert sum(p.count("\ufffd") for p in pieces) == text.count("\ufffd")
    # stop sequences longer than the output, in the prompt only, or spanning the prompt's end do not stop
    for stop in (new + [new[-1]], ids[-2:] if len(ids) > 1 else ids, [ids[-1], new[0]]):
        if any(new[j:j + len(stop)] == stop for j in range(len(new))):
            continue
        cfg = tl.GenerateConfig(max_tokens=24, loops=2, temperature=1.0, sample_seed=3, stop_sequences=[stop])
        assert _new(m, prompt, cfg) == new, stop


def test_stop_sequence_config_errors(sp_model):
    for bad, match in (([[]], "non-empty"), (["\n\n"], "list of token ids"), ("ab", "token-id lists"),
                       ([[True]], "integers >= 0"), ([[1.5]], "integers >= 0"), ([[-1]], "integers >= 0")):
        with pytest.raises(TinyLoopError, match=match):
            tl.generate_text(sp_model, "hi", tl.GenerateConfig(max_tokens=2, stop_sequences=bad))
    with pytest.raises(TinyLoopError, match="outside the vocabulary"):
        tl.generate_text(sp_model, "hi", tl.GenerateConfig(max_tokens=2, stop_sequences=[[10 ** 6]]))


@settings(max_examples=80, **SETTINGS)
@given(text=TEXT)
def test_stream_pieces_are_whole_characters(built, text):
    """stream_text's pieces (api._pieces) over a completion's ids: whole characters only (a
    character split over byte-fallback tokens comes once its last byte is in), the pieces add up to
    the continuation text, and EOS ends the text without being part of it."""
    for name in ("llama2", "llama3"):
        tok = HFTokenizer.from_json(built[name])
        ids = tok.encode(text)
        eos = sorted(tok.special_ids)[0]
        pieces = list(_pieces(tok.stream_decoder(continuation=True), (t for t in ids + [eos]), (eos,)))
        whole = tok.decode(ids, continuation=True)
        assert "".join(pieces) == whole
        if "\ufffd" not in whole:
            assert all("\ufffd" not in p for p in pieces)


# ------------------------------------------------------------------------ server text stop strings
def _stop_strings(stops, pieces):
    from tinyloop.serve.worker import StopStrings
    s = StopStrings(stops)
    out = ""
    for p in pieces:
        out += s.push(p)
        if s.hit:
            return out, True
    return out + s.flush(), False


def _chunks(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@settings(max_examples=300, **SETTINGS)
@given(text=st.text("abc€😀", max_size=14),
       stops=st.lists(st.text("abc€😀", min_size=1, max_size=4), max_size=3), cuts=st.lists(st.integers(0, 20), max_size=6))
def test_server_stop_strings_do_not_depend_on_token_boundaries(text, stops, cuts):
    """Text stop strings (the server's): the completion is the text before the stop string that the
    text completes first, as if it arrived one character at a time (the decode loop stops at the
    token that completes a stop string), whatever pieces the tokens make."""
    want = _stop_strings(stops, list(text))
    assert _stop_strings(stops, _chunks(text, cuts)) == want
    assert _stop_strings(stops, [text]) == want
    done, hit = want
    assert hit == any(s in text for s in stops)
    assert not any(s in done for s in stops) and text.startswith(done)
