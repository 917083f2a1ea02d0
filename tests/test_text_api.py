"""Text in, text out; load_model's path argument; a model whose file changes after loading."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

import tinyloop as tl
from tinyloop.api import _pieces
from tinyloop.model.tokenizer import ByteTokenizer

TEXT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model(backend="cpu", max_seq_len=256)
    yield m
    tl.free_model(m)


def test_no_path_and_demo_load_the_shipped_model(demo):
    m = tl.load_model("demo", backend="cpu", max_seq_len=32)
    try:
        assert m.path == demo.path and m.path.endswith("demo.tinyloop")
        assert m.tokenizer.vocab_size <= m.vocab_size and m.tokenizer.decode(m.tokenizer.encode(TEXT)) == TEXT
    finally:
        tl.free_model(m)


def test_str_prompt_everywhere(demo):
    ids = demo.tokenizer.encode(TEXT)
    cfg = tl.GenerateConfig(max_tokens=6, loops=4)
    out = tl.generate(demo, ids, cfg)
    assert tl.generate(demo, TEXT, cfg) == out
    assert tl.generate_stream(demo, TEXT, cfg) == out
    assert list(tl.generate_iter(demo, TEXT, cfg)) == out[len(ids):]
    assert tl.generate_batch(demo, [TEXT, TEXT], cfg) == [out, out]
    spec = tl.SpeculativeConfig(max_tokens=6, draft_loops=2, verify_loops=4)
    assert tl.generate_speculative(demo, TEXT, spec) == out
    tree = tl.TreeSpeculativeConfig(max_tokens=6, draft_loops=2, verify_loops=4)
    assert tl.generate_tree_speculative(demo, TEXT, tree) == out
    assert (tl.score(demo, TEXT, loops=4) == tl.score(demo, ids, loops=4)).all()
    assert (tl.score_last_token(demo, TEXT, loops=4) == tl.score_last_token(demo, ids, loops=4)).all()
    assert tl.generate_text(demo, TEXT, cfg) == demo.tokenizer.decode(out[len(ids):])
    assert "".join(tl.stream_text(demo, TEXT, cfg)) == demo.tokenizer.decode(out[len(ids):])


def test_text_prompts_start_with_the_models_bos(tmp_path):
    """A model with a BOS id: a text prompt starts with it on every entry point (as `tinyloop run`,
    transformers' tokenizers and OpenAI-compatible servers do); token ids are used as given; the
    text after a prefix cache is a continuation and gets none; a prefix pool's scaffold and a
    prompt that starts with it agree."""
    from conftest import write_tiny
    path = tmp_path / "bos.tinyloop"
    write_tiny(path, seed=4, vocab_size=300, bos_id=299)
    m = tl.load_model(str(path), backend="cpu", max_seq_len=128)
    try:
        enc = m.tokenizer.encode
        ids = [299] + enc(TEXT)
        cfg = tl.GenerateConfig(max_tokens=6, loops=3)
        out = tl.generate(m, ids, cfg)
        assert tl.generate(m, TEXT, cfg) == out != tl.generate(m, enc(TEXT), cfg)
        assert tl.generate_batch(m, [TEXT, "x"], cfg) == [out, tl.generate(m, [299] + enc("x"), cfg)]
        assert tl.generate_speculative(m, TEXT, tl.SpeculativeConfig(max_tokens=6, draft_loops=1,
                                                                     verify_loops=3)) == out
        assert (tl.score(m, TEXT, loops=3) == tl.score(m, ids, loops=3)).all()
        assert tl.generate_text(m, TEXT, cfg) == m.tokenizer.decode(out[len(ids):])
        pc = tl.build_prefix_cache(m, "def ", loops=3)
        try:
            assert list(pc.prefix_ids) == [299] + enc("def ")
            got = tl.generate_from_prefix_cache(m, pc, "fibonacci(n):", cfg)
            assert got == tl.generate(m, [299] + enc("def ") + enc("fibonacci(n):"), cfg)
        finally:
            tl.free_prefix_cache(pc)
    finally:
        tl.free_model(m)


def test_stream_text_keeps_characters_whole():
    """A character whose bytes span several tokens comes out once, whole; the pieces join to the
    text; bytes that never complete a character end as U+FFFD."""
    tok = ByteTokenizer(256)
    text = "héllo ✓ 😀!"
    ids = tok.encode(text)
    assert len(ids) > len(text)

    def gen(seq):
        yield from seq
    pieces = list(_pieces(tok.stream_decoder(), gen(ids)))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert "✓" in pieces and "😀" in pieces
    assert "".join(_pieces(tok.stream_decoder(), gen(ids[:-2]))).endswith("\ufffd")


def test_bad_prompt_and_tokenizer_types(demo, tiny_path):
    for bad in (b"abc", bytearray(b"x"), 3.5, None, {"a": 1}):
        with pytest.raises(tl.InvalidInputError):
            tl.generate(demo, bad, tl.GenerateConfig(max_tokens=2))
    with pytest.raises(tl.InvalidInputError, match="at least 1 token"):
        tl.generate(demo, "", tl.GenerateConfig(max_tokens=2))
    for bad in (3, "", ["dir"], b"dir"):
        with pytest.raises(tl.ConfigError, match="tokenizer="):
            tl.load_model(str(tiny_path), backend="cpu", tokenizer=bad)
    with pytest.raises(tl.TokenizerError):
        tl.load_model(str(tiny_path), backend="cpu", tokenizer=ByteTokenizer(256))   # 256 ids > vocab 97
    byte = ByteTokenizer(256)
    m = tl.load_model("demo", backend="cpu", max_seq_len=32, tokenizer=byte)
    try:
        assert m.tokenizer is byte and tl.generate(m, "ab", tl.GenerateConfig(max_tokens=2))[:2] == [97, 98]
    finally:
        tl.free_model(m)


def test_path_types(tmp_path):
    r, w = os.pipe()
    try:
        for bad in (r, True, 2.0, [str(tmp_path)], b"/tmp/x.tinyloop"):
            with pytest.raises(tl.ConfigError, match="path="):
                tl.load_model(bad, backend="cpu")
        os.fstat(r)                                     # the descriptor was not taken (or closed)
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(tl.ModelFormatError, match="is a directory"):
        tl.load_model(str(tmp_path), backend="cpu")
    with pytest.raises(tl.ModelFormatError, match="cannot open"):
        tl.load_model(str(tmp_path / "missing.tinyloop"), backend="cpu")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifo_and_device_do_not_hang(tmp_path):
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    errors = []

    def load(p):
        try:
            tl.load_model(p, backend="cpu")
        except tl.ModelFormatError as e:
            errors.append(str(e))
    for p in (str(fifo), "/dev/zero", "/dev/null"):
        t = threading.Thread(target=load, args=(p,), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), f"load_model({p!r}) hangs"
    assert len(errors) == 3 and all("not a regular file" in e for e in errors)


def test_file_rewritten_or_truncated_after_load(tiny_path, tmp_path, prompt):
    """The model keeps no view of its file: truncating, rewriting or deleting it after load changes
    nothing (the tokens equal those of a model whose file was left alone)."""
    cfg = tl.GenerateConfig(max_tokens=8)
    ref_model = tl.load_model(str(tiny_path), backend="cpu", max_seq_len=64)
    ref = tl.generate(ref_model, prompt, cfg)
    tl.free_model(ref_model)
    for action in ("truncate", "rewrite", "delete"):
        p = tmp_path / f"{action}.tinyloop"
        shutil.copy(tiny_path, p)
        m = tl.load_model(str(p), backend="cpu", max_seq_len=64)
        try:
            if action == "truncate":
                os.truncate(p, 0)
            elif action == "rewrite":
                p.write_bytes(b"\xff" * os.path.getsize(tiny_path))
            else:
                p.unlink()
            assert tl.generate(m, prompt, cfg) == ref
        finally:
            tl.free_model(m)
