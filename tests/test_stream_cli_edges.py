"""Edges of the streaming / text layer and of `tinyloop run` that the earlier audits
(test_text_edges, test_stoppers, test_cli_errors, test_cli_run, test_model_file_cli_edges) leave
out: stop sequences checked against a reference cut computed here from an unconstrained run, the
stop reason when EOS, a stop sequence, max_tokens and the callback fall on one token, on_token
callbacks that cannot be called as on_token(token, position) (refused before any work) or that
raise (the model stays usable), early exits from generate_iter / stream_text, stream_text's text
against the tokenizer's decode of the ids, and run configs whose path fields have the wrong type,
hold a NUL byte, nest too deeply, or name a file that is not a model."""

from __future__ import annotations

import functools
import io
import json
import contextlib

import pytest

import tinyloop as tl
from tinyloop import GenerateConfig, GenerateStats, StopReason
from tinyloop.cli.main import main

PROMPT = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77]
N = 12


@pytest.fixture(scope="module")
def byte_path(tmp_path_factory):
    """A q4 model whose 300 ids cover every byte: the byte fallback tokenizer decodes its output,
    and sampled output holds multi-byte characters and invalid UTF-8."""
    from conftest import write_tiny
    p = tmp_path_factory.mktemp("stream") / "b.tinyloop"
    write_tiny(p, seed=1, vocab_size=300, eos_id=None, quant="q4", group_size=32)
    return p


@pytest.fixture(scope="module")
def model(byte_path):
    m = tl.load_model(str(byte_path), backend="cpu", max_seq_len=128)
    yield m
    tl.free_model(m)


def reference_cut(full, stops, max_tokens):
    """Where the documented rule ends an output whose unconstrained continuation is `full`: after
    the first token at which one of `stops` matches the tail of the output (prompt excluded), or
    after max_tokens."""
    for i in range(1, min(len(full), max_tokens) + 1):
        out = full[:i]
        if any(len(s) <= len(out) and tuple(out[-len(s):]) == tuple(s) for s in stops):
            return out, StopReason.STOP_SEQUENCE
    return full[:max_tokens], StopReason.MAX_TOKENS


SAMPLING = dict(temperature=0.9, top_k=200, sample_seed=11)
SPEC = dict(decoder="speculative", options=dict(draft_loops=1, verify_loops=3, draft_ahead=4))


# ------------------------------------------------------------------ stop sequences
@pytest.mark.parametrize("kw", [{}, SAMPLING, SPEC], ids=["greedy", "sampling", "speculative"])
def test_stop_sequences_cut_where_the_reference_says(model, kw):
    """Stop sequences that match the first generated token, overlap each other, occur only inside
    the prompt, span the prompt's end and the first token, or are longer than the output: every
    entry point ends exactly where the rule, applied here to an unconstrained run, ends it."""
    cfg = GenerateConfig(max_tokens=N, loops=3, **kw)
    full = tl.generate(model, PROMPT, cfg)[len(PROMPT):]
    cases = [
        ([[full[0]]], N),                                  # the first generated token
        ([full[1:3], [full[2]]], N),                       # overlapping: both end at token 2
        ([full[2:4], full[1:3]], N),                       # overlapping, the earlier one wins
        ([PROMPT[-3:], PROMPT[:2]], N),                    # inside the prompt only: no stop
        ([[PROMPT[-1], full[0]]], N),                      # spans the prompt's end: no stop
        ([full + [full[-1]]], N),                          # longer than the output: no stop
        ([full[4:6]], 5),                                  # max_tokens first
        ([full[4:6]], 6),                                  # the sequence and max_tokens on one token
    ]
    for stops, mt in cases:
        want, reason = reference_cut(full, stops, mt)
        c = cfg.replace(max_tokens=mt, stop_sequences=stops)
        for how in ("generate", "iter", "stream_text"):
            st = GenerateStats()
            if how == "generate":
                got = tl.generate(model, PROMPT, c, stats=st)[len(PROMPT):]
            elif how == "iter":
                got = list(tl.generate_iter(model, PROMPT, c, stats=st))
            else:
                text = "".join(tl.stream_text(model, PROMPT, c, stats=st))
                assert text == model.tokenizer.decode(want, continuation=True), (stops, mt)
                got = want
            assert (got, st.stop_reason, st.tokens_emitted) == (want, reason, len(want)), (how, stops, mt)


def test_eos_stop_sequence_max_tokens_and_callback_on_one_token(byte_path, model, tmp_path):
    """Four rules fire on the same token: the documented order decides (callback, EOS, stop
    sequence, max_tokens), the token is in the ids, and the text leaves EOS out."""
    from conftest import write_tiny
    cfg = GenerateConfig(max_tokens=N, loops=3)
    full = tl.generate(model, PROMPT, cfg)[len(PROMPT):]
    k = 3
    eos = full[k]
    assert eos not in full[:k]
    path = tmp_path / "eos.tinyloop"
    write_tiny(path, seed=1, vocab_size=300, eos_id=eos, quant="q4", group_size=32)   # same weights
    m = tl.load_model(str(path), backend="cpu", max_seq_len=128)
    try:
        want = full[:k + 1]
        both = cfg.replace(max_tokens=k + 1, stop_sequences=[[eos], full[k - 1:k + 1]])
        for c, reason in ((cfg, StopReason.EOS), (both, StopReason.EOS),
                          (cfg.replace(max_tokens=k + 1), StopReason.EOS)):
            st = GenerateStats()
            assert tl.generate(m, PROMPT, c, stats=st)[len(PROMPT):] == want
            assert (st.stop_reason, st.tokens_emitted) == (reason, k + 1)
        st = GenerateStats()
        seen = []
        out = tl.generate_stream(m, PROMPT, both, stats=st,
                                 on_token=lambda t, pos: seen.append((t, pos)) or t != eos)
        assert out[len(PROMPT):] == want and st.stop_reason == StopReason.CALLBACK_ABORT
        assert seen == [(t, len(PROMPT) + i) for i, t in enumerate(want)]
        st = GenerateStats()
        text = "".join(tl.stream_text(m, PROMPT, both, stats=st))
        assert text == m.tokenizer.decode(want[:-1], continuation=True) == tl.generate_text(m, PROMPT, both)
        assert st.stop_reason == StopReason.EOS and st.tokens_emitted == k + 1
    finally:
        tl.free_model(m)


# ------------------------------------------------------------------ on_token callbacks
class Boom(Exception):
    pass


def test_on_token_that_cannot_take_token_and_position_is_refused_before_any_work(model):
    """A callable that cannot be called as on_token(token, position) is an InvalidInputError at the
    call, before the prompt is prefilled (it used to be a TypeError from inside the decode loop
    after the first token); callables that can are accepted, whatever their form."""
    cfg = GenerateConfig(max_tokens=4, loops=3)
    ref = tl.generate(model, PROMPT, cfg)

    def three(t, pos, extra):
        return True

    def kw_only(t, pos, *, flag):
        return True

    for bad in (lambda t: True, lambda: True, three, kw_only, functools.partial(lambda a, t, pos: True, 1, 2)):
        st = GenerateStats()
        with pytest.raises(tl.InvalidInputError, match="on_token"):
            tl.generate_stream(model, PROMPT, cfg, on_token=bad, stats=st)
        assert st.stop_reason is None and st.tokens_emitted == 0 and st.prefill_ms == 0.0
    pc = tl.build_prefix_cache(model, PROMPT[:4], loops=3)
    try:
        with pytest.raises(tl.InvalidInputError, match="on_token"):
            tl.generate_from_prefix_cache(model, pc, PROMPT[4:], cfg, on_token=lambda t: True)
    finally:
        tl.free_prefix_cache(pc)

    class Counter:
        def __init__(self):
            self.n = 0

        def __call__(self, token, position):
            self.n += 1
            return True

    c = Counter()
    good = (c, lambda *a: True, lambda t, pos, extra=None: True, functools.partial(lambda a, t, pos: True, 1),
            max, lambda t, pos: None)
    for ok in good:
        assert tl.generate_stream(model, PROMPT, cfg, on_token=ok) == ref
    assert c.n == 4


def test_only_false_from_on_token_aborts(model):
    """The documented rule (CallbackStopper): False (or numpy's False) aborts after the token;
    other falsy results (None from a callback that returns nothing, 0, "") go on."""
    cfg = GenerateConfig(max_tokens=5, loops=3)
    ref = tl.generate(model, PROMPT, cfg)
    for ret in (None, 0, "", [], 0.0):
        st = GenerateStats()
        assert tl.generate_stream(model, PROMPT, cfg, on_token=lambda t, pos, r=ret: r, stats=st) == ref
        assert st.stop_reason == StopReason.MAX_TOKENS
    st = GenerateStats()
    assert tl.generate_stream(model, PROMPT, cfg, on_token=lambda t, pos: False, stats=st) == ref[:len(PROMPT) + 1]
    assert st.stop_reason == StopReason.CALLBACK_ABORT and st.tokens_emitted == 1


@pytest.mark.parametrize("kw", [{}, SAMPLING, SPEC, dict(beam_size=2)],
                         ids=["greedy", "sampling", "speculative", "beam"])
def test_on_token_exception_propagates_and_leaves_the_model_usable(model, kw):
    cfg = GenerateConfig(max_tokens=8, loops=3, **kw)
    ref_st = GenerateStats()
    ref = tl.generate(model, PROMPT, cfg, stats=ref_st)
    base = tl.vram_usage_bytes(model)
    for k in (0, 4):
        raised = Boom(k)

        def cb(t, pos, k=k):
            if pos == len(PROMPT) + k:
                raise raised
            return True
        st = GenerateStats()
        with pytest.raises(Boom) as e:
            tl.generate_stream(model, PROMPT, cfg, on_token=cb, stats=st)
        assert e.value is raised
        assert st.stop_reason == StopReason.CALLBACK_ABORT and st.tokens_emitted == k + 1
        assert tl.vram_usage_bytes(model) == base
        st = GenerateStats()
        assert tl.generate(model, PROMPT, cfg, stats=st) == ref and st.stop_reason == ref_st.stop_reason


# ------------------------------------------------------------------ leaving a stream early
def test_leaving_generate_iter_and_stream_text_early_frees_the_model(model):
    cfg = GenerateConfig(max_tokens=N, loops=3, **SAMPLING)
    ref = tl.generate(model, PROMPT, cfg)
    base = tl.vram_usage_bytes(model)

    st = GenerateStats()
    for i, tok in enumerate(tl.generate_iter(model, PROMPT, cfg, stats=st)):
        assert tok == ref[len(PROMPT) + i]
        if i == 2:
            break
    assert st.stop_reason == StopReason.CALLBACK_ABORT and st.tokens_emitted == 3
    assert tl.generate(model, PROMPT, cfg) == ref and tl.vram_usage_bytes(model) == base
    st = GenerateStats()
    for i, tok in enumerate(tl.generate_iter(model, PROMPT, cfg, stats=st)):
        if i == N - 1:
            break                                     # leaving after the last token: nothing was cut
    assert st.stop_reason == StopReason.MAX_TOKENS and st.tokens_emitted == N

    it = tl.generate_iter(model, PROMPT, cfg)
    assert next(it) == ref[len(PROMPT)]
    with pytest.raises(tl.ModelBusyError):            # the suspended request holds the model ...
        tl.generate(model, PROMPT, cfg)
    it.close()                                        # ... until it is closed
    it.close()
    assert list(it) == []
    assert tl.generate(model, PROMPT, cfg) == ref

    st = GenerateStats()
    s = tl.stream_text(model, PROMPT, cfg, stats=st)
    assert tl.generate(model, PROMPT, cfg) == ref     # nothing is held before the first next()
    next(s)
    s.close()
    assert st.stop_reason == StopReason.CALLBACK_ABORT and 1 <= st.tokens_emitted < N
    assert tl.generate(model, PROMPT, cfg) == ref and tl.vram_usage_bytes(model) == base
    never = tl.stream_text(model, PROMPT, cfg)        # made, never started, dropped
    del never
    assert tl.generate(model, PROMPT, cfg) == ref


# ------------------------------------------------------------------ stream_text's UTF-8
def test_stream_text_equals_the_tokenizer_decode_of_the_ids(model):
    """Sampled byte-level output splits multi-byte characters across tokens and holds invalid
    sequences: the pieces are whole text (no piece ends inside a character a later token
    completes), they join to decode(ids) and to generate_text."""
    tok = model.tokenizer
    multi = invalid = 0
    for seed in range(6):
        cfg = GenerateConfig(max_tokens=24, loops=3, temperature=1.0, top_k=300, sample_seed=seed)
        ids = tl.generate(model, PROMPT, cfg)[len(PROMPT):]
        want = tok.decode(ids, continuation=True)
        pieces = list(tl.stream_text(model, PROMPT, cfg))
        assert "".join(pieces) == want == tl.generate_text(model, PROMPT, cfg)
        assert all(pieces)
        # the text up to each piece is the decode of some prefix of the ids
        prefixes = {tok.decode(ids[:i], continuation=True) for i in range(len(ids) + 1)}
        acc = ""
        for p in pieces:
            acc += p
            assert acc in prefixes or acc == want
        multi += any(len(ch.encode("utf-8")) > 1 and ch != "\ufffd" for ch in want)
        invalid += "\ufffd" in want
    assert multi and invalid          # the property was exercised on both kinds of bytes


# ------------------------------------------------------------------ tinyloop run
def _run(tmp_path, text, *extra, name="cfg.yaml"):
    (tmp_path / name).write_text(text, encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["run", str(tmp_path / name), *extra])
    return rc, out.getvalue(), err.getvalue()


def _one_error(rc, err, *words):
    lines = [ln for ln in err.splitlines() if not ln.startswith("[tinyloop]")]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.mark.parametrize("key, value", [
    ("tokenizer", "5"), ("tokenizer", "[a, b]"), ("prompts_file", "7"), ("prompts_file", "{a: 1}"),
    ("output_jsonl", "true"), ("output_jsonl", "[o.jsonl]"),
])
def test_run_config_path_fields_of_the_wrong_type(tmp_path, key, value):
    """A path field that is not text is a ConfigError naming the key (was a TypeError traceback
    from os.path)."""
    rc, out, err = _run(tmp_path, f"prompts: [x]\nbackend: cpu\n{key}: {value}\n")
    _one_error(rc, err, key)
    assert out == ""


@pytest.mark.parametrize("key", ["prompts_file", "output_jsonl"])
def test_run_config_path_with_a_nul_byte(byte_path, tmp_path, key):
    """A NUL byte in a path is a ConfigError naming the key, before any decoding (output_jsonl's
    used to be a ValueError traceback after every prompt had been decoded)."""
    rc, out, err = _run(tmp_path, f'model: {json.dumps(str(byte_path))}\nbackend: cpu\nmax_seq_len: 64\n'
                                  f'prompts: [x]\n{key}: "a\\0b"\ngenerate: {{max_tokens: 2}}\n')
    _one_error(rc, err, key)
    assert out == ""


def test_config_nested_too_deeply_is_a_clear_error(tmp_path):
    """YAML nested past the parser's recursion limit is an error naming the file, for run and serve
    configs (was a RecursionError traceback)."""
    deep = "prompts: " + "[" * 5000 + "]" * 5000 + "\n"
    rc, _, err = _run(tmp_path, deep)
    _one_error(rc, err, "cfg.yaml")
    (tmp_path / "serve.yaml").write_text("host: " + "[" * 5000 + "]" * 5000 + "\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["serve", "--config", str(tmp_path / "serve.yaml")])
    _one_error(rc, err.getvalue(), "serve.yaml")


@pytest.mark.parametrize("content", [b"", b"hello\n", "truncated"])
def test_model_that_is_not_a_model_file_is_named(tmp_path, content):
    """A run whose model is empty, text or a truncated model file: one error line that names the
    file (the format error alone did not say which of the config's paths it was about)."""
    path = tmp_path / "m.tinyloop"
    if content == "truncated":
        from tinyloop.models import demo_model_path
        with open(demo_model_path(), "rb") as f:
            data = f.read()
        content = data[:len(data) // 2]
    path.write_bytes(content)
    rc, out, err = _run(tmp_path, "model: m.tinyloop\nprompts: [x]\nbackend: cpu\n")
    _one_error(rc, err, str(path))
    assert out == ""


@pytest.mark.parametrize("command", ["run", "inspect", "convert", "synth", "ppl", "lens", "bench", "benchmark",
                                     "serve"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    name = "bench" if command == "benchmark" else command       # an alias prints its command's usage
    assert out.startswith(f"usage: tinyloop {name}") and "--help" in out


def test_run_prints_and_writes_what_generate_text_gives(byte_path, model, tmp_path):
    """The streamed terminal text, the --no-stream text and the JSONL record all equal the Python
    API's for the same config (sampled byte-level output: characters split across tokens)."""
    prompts = ["abc", "x = 1"]
    cfg = GenerateConfig(max_tokens=20, loops=3, temperature=1.0, top_k=300, sample_seed=4,
                         stop_sequences=[[262, 263]])
    text = (f"model: {json.dumps(str(byte_path))}\nbackend: cpu\nmax_seq_len: 64\nprompts: {json.dumps(prompts)}\n"
            f"output_jsonl: o.jsonl\ngenerate: {{max_tokens: 20, loops: 3, temperature: 1.0, top_k: 300, "
            f"sample_seed: 4, stop_sequences: [[262, 263]]}}\n")
    want = [tl.generate_text(model, p, cfg) for p in prompts]
    assert any(len(ch.encode("utf-8")) > 1 for w in want for ch in w)
    expect_out = "".join(p + w + "\n\n" for p, w in zip(prompts, want))
    for extra in ((), ("--no-stream",)):
        rc, out, err = _run(tmp_path, text, *extra)
        assert rc == 0, err
        assert out == expect_out
        recs = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text(encoding="utf-8").splitlines()]
        for rec, p, w in zip(recs, prompts, want):
            ids = model.tokenizer.encode(p)
            assert rec["prompt"] == p and rec["completion"] == w and rec["prompt_ids"] == ids
            st = GenerateStats()
            assert rec["output_ids"] == tl.generate(model, p, cfg, stats=st)[len(ids):]
            assert rec["stats"]["stop_reason"] == st.stop_reason.value
            assert rec["stats"]["tokens_emitted"] == st.tokens_emitted
        assert err.count("[tinyloop] ") == 1 + len(prompts)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_prompts_file_with_a_byte_order_mark(tmp_path, suffix):
    """A UTF-8 byte order mark (what Windows editors write first) is not part of the first prompt:
    it was tokenized into a plain-text file's first prompt and made a JSONL file's first line an
    error."""
    from tinyloop.cli.run import read_prompts
    from tinyloop.runtime.config import RunConfig
    prompts = ["def f():", "x = '\u00e9'"]
    body = ("".join(p + "\n" for p in prompts) if suffix == ".txt" else
            "".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    path = tmp_path / f"p{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    assert read_prompts(RunConfig(prompts_file=str(path)), tmp_path) == prompts


@pytest.mark.parametrize("args, what", [(["--loops", "2,0"], "loops=0"),
                                        (["--cache-mode", "fp16,bogus"], "bogus")])
def test_ppl_checks_every_depth_and_cache_mode_before_the_first_window(tmp_path, capsys, args, what):
    """The second of two depths (or cache modes) out of range is refused before anything is scored
    (the first one's windows used to be scored, and its row printed, before the error)."""
    from tinyloop.models import demo_model_path
    (tmp_path / "t.txt").write_text("def f(x):\n    return x + 1\n" * 40, encoding="utf-8")
    rc = main(["ppl", demo_model_path(), "--text", str(tmp_path / "t.txt"), "--backend", "cpu",
               "--window", "16", "--max-windows", "2", *args])
    out, err = capsys.readouterr()
    _one_error(rc, err, what)
    assert out == ""
