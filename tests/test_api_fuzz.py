"""A fuzz of the public Python API: every argument of the public functions, constructors and the
methods of the objects they return, given adversarial values (wrong types, numpy scalars and arrays
of other dtypes and shapes, objects whose __iter__ / __index__ raise), raises only a TinyLoopError
subclass naming the argument; afterwards the model still decodes the same tokens and holds no more
memory or handles. (tests/test_typed_errors.py pins the basic wrong types of the entry points.)

Defects this file found (each test failed before its fix):

* numpy.timedelta64 counts among numpy's integers (np.signedinteger), so every "a numpy integer
  is an integer" coercion called int() on a duration: TypeError (or OverflowError in lane_seed)
  from GenerateConfig / SpeculativeConfig / the decoders' options fields and from the loops /
  count arguments of score*, build_prefix_cache, register_prefix, build_resume_handle,
  resume_generate, create_prefix_pool, set_handle_bytes_cap, load_model, calibrate, lane_seed;
  with a unit that int() takes (ns) the duration was silently taken as a count.
* A numpy array given for a name field (GenerateConfig.early_exit_kv, RunConfig.mode,
  score_with_consistency_escalation's criterion) was numpy's "truth value is ambiguous" ValueError.
* Flags were not type-checked: inspect(measure=array) was a ValueError and measure="no" measured;
  Tokenizer.stream_decoder(continuation=array) a ValueError; Tokenizer.decode took any continuation.
* Tokenizer.decode of a 0-d array was a TypeError; ids whose iteration raises, or a token id whose
  __index__ raises (decode, token_text, token_bytes, StreamDecoder.push), escaped untyped.
* calibrate(candidates=np.array(3)) was a TypeError (a 0-d array passes the Iterable check).
* GenerateStats took any value for any field; a stop_reason that is not a stop reason then broke
  to_dict() with an AttributeError.
* ResumeHandle.base_depth / growth_bytes / reserve / upgrade / run_rows: a wrong loops (None, a
  str, a float, an array, np.int8 overflowing in the cache size) was a TypeError / ValueError /
  OverflowError / IndexError / KeyError, and on a freed (or never built) handle a ValueError
  ("min() arg is an empty sequence") or AttributeError instead of HandleFreedError.
* Grammar.matcher: a wrong tokenizer / vocab_size / eos_id was a TypeError / AttributeError /
  OverflowError.
* PrefixCache(...) / ResumeHandle(...) called directly with ids that are not a sequence: TypeError.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop as tl

P = [3, 17, 42, 8, 91]
CFG = tl.GenerateConfig(max_tokens=4)


@pytest.fixture(scope="module")
def model(tiny_path):
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model("demo", max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


class _RaisingIter:
    def __len__(self):
        return 3

    def __iter__(self):
        raise RuntimeError("iter boom")

    def __getitem__(self, i):
        raise RuntimeError("getitem boom")


class _RaisingIndex:
    def __index__(self):
        raise RuntimeError("index boom")

    def __int__(self):
        raise RuntimeError("int boom")


TD_S = np.timedelta64(3, "s")           # int() of it fails
TD_NS = np.timedelta64(3, "ns")         # int() of it is 3: a duration, not a count
ARR = np.array([1, 2])
BAD = [None, "abc", 2.5, True, b"x", [1], {"a": 1}, object(), ARR, np.array(3), np.array([], np.int64),
       np.array([[1, 2]]), TD_S, TD_NS, np.float32(2.0), complex(1, 2), float("nan")]


def _state(model):
    return (tl.vram_usage_bytes(model), model._live_cache_bytes, model._live_handle_bytes,
            tl.live_handle_bytes(), len(tl.live_handles()), model._lock.locked())


def typed(call, *names):
    """`call()` raises a TinyLoopError whose message names one of `names` (when given)."""
    try:
        call()
    except tl.TinyLoopError as exc:
        msg = str(exc)
        assert not names or any(n in msg for n in names), f"the error does not name {names}: {msg}"
        return exc
    except Exception as exc:           # the failure message names the untyped exception
        pytest.fail(f"untyped {type(exc).__name__}: {exc}")
    pytest.fail("no error raised")


@pytest.fixture
def unchanged(model):
    """The model decodes the same tokens and holds the same memory and handles after the test."""
    want = tl.generate(model, P, CFG)
    before = _state(model)
    yield
    assert _state(model) == before
    assert tl.generate(model, P, CFG) == want


# ============================================================== numpy.timedelta64 is no count
@pytest.mark.parametrize("td", [TD_S, TD_NS], ids=["s", "ns"])
@pytest.mark.parametrize("cls, fields", [
    (tl.GenerateConfig, ["max_tokens", "loops", "temperature", "top_k", "top_p", "cache_window",
                         "repetition_penalty", "beam_size", "length_penalty", "early_exit_patience",
                         "early_exit_min_L", "early_exit_peek_every", "early_exit_logit_margin",
                         "early_exit_threshold", "sample_seed"]),
    (tl.SpeculativeConfig, ["max_tokens", "draft_loops", "verify_loops", "draft_ahead", "seed", "top_k",
                            "cache_window"]),
    (tl.TreeSpeculativeConfig, ["K_branches"]),
    (tl.SpeculativeOptions, ["draft_loops", "verify_loops", "draft_ahead"]),
    (tl.TreeSpeculativeOptions, ["K_branches"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_config_counts_refuse_a_timedelta(cls, fields, td):
    for f in fields:
        typed(lambda: cls(**{f: td}), f)


@pytest.mark.parametrize("td", [TD_S, TD_NS], ids=["s", "ns"])
def test_loops_and_counts_refuse_a_timedelta(model, tiny_path, unchanged, td):
    calls = {
        "loops": [lambda: tl.score(model, P, loops=td), lambda: tl.score_last_token(model, P, loops=td),
                  lambda: tl.score_logit_lens(model, P, loops=td), lambda: tl.score_with_uncertainty(model, P, loops=td),
                  lambda: tl.build_prefix_cache(model, P, loops=td), lambda: tl.calibrate(model, loops=td)],
        "loops_low": [lambda: tl.score_with_consistency_escalation(model, P, td, 4, threshold=1.0)],
        "loops_used": [lambda: tl.build_resume_handle(model, P, td)],
        "capacity": [lambda: tl.create_prefix_pool(td)],
        "max_bytes": [lambda: tl.create_prefix_pool(2, td), lambda: tl.set_handle_bytes_cap(td)],
        "max_seq_len": [lambda: tl.load_model(str(tiny_path), max_seq_len=td, backend="cpu")],
        "prefill_chunk": [lambda: tl.load_model(str(tiny_path), max_seq_len=16, backend="cpu", prefill_chunk=td)],
        "max_tokens": [lambda: tl.calibrate(model, max_tokens=td)],
        "top_k": [lambda: tl.score_logit_lens(model, P, top_k=td)],
        "threshold": [lambda: tl.score_with_consistency_escalation(model, P, 2, 4, threshold=td)],
        "seed": [lambda: tl.lane_seed(td, 1)],
        "lane": [lambda: tl.lane_seed(1, td)],
        "stop_sequences": [lambda: tl.GenerateConfig(stop_sequences=[[td]])],
    }
    for name, fns in calls.items():
        for fn in fns:
            typed(fn, name)
    pool = tl.create_prefix_pool(2)
    h = tl.build_resume_handle(model, P, 2)
    try:
        typed(lambda: tl.register_prefix(pool, model, P, loops=td), "loops")
        typed(lambda: tl.resume_generate(h, td, CFG), "loops_new")
    finally:
        tl.free_resume_handle(h)
        tl.free_prefix_pool(pool)
    tl.set_handle_bytes_cap(None)


# ============================================================== arrays for names, flags
@pytest.mark.parametrize("bad", [ARR, np.array([], np.int64), np.array([[1, 2]]), np.array(["copy_last"])],
                         ids=["1d", "empty", "2d", "str1d"])
def test_arrays_for_name_fields(model, unchanged, bad):
    typed(lambda: tl.GenerateConfig(early_exit_kv=bad), "early_exit_kv")
    typed(lambda: tl.RunConfig(mode=bad), "mode")
    typed(lambda: tl.score_with_consistency_escalation(model, P, 2, 4, bad, 1.0), "criterion")


@pytest.mark.parametrize("bad", ["no", 1, None, ARR, np.array([]), [True]], ids=repr)
def test_flags_take_true_or_false(tiny_path, demo, bad):
    typed(lambda: tl.inspect(str(tiny_path), measure=bad), "measure")
    tok = demo.tokenizer
    typed(lambda: tok.stream_decoder(continuation=bad), "continuation")
    typed(lambda: tok.decode([1, 2], continuation=bad), "continuation")
    assert tok.decode([1, 2], continuation=np.bool_(True)) == tok.decode([1, 2], continuation=True)


# ============================================================== the tokenizer's ids
@pytest.mark.parametrize("make", [lambda: np.array(3), lambda: np.array(3.0), _RaisingIter, lambda: [1, _RaisingIndex()]],
                         ids=["0d", "0d-float", "raising-iter", "raising-index"])
def test_tokenizer_ids(demo, make):
    tok = demo.tokenizer
    typed(lambda: tok.decode(make()), "decode", "token id")
    typed(lambda: tok.token_text(_RaisingIndex()), "token id")
    typed(lambda: tok.token_bytes(_RaisingIndex()), "token id")
    typed(lambda: tok.stream_decoder().push(_RaisingIndex()), "token id")
    assert tok.decode(np.array([72, 105])) == tok.decode([72, 105])


# ============================================================== calibrate's candidates
@pytest.mark.parametrize("bad", [np.array(3), _RaisingIter()], ids=["0d", "raising-iter"])
def test_calibrate_candidates(model, unchanged, bad):
    typed(lambda: tl.calibrate(model, loops=3, prompts=[P], max_tokens=2, candidates=bad), "candidates")


# ============================================================== GenerateStats
@pytest.mark.parametrize("field, bad", [
    ("stop_reason", "not a name"), ("stop_reason", 3), ("stop_reason", ARR), ("tokens_emitted", "3"),
    ("tokens_emitted", 2.5), ("prefill_ms", "fast"), ("prefill_ms", None), ("loops_used", True),
    ("token_loops", "123"), ("token_loops", 3), ("decoder", 3), ("decoder", None), ("batch_lanes", TD_S),
])
def test_generate_stats_fields(field, bad):
    typed(lambda: tl.GenerateStats(**{field: bad}), field)


def test_generate_stats_still_take_what_a_run_writes():
    st = tl.GenerateStats(stop_reason="EOS", tokens_emitted=np.int64(3), loops_used=2.5, prefill_ms=np.float32(1.5),
                          token_loops=[3, 4], decoder="greedy")
    assert st.stop_reason is tl.StopReason.EOS and type(st.tokens_emitted) is int
    assert st.to_dict()["stop_reason"] == "EOS" and st.to_dict()["tokens_emitted"] == 3
    assert tl.GenerateStats(stop_reason=tl.StopReason("MY_RULE")).to_dict()["stop_reason"] == "MY_RULE"


# ============================================================== ResumeHandle's methods
@pytest.mark.parametrize("bad", [None, "3", 2.5, True, ARR, np.array([]), 0, -1, 1 << 70, TD_S,
                                 float("nan")], ids=repr)
def test_resume_handle_methods_check_loops(model, unchanged, bad):
    h = tl.build_resume_handle(model, P, 2)
    try:
        for meth in ("base_depth", "growth_bytes", "reserve", "upgrade"):
            typed(lambda: getattr(h, meth)(bad), "loops")
        typed(lambda: h.run_rows(2, bad, 2), "loops")
        typed(lambda: h.run_rows(bad, 3, 2), "base")
        typed(lambda: h.run_rows(2, 2, bad), "n")
        assert h.growth_bytes(np.int8(3)) == h.growth_bytes(3)      # numpy integers are counts
        assert tl.resume_generate(h, 3, CFG) == tl.generate(model, P, CFG.replace(loops=3))
    finally:
        tl.free_resume_handle(h)


def test_resume_handle_methods_on_freed_and_unbuilt_handles(model, unchanged):
    h = tl.build_resume_handle(model, P, 2)
    tl.free_resume_handle(h)
    for meth in ("base_depth", "growth_bytes", "reserve", "upgrade"):
        with pytest.raises(tl.HandleFreedError, match="freed"):
            getattr(h, meth)(3)
    with pytest.raises(tl.HandleFreedError, match="freed"):
        h.run_rows(2, 3, 2)
    raw = tl.ResumeHandle(model, [1, 2], 3, "fp16")
    for meth in ("base_depth", "growth_bytes", "reserve", "upgrade"):
        typed(lambda: getattr(raw, meth)(3), "build_resume_handle")


@pytest.mark.parametrize("cls", [tl.PrefixCache, tl.ResumeHandle])
@pytest.mark.parametrize("bad", [None, 2.5, True, object(), _RaisingIter()], ids=["None", "float", "bool", "object", "raising-iter"])
def test_handle_classes_called_directly_check_ids(model, unchanged, cls, bad):
    typed(lambda: cls(model, bad, 3, "fp16"), "ids")


# ============================================================== Grammar.matcher
def test_grammar_matcher_arguments(demo):
    pytest.importorskip("llguidance")
    g = tl.Grammar.regex("[0-9]+")
    tok, V, eos = demo.tokenizer, demo.cfg.vocab_size, demo.cfg.eos_id
    for bad in (None, "tok", 3, object(), _RaisingIter()):
        typed(lambda: g.matcher(bad, V, eos), "tokenizer")
    for bad in (None, "5", 2.5, True, [1], 0, -1, 1 << 70, TD_S, ARR):
        typed(lambda: g.matcher(tok, bad, eos), "vocab_size")
    for bad in ("5", 2.5, True, [1], -1, 1 << 70, V + 1, ARR):
        typed(lambda: g.matcher(tok, V, bad), "eos_id")
    assert g.matcher(tok, np.int64(V), eos) is not None and g.matcher(tok, V, None) is not None


# ============================================================== property: prompts and ids
_ids = st.one_of(
    st.lists(st.integers(-(1 << 70), 1 << 70), max_size=6),
    st.lists(st.integers(0, 200), min_size=1, max_size=6).map(lambda v: np.array(v, np.uint8)),
    st.lists(st.integers(-5, 200), max_size=6).map(lambda v: np.array(v, np.int16)),
    st.lists(st.floats(allow_nan=True), max_size=4),
    st.lists(st.integers(0, 96), min_size=1, max_size=4).map(lambda v: np.array([v, v])),
    st.lists(st.one_of(st.integers(0, 96), st.none(), st.text(max_size=2), st.booleans()), max_size=4),
    st.sampled_from([np.array(3), np.array([], np.int64), TD_S, ARR.astype("timedelta64[s]"), None, 3, "", b"ab"]),
)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(ids=_ids)
def test_any_prompt_is_decoded_or_refused_typed(model, demo, ids):
    before = _state(model)
    for call in (lambda: tl.generate(model, ids, tl.GenerateConfig(max_tokens=2)),
                 lambda: tl.score_last_token(model, ids), lambda: tl.generate_batch(model, [ids], CFG),
                 lambda: tl.free_prefix_cache(tl.build_prefix_cache(model, ids)),
                 lambda: demo.tokenizer.decode(ids)):
        try:
            call()
        except tl.TinyLoopError:
            pass
        except Exception as exc:
            pytest.fail(f"untyped {type(exc).__name__} for {ids!r}: {exc}")
    assert _state(model) == before


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(["max_tokens", "loops", "temperature", "top_k", "top_p", "cache_window",
                              "repetition_penalty", "beam_size", "early_exit_patience", "early_exit_kv",
                              "early_exit_criterion", "sample_seed", "cache_mode", "decoder", "options",
                              "stop_sequences", "grammar"]),
       value=st.sampled_from(BAD))
def test_any_config_value_is_taken_or_refused_typed(field, value):
    try:
        tl.GenerateConfig(**{field: value})
    except tl.TinyLoopError as exc:
        assert field in str(exc) or field == "grammar", str(exc)
    except Exception as exc:
        pytest.fail(f"untyped {type(exc).__name__} for {field}={value!r}: {exc}")
