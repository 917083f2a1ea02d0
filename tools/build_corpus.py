#!/usr/bin/env python3
"""Build the demo model's training corpus, tokenizer and committed evaluation text.

The corpus is the running Python's own standard library sources (``.py`` files), which every
machine with Python has, so it needs no download. Everything is deterministic for a given Python
version (the version is recorded in split.json).

File selection (paths relative to ``sysconfig.get_paths()["stdlib"]``, "/" separated, sorted):

* walk the stdlib tree; skip the directories ``site-packages``, ``dist-packages`` and
  ``__pycache__`` anywhere, ``config-*`` (platform build files) at the top, ``encodings/`` (generated
  codec tables: mostly hex literals) and ``pydoc_data/`` (one generated 750 KB string literal);
* keep ``*.py`` files except ``_sysconfigdata*`` (platform-generated);
* the text must decode as strict UTF-8 (a leading BOM is dropped, CRLF becomes LF), must not be
  empty (whitespace only), must not contain the literal ``<|endoftext|>`` and must ``compile()``
  under the running Python (this drops the deliberately broken and Python-2 fixture files of the
  test suite);
* the test suite (``test/``, ``*/tests/``, ``idlelib/idle_test/``) is INCLUDED by default: it is
  ordinary Python and more than doubles the data, which matters for a model trained for several
  epochs; ``--no-tests`` leaves it out.

Held-out split: a file is held out when ``int(sha1(relpath).hexdigest(), 16) % 50 == 0`` (~2 %).

Outputs (``--out``, default ``build/demo/``, git-ignored):

* ``train.txt`` / ``heldout.txt``: the files of each side joined with ``"\\n\\n"``;
* ``vocab.json`` + ``merges.txt`` (GPT-2 format; also ``tokenizer.json``): a byte-level BPE
  (ByteLevel pre-tokenizer, add_prefix_space=False, all 256 bytes in the vocabulary) trained on the
  train side, vocabulary 4096 with ``<|endoftext|>`` as id 0 (the EOS id);
* ``train_ids.npy`` / ``heldout_ids.npy``: uint16 token ids, every file tokenized on its own and
  the files joined with the EOS id between them; tokenized with a tokenizer built from
  vocab.json/merges.txt exactly as ``tinyloop.model.tokenizer.BPETokenizer`` builds it;
* ``meta.json``: vocab_size, eos_id, token and byte counts (read by tools/train_demo.py);
* ``split.json``: Python version, the rules, the file lists of both sides and what was excluded.

Committed outputs (``--data-dir``, default ``data/``):

* ``heldout_eval.txt``: a fixed subset of the held-out files (sorted order, greedily taking every
  file that still fits under ``--eval-max-bytes``, default 500 000 bytes), joined with ``"\\n\\n"``,
  so perplexity reproduces on any machine whatever its Python version;
* ``split.json``: the same split description plus the files of heldout_eval.txt with their
  character lengths (so a tool can recover the file boundaries and insert EOS between files).

Usage: python tools/build_corpus.py [--out build/demo] [--data-dir data] [--no-tests]
Needs: numpy and tokenizers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import sysconfig
import time
import warnings

EOS = "<|endoftext|>"
SEP = "\n\n"
SKIP_DIRS_ANYWHERE = {"site-packages", "dist-packages", "__pycache__"}
SKIP_TOP_DIRS = {"encodings", "pydoc_data"}
TEST_DIRS = {"test", "tests", "idle_test"}


def is_test_path(rel: str) -> bool:
    return any(p in TEST_DIRS for p in rel.split("/")[:-1])


def is_heldout(rel: str, mod: int = 50) -> bool:
    return int(hashlib.sha1(rel.encode("utf-8")).hexdigest(), 16) % mod == 0


def load_source(path: str):
    """(text, None) for an accepted file, or (None, reason)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not utf-8"
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.replace("\r\n", "\n")
    if EOS in text:
        return None, "contains the EOS literal"
    if not text.strip():
        return None, "empty"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compile(text, path, "exec", dont_inherit=True)
        except Exception as e:  # SyntaxError, ValueError (null bytes), RecursionError, ...
            return None, f"does not compile ({type(e).__name__})"
    return text, None


def select_files(stdlib: str, include_tests: bool = True):
    """Returns (files: sorted list of (relpath, text), excluded: {relpath: reason})."""
    candidates = []
    for root, dirs, files in os.walk(stdlib):
        rel_root = os.path.relpath(root, stdlib)
        parts = [] if rel_root == "." else rel_root.split(os.sep)
        keep = []
        for d in dirs:
            if d in SKIP_DIRS_ANYWHERE:
                continue
            if not parts and (d in SKIP_TOP_DIRS or d.startswith("config-")):
                continue
            keep.append(d)
        dirs[:] = sorted(keep)
        for fn in files:
            if fn.endswith(".py") and not fn.startswith("_sysconfigdata"):
                candidates.append("/".join(parts + [fn]))
    candidates.sort()
    out, excluded = [], {}
    for rel in candidates:
        if not include_tests and is_test_path(rel):
            excluded[rel] = "test code (--no-tests)"
            continue
        text, why = load_source(os.path.join(stdlib, *rel.split("/")))
        if text is None:
            excluded[rel] = why
        else:
            out.append((rel, text))
    return out, excluded


def sha256_text(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def train_tokenizer(texts, vocab_size: int, min_frequency: int, out_dir: str):
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                            special_tokens=[EOS], show_progress=False)
    tok.save_model(out_dir)
    tok.save(os.path.join(out_dir, "tokenizer.json"))


def runtime_tokenizer(out_dir: str):
    """Tokenizer built from vocab.json + merges.txt the way tinyloop's BPETokenizer builds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE.from_file(os.path.join(out_dir, "vocab.json"),
                                         os.path.join(out_dir, "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def encode_docs(tok, texts, eos_id: int):
    import numpy as np
    encs = tok.encode_batch(list(texts), add_special_tokens=False)
    pieces, counts = [], []
    for i, e in enumerate(encs):
        if i:
            pieces.append(np.array([eos_id], dtype=np.int64))
        ids = np.asarray(e.ids, dtype=np.int64)
        if (ids == eos_id).any():
            raise RuntimeError(f"document {i} tokenized to the EOS id")
        pieces.append(ids)
        counts.append(len(ids))
    arr = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    if arr.size and arr.max() >= 65536:
        raise RuntimeError("token id does not fit uint16")
    return arr.astype(np.uint16), counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--out", default=os.path.join(repo, "build", "demo"))
    ap.add_argument("--data-dir", default=os.path.join(repo, "data"))
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--no-tests", action="store_true", help="leave the stdlib test suite out")
    ap.add_argument("--heldout-mod", type=int, default=50)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--eval-max-bytes", type=int, default=500_000)
    args = ap.parse_args(argv)
    import numpy as np

    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.data_dir, exist_ok=True)
    files, excluded = select_files(args.stdlib, include_tests=not args.no_tests)
    train = [(r, t) for r, t in files if not is_heldout(r, args.heldout_mod)]
    held = [(r, t) for r, t in files if is_heldout(r, args.heldout_mod)]
    train_txt = SEP.join(t for _, t in train)
    held_txt = SEP.join(t for _, t in held)
    for name, txt in (("train.txt", train_txt), ("heldout.txt", held_txt)):
        with open(os.path.join(args.out, name), "w", encoding="utf-8", newline="\n") as f:
            f.write(txt)
    print(f"selected {len(files)} files ({len(train)} train, {len(held)} held out), "
          f"{len(excluded)} excluded; {time.time() - t0:.1f}s", flush=True)

    # fixed evaluation subset of the held-out side
    eval_files, eval_bytes = [], 0
    for r, t in held:
        add = len(t.encode("utf-8")) + (len(SEP) if eval_files else 0)
        if eval_bytes + add <= args.eval_max_bytes:
            eval_files.append((r, t))
            eval_bytes += add
    eval_txt = SEP.join(t for _, t in eval_files)
    with open(os.path.join(args.data_dir, "heldout_eval.txt"), "w", encoding="utf-8", newline="\n") as f:
        f.write(eval_txt)

    # tokenizer
    t1 = time.time()
    train_tokenizer([t for _, t in train], args.vocab_size, args.min_frequency, args.out)
    with open(os.path.join(args.out, "vocab.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    eos_id = vocab[EOS]
    vocab_size = max(vocab.values()) + 1
    from tokenizers.pre_tokenizers import ByteLevel
    missing = sorted(set(ByteLevel.alphabet()) - set(vocab))
    if missing:
        raise RuntimeError(f"vocabulary lacks byte tokens {missing}")
    print(f"tokenizer: vocab {vocab_size}, eos_id {eos_id}; {time.time() - t1:.1f}s", flush=True)

    # tokenize
    t2 = time.time()
    tok = runtime_tokenizer(args.out)
    train_ids, train_counts = encode_docs(tok, [t for _, t in train], eos_id)
    held_ids, held_counts = encode_docs(tok, [t for _, t in held], eos_id)
    np.save(os.path.join(args.out, "train_ids.npy"), train_ids)
    np.save(os.path.join(args.out, "heldout_ids.npy"), held_ids)
    # lossless round trip on the held-out side
    for (r, t), e in zip(held, tok.encode_batch([t for _, t in held], add_special_tokens=False)):
        if tok.decode(e.ids, skip_special_tokens=False) != t:
            raise RuntimeError(f"{r}: tokenizer round trip is not lossless")
    cross = "skipped (tinyloop not importable)"
    try:
        sys.path.insert(0, repo)
        from tinyloop.model.tokenizer import BPETokenizer
        rt = BPETokenizer.from_dir(args.out)
        for r, t in held[:5]:
            if rt.encode(t) != tok.encode(t, add_special_tokens=False).ids:
                raise RuntimeError(f"{r}: tinyloop BPETokenizer disagrees with the corpus ids")
        cross = "tinyloop BPETokenizer agrees on 5 held-out files"
    except ImportError:
        pass
    print(f"tokenized: train {train_ids.size} tokens, held-out {held_ids.size}; cross-check: {cross}; "
          f"{time.time() - t2:.1f}s", flush=True)

    train_bytes = sum(len(t.encode("utf-8")) for _, t in train)
    held_bytes = sum(len(t.encode("utf-8")) for _, t in held)
    eval_tokens = sum(len(tok.encode(t, add_special_tokens=False).ids) for _, t in eval_files)
    stats = {
        "files": {"selected": len(files), "train": len(train), "heldout": len(held),
                  "heldout_eval": len(eval_files), "excluded": len(excluded)},
        "bytes": {"train": train_bytes, "heldout": held_bytes,
                  "heldout_eval_txt": len(eval_txt.encode("utf-8"))},
        "tokens": {"train_ids": int(train_ids.size), "heldout_ids": int(held_ids.size),
                   "heldout_eval_files": eval_tokens},
        "bytes_per_token_train": round(train_bytes / max(1, sum(train_counts)), 4),
    }
    rules = {
        "stdlib_dir": "sysconfig.get_paths()['stdlib']",
        "skip_dirs_anywhere": sorted(SKIP_DIRS_ANYWHERE),
        "skip_top_dirs": sorted(SKIP_TOP_DIRS) + ["config-*"],
        "skip_files": ["_sysconfigdata*"],
        "require": ["*.py", "strict utf-8 (BOM dropped, CRLF->LF)", "not empty", "compile() succeeds",
                    f"no literal {EOS}"],
        "include_tests": not args.no_tests,
        "heldout": f"int(sha1(relpath).hexdigest(), 16) % {args.heldout_mod} == 0",
        "text_separator": SEP,
        "ids": f"each file tokenized alone, files joined with eos_id={eos_id}",
        "heldout_eval": f"held-out files in sorted order, greedily kept while the joined text "
                        f"stays <= {args.eval_max_bytes} bytes",
    }
    tokenizer_info = {"type": "byte-level BPE (GPT-2 format)", "vocab_size": vocab_size,
                      "eos_token": EOS, "eos_id": eos_id, "min_frequency": args.min_frequency,
                      "tokenizers_version": __import__("tokenizers").__version__,
                      "merges_sha256": hashlib.sha256(
                          open(os.path.join(args.out, "merges.txt"), "rb").read()).hexdigest()}
    split = {
        "python_version": platform.python_version(),
        "rules": rules,
        "tokenizer": tokenizer_info,
        "stats": stats,
        "sha256": {"train.txt": sha256_text(train_txt), "heldout.txt": sha256_text(held_txt),
                   "heldout_eval.txt": sha256_text(eval_txt)},
        "train_files": [r for r, _ in train],
        "heldout_files": [r for r, _ in held],
        "heldout_eval_files": [{"path": r, "chars": len(t)} for r, t in eval_files],
        "excluded": excluded,
    }
    for d in (args.out, args.data_dir):
        with open(os.path.join(d, "split.json"), "w", encoding="utf-8") as f:
            json.dump(split, f, indent=1, sort_keys=False)
            f.write("\n")
    meta = {"vocab_size": vocab_size, "eos_id": eos_id, "python_version": platform.python_version(),
            **stats}
    with open(os.path.join(args.out, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(json.dumps(stats, indent=1))
    print(f"done in {time.time() - t0:.1f}s -> {args.out}, {args.data_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
