"""Leftover edges of the typed-error standard: a malformed model file's error names the file for
every caller; score_with_consistency_escalation's threshold default and its cleanup under a
concurrent request; score_decoded's refusal of decoding knobs and its stats; token ids that are
not a sequence; apply_chat_template's argument order and template failures; empty output paths
(run --output-jsonl, the YAML's output_jsonl, synth -o)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.cli.main import main
from tinyloop.errors import ConfigError, InvalidInputError, ModelFormatError, TokenizerError

from conftest import write_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("leftover") / "tiny.tinyloop"
    write_tiny(p)
    m = tl.load_model(str(p), max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model("demo", max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


# ================================================================ 1. the file is named
def _bad_version(tmp_path):
    """A model file whose format version is 7: the reader's own words name no file."""
    p = tmp_path / "badver.tinyloop"
    write_tiny(p)
    raw = bytearray(p.read_bytes())
    raw[8:12] = struct.pack("<I", 7)
    p.write_bytes(bytes(raw))
    return p


def _truncated(tmp_path):
    p = tmp_path / "short.tinyloop"
    write_tiny(p)
    raw = p.read_bytes()
    p.write_bytes(raw[:len(raw) - 100])
    return p


@pytest.mark.parametrize("make", [_bad_version, _truncated])
def test_model_format_errors_name_the_file_for_python_callers(tmp_path, make):
    from tinyloop.model.format import open_model, read_header
    path = str(make(tmp_path))
    calls = {"load_model": lambda: tl.load_model(path, max_seq_len=16, backend="cpu"),
             "inspect": lambda: tl.inspect(path),
             "open_model": lambda: open_model(path),
             "read_header": lambda: read_header(path)}
    for name, call in calls.items():
        with pytest.raises(ModelFormatError) as e:
            call()
        assert type(e.value) is ModelFormatError, name
        msg = str(e.value)
        assert repr(path) in msg, (name, msg)
        assert msg.count(path) == 1, (name, msg)


def test_model_format_errors_name_the_file_once_in_the_cli(tmp_path, capsys):
    path = str(_bad_version(tmp_path))
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x\n", encoding="utf-8")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {path}\nbackend: cpu\nmax_seq_len: 32\nprompts: [hi]\n", encoding="utf-8")
    commands = {"inspect": ["inspect", path],
                "ppl": ["ppl", path, "--text", str(text), "--backend", "cpu"],
                "lens": ["lens", path, "--text", "x = 1", "--backend", "cpu", "-o", str(tmp_path / "l.png")],
                "run": ["run", str(cfg)]}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        del commands["lens"]
    for name, argv in commands.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (name, err)
        assert "unsupported format version 7" in err[0] and err[0].count(path) == 1, (name, err[0])


# ================================================================ 2. the threshold has no default
@pytest.mark.parametrize("criterion", [None, "entropy", "margin"])
def test_escalation_threshold_none_is_a_clear_config_error(tiny, criterion):
    base = tl.vram_usage_bytes(tiny)
    args = () if criterion is None else (criterion,)
    with pytest.raises(ConfigError) as e:
        tl.score_with_consistency_escalation(tiny, [1, 2, 3, 4], 2, 4, *args)
    msg = str(e.value)
    assert "threshold=None" in msg and "needs a threshold" in msg and "disagreement" in msg, msg
    assert repr(criterion or "entropy") in msg
    assert tl.vram_usage_bytes(tiny) == base and not tiny._handles


def test_escalation_disagreement_runs_with_the_default_threshold(tiny):
    r = tl.score_with_consistency_escalation(tiny, [1, 2, 3, 4], 2, 4, "disagreement")
    assert r.logits.shape == (4, tiny.cfg.vocab_size)


# ================================================================ 3. the cleanup never masks the error
class _Intruder:
    """Another thread that takes the model the moment the escalation call lets go of it."""

    def __init__(self, model, monkeypatch):
        from tinyloop.runtime import engine
        self.model, self.took = model, False
        real = engine._RequestLock.release

        def release(lock):
            real(lock)
            if not self.took and lock.model is model:
                self.took = model._lock.acquire(blocking=False)
        monkeypatch.setattr(engine._RequestLock, "release", release)

    def leave(self):
        if self.took:
            self.model._lock.release()
            self.took = False


def test_escalation_error_is_not_masked_when_another_request_takes_the_model(tiny, monkeypatch):
    from tinyloop.analysis import scoring
    base = tl.vram_usage_bytes(tiny)

    def boom(*a, **k):
        raise RuntimeError("boom in the low pass")
    monkeypatch.setattr(scoring, "_handle_logits", boom)
    intruder = _Intruder(tiny, monkeypatch)
    try:
        with pytest.raises(RuntimeError, match="boom in the low pass"):
            tl.score_with_consistency_escalation(tiny, [1, 2, 3, 4, 5], 2, 4, "entropy", 0.5)
    finally:
        intruder.leave()
    assert not tiny._handles and tl.vram_usage_bytes(tiny) == base


def test_escalation_holds_the_model_from_build_to_free(tiny, monkeypatch):
    """No window between building the working handle and taking the model: a request that takes
    the model whenever the call lets go of it cannot make the call fail or leak its handle."""
    ids = [1, 2, 3, 4, 5, 6]
    want = tl.score_with_consistency_escalation(tiny, ids, 2, 4, "margin", 0.9)
    base = tl.vram_usage_bytes(tiny)
    intruder = _Intruder(tiny, monkeypatch)
    try:
        got = tl.score_with_consistency_escalation(tiny, ids, 2, 4, "margin", 0.9)
        assert intruder.took           # the intruder did take the model, once the call was done
    finally:
        intruder.leave()
    assert np.array_equal(got.logits, want.logits) and np.array_equal(got.depth, want.depth)
    assert not tiny._handles and tl.vram_usage_bytes(tiny) == base


def test_escalation_on_a_busy_model_builds_nothing(tiny):
    base = tl.vram_usage_bytes(tiny)
    assert tiny._lock.acquire(blocking=False)
    try:
        with pytest.raises(tl.ModelBusyError):
            tl.score_with_consistency_escalation(tiny, [1, 2, 3], 2, 4, "entropy", 0.5)
    finally:
        tiny._lock.release()
    assert not tiny._handles and tl.vram_usage_bytes(tiny) == base


# ================================================================ 4. score_decoded's terms and stats
@pytest.mark.parametrize("kw, named", [
    (dict(beam_size=2), "beam_size=2"),
    (dict(decoder="beam", beam_size=3), "decoder='beam'"),
    (dict(temperature=0.8, sample_seed=3), "temperature=0.8"),
    (dict(decoder="sampling", temperature=0.7), "decoder='sampling'"),
    (dict(top_k=5), "top_k=5"),
])
def test_score_decoded_refuses_decoding_knobs_in_its_own_terms(tiny, monkeypatch, kw, named):
    calls = []
    monkeypatch.setattr(tiny.backend, "alloc_cache", lambda *a: calls.append(a))
    with pytest.raises(tl.IncompatibleModesError) as e:
        tl.score_decoded(tiny, [1, 2, 3], tl.GenerateConfig(**kw))
    msg = str(e.value)
    assert "score_decoded" in msg and named in msg and "decoder None or 'greedy'" in msg, msg
    assert "decoder 'greedy' ignores" not in msg
    assert calls == []


def test_score_decoded_fills_its_stats(tiny):
    ids = [1, 2, 3, 4, 5]
    st = tl.GenerateStats(decoder="stale", tokens_emitted=9)
    out = tl.score_decoded(tiny, ids, tl.GenerateConfig(loops=2), stats=st)
    assert out.shape == (5, tiny.cfg.vocab_size)
    assert st.decoder == "greedy" and st.stop_reason == tl.StopReason.MAX_TOKENS
    assert st.tokens_emitted == 0 and st.loops_used == 2 and st.decode_ms > 0 and st.prefill_ms > 0
    st2 = tl.GenerateStats()
    tl.score_decoded(tiny, ids, tl.GenerateConfig(decoder="greedy"), stats=st2)   # greedy named: fine
    assert st2.decoder == "greedy" and st2.stop_reason == "MAX_TOKENS"


# ================================================================ 5. token ids that are not a sequence
@pytest.mark.parametrize("make, name", [
    (lambda: (t for t in [1, 2, 3]), "generator"),
    (lambda: iter([1, 2, 3]), "list_iterator"),
    (lambda: {1, 2, 3}, "set"),
    (lambda: frozenset({1, 2}), "frozenset"),
    (lambda: {1: 2}, "dict"),
    (lambda: 5, "int"),
])
def test_non_sequence_token_ids_name_their_type(tiny, make, name):
    base = tl.vram_usage_bytes(tiny)
    calls = {"generate": lambda t: tl.generate(tiny, t, tl.GenerateConfig(max_tokens=2)),
             "score": lambda t: tl.score(tiny, t, loops=2),
             "score_decoded": lambda t: tl.score_decoded(tiny, t),
             "score_last_token": lambda t: tl.score_last_token(tiny, t)}
    for call_name, call in calls.items():
        with pytest.raises(InvalidInputError) as e:
            call(make())
        msg = str(e.value)
        assert "list / tuple / numpy array of token ids" in msg and f"got {name}" in msg, (call_name, msg)
        assert "dtype object" not in msg
    assert tl.vram_usage_bytes(tiny) == base


# ================================================================ 6. apply_chat_template
def test_chat_arguments_are_checked_before_the_missing_template(tiny, demo):
    assert demo.tokenizer.chat_template is None
    for m in (tiny, demo):        # (tiny's tokenizer cannot even be built: the arguments come first)
        for bad in ("hello", [], [{"role": "user"}], [{"content": "x"}]):
            with pytest.raises(InvalidInputError, match="messages"):
                tl.apply_chat_template(m, bad)
        with pytest.raises(InvalidInputError, match="add_generation_prompt"):
            tl.apply_chat_template(m, [{"role": "user", "content": "x"}], add_generation_prompt="yes")
        with pytest.raises(InvalidInputError, match="set by the renderer"):
            tl.apply_chat_template(m, [{"role": "user", "content": "x"}], eos_token="x")
    with pytest.raises(TokenizerError, match="no chat template"):
        tl.apply_chat_template(demo, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("template, cause", [
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ 2.0 ** 5000 }}", "OverflowError"),
    ("{% for i in range(10 ** 12) %}{% endfor %}", "OverflowError"),
    ("{{ messages[0]['content'] | int / 0 }}", "ZeroDivisionError"),
])
def test_chat_template_failures_are_tokenizer_errors(demo, template, cause):
    pytest.importorskip("jinja2")
    tok = demo.tokenizer
    tok.chat_template = template
    try:
        for tokenize in (True, False):
            with pytest.raises(TokenizerError, match=f"chat template failed.*{cause}"):
                tl.apply_chat_template(demo, [{"role": "user", "content": "3"}], tokenize=tokenize)
    finally:
        tok.chat_template = None


# ================================================================ 7. run --output-jsonl ''
def test_run_refuses_an_empty_output_jsonl(tmp_path, capsys, monkeypatch):
    import tinyloop.cli.run as run_cli

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(run_cli, "load_model", no_load)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("backend: cpu\nmax_seq_len: 32\nprompts: [hi]\ngenerate: {max_tokens: 2}\n", encoding="utf-8")
    assert main(["run", str(cfg), "--output-jsonl", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--output-jsonl '' is empty" in err[0], err
    cfg.write_text("backend: cpu\nmax_seq_len: 32\nprompts: [hi]\noutput_jsonl: ''\n", encoding="utf-8")
    assert main(["run", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "output_jsonl '' is empty" in err[0] and str(cfg) in err[0], err
    from tinyloop.runtime.config import RunConfig
    with pytest.raises(ConfigError, match="output_jsonl '' is empty"):
        RunConfig(output_jsonl="")
    assert RunConfig(output_jsonl=None).output_jsonl is None


# ================================================================ 8. synth -o ''
def test_synth_refuses_an_empty_output_path_before_work(tmp_path, capsys, monkeypatch):
    from tinyloop.cli import synth
    from tinyloop.model.arch import ModelConfig
    from tinyloop.model.format import write_model
    made = []
    real = synth.RandomWeights.__getitem__
    monkeypatch.setattr(synth.RandomWeights, "__getitem__", lambda self, n: (made.append(n), real(self, n))[1])
    monkeypatch.chdir(tmp_path)
    assert main(["synth", "--preset", "tiny", "-o", ""]) == 2
    err = capsys.readouterr().err
    assert "cannot write model file ''" in err and ".tmp" not in err, err
    assert made == [] and list(tmp_path.iterdir()) == []
    for bad in (None, 3):
        with pytest.raises(ConfigError, match="must be a str or os.PathLike"):
            synth.synth_model("tiny", bad)
    with pytest.raises(ConfigError, match="NUL"):
        synth.synth_model("tiny", "a\0b.tinyloop")
    assert made == []
    from conftest import TINY, random_weights
    cfg = ModelConfig(**TINY)
    with pytest.raises(ConfigError, match="non-empty file path"):
        write_model("", cfg, random_weights(cfg))
    assert list(tmp_path.iterdir()) == []
