"""Mode composition as a property: random combinations of decode modes, knobs and entry points
against configs/compat.yaml, read here as plain data (the YAML's `when` rules evaluated by this
file, not by tinyloop.runtime.compat), so the matrix and the behaviour are checked both ways:

1. a combination a column of the YAML rejects (a `rejected` cell of an active mode, or a `pairs`
   rule) raises IncompatibleModesError before any work: no cache or kept state allocated, the
   model's memory accounting and live handles unchanged, the model free for the next request; its
   message names the rejected mode and column (or the pair and the YAML's reason);
2. a combination every column allows runs (no typed refusal of any kind), and where the docs
   claim exactness its tokens equal the reference path's: plain greedy generate for the
   speculative / tree / auto decoders, generate for each lane of generate_batch, for prefix reuse
   (prefix cache, pool) and for warm start, the uncached reference path for early exit;
3. together: nothing the YAML allows is refused in code, and nothing it rejects runs.

The columns a request is checked against: the entry point's (single, batched), or the decoder's
own (speculative, tree_speculative), plus prefix_reuse / warm_start for the reuse entry points.
Tests/test_compat.py draws the knobs per context on fixed entry points; this file draws the entry
point (every spelling of a context), the decoder and the knobs together.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

import tinyloop as tl
from tinyloop.runtime.compat import CompatWarning

ROOT = Path(__file__).resolve().parents[1]
YAML = yaml.safe_load((ROOT / "configs" / "compat.yaml").read_text())
OPS = {"==": operator.eq, "!=": operator.ne, ">": operator.gt, ">=": operator.ge, "<": operator.lt,
       "<=": operator.le}
PROMPT = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77]
#: derandomized for CI; COMPAT_PROPERTY_RANDOM=1 COMPAT_PROPERTY_EXAMPLES=3000 for a wider local search
SETTINGS = dict(deadline=None, derandomize=not os.environ.get("COMPAT_PROPERTY_RANDOM"), database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# --------------------------------------------------------------------------- the YAML, as data
def active_modes(cfg) -> list:
    """Rows of the YAML whose `when` rule the request's GenerateConfig switches on."""
    out = []
    for name, row in YAML["modes"].items():
        field, op, value = row["when"]
        try:
            on = OPS[op](getattr(cfg, field), value)
        except TypeError:
            on = False
        if on:
            out.append(name)
    return out


def violations(columns, cfg) -> list:
    """The YAML's reasons to refuse `cfg` in `columns`: (mode, column) for a rejected cell, (pair,
    reason) for a pair rule. Empty: every column allows it."""
    act = active_modes(cfg)
    out = [(m, c) for c in columns for m in act if YAML["modes"][m]["cells"][c] == "rejected"]
    out += [(tuple(sorted(p["modes"])), p["reason"]) for p in YAML["pairs"] if set(p["modes"]) <= set(act)]
    return out


def partial(columns, cfg) -> bool:
    return any(YAML["modes"][m]["cells"][c] == "partial" for c in columns for m in active_modes(cfg))


def names_a_violation(msg: str, found: list) -> bool:
    for what, why in found:
        if isinstance(what, tuple):         # a pair: both modes and the YAML's reason
            if all(m in msg for m in what) and why in msg and "compat.yaml" in msg:
                return True
        elif f"{what} (" in msg and f"rejected in {why}" in msg and f"modes.{what}.{why} = rejected" in msg:
            return True
    return False


# --------------------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model with 300 ids (the raw-byte tokenizer serves it, so grammars run) and no EOS."""
    from conftest import write_tiny
    path = tmp_path_factory.mktemp("compat_properties") / "m.tinyloop"
    write_tiny(path, vocab_size=300, d_model=32, d_ff=48, max_loops=4)
    m = tl.load_model(str(path), max_seq_len=48, backend="cpu")
    yield m
    tl.free_model(m)


class Watch:
    """Every allocation the backend makes (request caches, kept caches, kept rows) while on."""

    def __init__(self, model, monkeypatch):
        self.calls = []
        be = model.backend
        for name in ("alloc_cache", "alloc_kept_cache", "alloc_rows"):
            real = getattr(be, name)
            monkeypatch.setattr(be, name, lambda *a, _real=real, _n=name: self.calls.append(_n) or _real(*a))


def snapshot(model):
    return tl.vram_usage_bytes(model), [dict(h) for h in tl.live_handles(model)], dict(model.decoder_choices)


# --------------------------------------------------------------------------- requests
ENTRIES = ("generate", "generate_iter", "generate_stream", "stream_text", "generate_batch", "generate_batch_lanes",
           "generate_batch_grammars", "prefix_cache",
           "prefix_cache_iter", "prefix_pool", "prefix_pool_iter", "resume", "resume_iter", "build_resume_handle",
           "generate_speculative", "generate_tree_speculative", "score_decoded")
#: entry points that return an iterator: validated (and refused) when called, before the first next()
ITERATORS = ("generate_iter", "stream_text", "prefix_cache_iter", "prefix_pool_iter", "resume_iter")
#: the compat columns each entry point checks a request against (its decoder's, for a decoder with
#: its own column, replaces the first)
ENTRY_COLUMNS = {"generate": ["single"], "generate_iter": ["single"], "generate_stream": ["single"],
                 "stream_text": ["single"], "generate_batch": ["batched"], "generate_batch_lanes": ["batched"],
                 "generate_batch_grammars": ["batched"], "prefix_cache": ["single", "prefix_reuse"],
                 "prefix_cache_iter": ["single", "prefix_reuse"], "prefix_pool": ["single", "prefix_reuse"],
                 "prefix_pool_iter": ["single", "prefix_reuse"], "resume": ["single", "warm_start"],
                 "resume_iter": ["single", "warm_start"],
                 "build_resume_handle": ["single", "warm_start"], "generate_speculative": ["speculative"],
                 "generate_tree_speculative": ["tree_speculative"], "score_decoded": ["single"]}
SPEC_DECODERS = {"speculative": "speculative", "tree_speculative": "tree_speculative"}


@st.composite
def requests(draw):
    entry = draw(st.sampled_from(ENTRIES))
    sampling = draw(st.booleans())
    k = dict(max_tokens=draw(st.integers(0, 6)),
             cache_mode=draw(st.sampled_from(["fp16", "fp32", "int8", "int4"])),
             cache_window=draw(st.sampled_from([0, 0, 5, 12])),
             loops=draw(st.sampled_from([None, 2, 3, 4])))
    if sampling:
        k.update(temperature=draw(st.sampled_from([0.7, 1.3])), sample_seed=draw(st.integers(0, 3)),
                 top_k=draw(st.sampled_from([50, 5])), top_p=draw(st.sampled_from([1.0, 0.9])))
    else:
        k.update(temperature=draw(st.sampled_from([0.0, 0.005, 0.01])))
    if draw(st.booleans()):
        k["stop_sequences"] = [[draw(st.integers(0, 299))]]
    if entry in ("generate_speculative", "generate_tree_speculative"):
        return entry, None, k
    if entry == "score_decoded":
        decoder = None
        k.pop("max_tokens")
        k.pop("stop_sequences", None)
        if sampling:
            k = {n: v for n, v in k.items() if n not in ("temperature", "sample_seed", "top_k", "top_p")}
    else:
        decoder = draw(st.sampled_from([None, None, "auto", "speculative", "tree_speculative", "explicit"]))
        if entry.startswith("generate_batch") and decoder in SPEC_DECODERS:
            decoder = None                  # (speculative decoders run in the single context only)
        k.update(repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
                 grammar=draw(st.sampled_from([None, None, {"regex": "[a-z]+"}])))
        if draw(st.integers(0, 2)) == 0:         # (with sampling: refused by a pair rule)
            k.update(beam_size=draw(st.sampled_from([1, 2, 3])), length_penalty=draw(st.sampled_from([1.0, 0.5])))
            if k["beam_size"] < 2:
                k.pop("length_penalty")
        if decoder == "explicit":           # the automatic choice, named
            decoder = "beam" if k.get("beam_size", 0) >= 2 else "sampling" if sampling else "greedy"
    if draw(st.integers(0, 2)) == 0:
        k.update(early_exit_patience=1, early_exit_min_L=1,
                 early_exit_criterion=draw(st.sampled_from(["hidden_l2", "argmax", "kl"])),
                 early_exit_kv=draw(st.sampled_from(["copy_last", "recompute"])))
        k["early_exit_threshold"] = {"hidden_l2": 0.35, "kl": 0.05, "argmax": 0.0}[k["early_exit_criterion"]]
    k["_split"] = draw(st.integers(1, len(PROMPT)))     # prefix length of the reuse entry points
    return entry, decoder, k


def spec_config(entry, k):
    cls = tl.TreeSpeculativeConfig if entry == "generate_tree_speculative" else tl.SpeculativeConfig
    kw = dict(max_tokens=k["max_tokens"], draft_loops=1, verify_loops=k["loops"] or 3, draft_ahead=2,
              temperature=k["temperature"], cache_mode=k["cache_mode"], cache_window=k["cache_window"],
              stop_sequences=k.get("stop_sequences", ()))
    if k["temperature"] > 0.01:
        kw.update(seed=k["sample_seed"], top_k=k["top_k"], top_p=k["top_p"])
    return cls(**kw)


def request_config(entry, decoder, k):
    """The GenerateConfig the engine checks (the speculative wrappers' own request)."""
    if entry in ("generate_speculative", "generate_tree_speculative"):
        from tinyloop.plugins.decoders.spec_session import speculative_request
        return speculative_request(spec_config(entry, k), tree=entry == "generate_tree_speculative")
    opts = {"draft_loops": 1, "draft_ahead": 2} if decoder in SPEC_DECODERS else {}
    return tl.GenerateConfig(decoder=decoder, options=opts, **{n: v for n, v in k.items() if n[0] != "_"})


def columns_of(entry, cfg):
    cols = list(ENTRY_COLUMNS[entry])
    if cfg.decoder in SPEC_DECODERS:
        cols[0] = SPEC_DECODERS[cfg.decoder]
    return cols


def plain_of(cfg, loops_default):
    """The reference request: the same settings decoded by the automatic (plain) decoder; a greedy
    temperature (<= 0.01) as 0."""
    return dataclasses.replace(cfg, decoder=None, options={}, loops=cfg.loops or loops_default,
                               temperature=cfg.temperature if cfg.sampling else 0.0)


def lane_configs(cfg):
    """One config per lane of a two-lane batch: lane 1 differs in the per-lane fields only."""
    return [cfg, dataclasses.replace(cfg, sample_seed=cfg.sample_seed + 7 if cfg.sampling else 0,
                                     stop_sequences=[[5, 6]], grammar=None)]


def call(model, entry, cfg, prompt, k, st, lanes):
    """Run `cfg` through `entry`; returns prompt + tokens (generate_batch: a list per lane)."""
    if entry == "generate":
        return tl.generate(model, prompt, cfg, stats=st)
    if entry == "generate_iter":
        return tl.generate_iter(model, prompt, cfg, stats=st)
    if entry == "stream_text":
        return tl.stream_text(model, prompt, cfg, stats=st)
    if entry == "generate_stream":
        return tl.generate_stream(model, prompt, cfg, on_token=lambda t, p: True, stats=st)
    if entry == "generate_batch":
        return tl.generate_batch(model, [prompt, prompt[:6]], cfg, stats=lanes)
    if entry == "generate_batch_lanes":
        return tl.generate_batch(model, [prompt, prompt[:6]], lane_configs(cfg), stats=lanes)
    if entry == "generate_batch_grammars":
        return tl.generate_batch(model, [prompt, prompt[:6]], dataclasses.replace(cfg, grammar=None),
                                 stats=lanes, grammars=[cfg.grammar, None])
    if entry == "generate_speculative":
        return tl.generate_speculative(model, prompt, spec_config(entry, k), stats=st)
    if entry == "generate_tree_speculative":
        return tl.generate_tree_speculative(model, prompt, spec_config(entry, k), stats=st)
    if entry == "score_decoded":
        return tl.score_decoded(model, prompt, cfg, stats=st)
    raise AssertionError(entry)


def check(model, monkeypatch, entry, decoder, k):
    L = model.cfg.default_loops
    cfg = request_config(entry, decoder, k)
    cols = columns_of(entry, cfg)
    found = violations(cols, cfg)
    prompt = list(PROMPT)
    kept = []                                   # kept state built before the request is watched
    loops = cfg.loops or L
    split = k.get("_split", 6)
    if entry.startswith("prefix_cache"):
        kept.append(tl.build_prefix_cache(model, prompt[:split], loops=loops, cache_mode=cfg.cache_mode))
    elif entry.startswith("prefix_pool"):
        kept.append(tl.create_prefix_pool(2))
        tl.register_prefix(kept[0], model, prompt[:split], loops=loops, cache_mode=cfg.cache_mode)
    elif entry.startswith("resume"):
        kept.append(tl.build_resume_handle(model, prompt, 1, tl.GenerateConfig(max_tokens=8, cache_mode=cfg.cache_mode)))
    busy = None
    if found:
        # a request decoding now holds the model: a refusal before any work never waits for it
        # (no ModelBusyError), and takes nothing from it
        busy = tl.generate_iter(model, prompt, tl.GenerateConfig(max_tokens=2))
        next(busy)
    before = snapshot(model)
    pool_stats = kept[0].stats() if entry.startswith("prefix_pool") else None
    st, lanes = tl.GenerateStats(decoder="untouched"), ["untouched"]      # the caller's, filled by a run
    watch = Watch(model, monkeypatch)

    def run():
        if entry == "prefix_cache":
            return tl.generate_from_prefix_cache(model, kept[0], prompt[split:], cfg, stats=st)
        if entry == "prefix_cache_iter":
            return tl.generate_from_prefix_cache_iter(model, kept[0], prompt[split:], cfg, stats=st)
        if entry == "prefix_pool":
            return tl.generate_with_pool(model, kept[0], prompt, cfg, stats=st)
        if entry == "prefix_pool_iter":
            return tl.generate_with_pool_iter(model, kept[0], prompt, cfg, stats=st)
        if entry == "resume":
            return tl.resume_generate(kept[0], loops, cfg, stats=st)
        if entry == "resume_iter":
            return tl.resume_generate_iter(kept[0], loops, cfg, stats=st)
        if entry == "build_resume_handle":
            h = tl.build_resume_handle(model, prompt, loops, dataclasses.replace(cfg, loops=None))
            try:
                return tl.resume_generate(h, loops, stats=st)
            finally:
                tl.free_resume_handle(h)
        return call(model, entry, cfg, prompt, k, st, lanes)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CompatWarning)
            if found:
                with pytest.raises(tl.IncompatibleModesError) as info:
                    run()
                assert names_a_violation(str(info.value), found), (str(info.value), found)
                # a refused request warns of nothing: a `partial` warning ("it works") before the
                # refusal would be wrong, and would use up the default filter's one showing
                assert not [w for w in caught if issubclass(w.category, CompatWarning)], \
                    [str(w.message) for w in caught]
                assert watch.calls == [], f"{watch.calls} allocated before the refusal"
                monkeypatch.undo()
                assert snapshot(model) == before, "the refused request changed the model's state"
                assert st == tl.GenerateStats(decoder="untouched") and lanes == ["untouched"], \
                    "the refused request wrote to the caller's stats"
                if pool_stats is not None:
                    assert kept[0].stats() == pool_stats, "the refused request counted in the pool's stats"
                return "rejected", None
            try:
                out = run()
                if entry == "stream_text":
                    out = "".join(out)
                elif entry in ITERATORS:
                    out = prompt + list(out)
            except tl.TinyLoopError as exc:
                raise AssertionError(f"compat.yaml allows {cols} for {active_modes(cfg)}, but "
                                     f"{type(exc).__name__}: {exc}") from None
        monkeypatch.undo()
        warned = any(issubclass(w.category, CompatWarning) for w in caught)
        if cfg.decoder == "auto":               # it may hand the request to a speculative decoder
            assert warned <= partial(cols + ["speculative", "tree_speculative"], cfg)
        else:
            assert warned == partial(cols, cfg), [str(w.message) for w in caught]
        return "ran", out
    finally:
        monkeypatch.undo()
        if busy is not None:
            busy.close()
        for x in kept:
            (tl.free_prefix_pool if entry.startswith("prefix_pool") else
             tl.free_prefix_cache if entry.startswith("prefix_cache") else tl.free_resume_handle)(x)


# --------------------------------------------------------------------------- exactness claims
def exact_claim(entry, cfg):
    """Where the docs promise the reference path's tokens (None: no exactness claim)."""
    if cfg.beam_size >= 2:
        return None
    if entry == "score_decoded":
        # (with early exit the prompt's positions are decode steps at their own depths there,
        # where generate prefills them at full depth: no token-level claim)
        return None if cfg.early_exit_patience > 0 else "teacher forcing"
    if cfg.decoder in SPEC_DECODERS or cfg.decoder == "auto":
        # speculative sampling keeps plain sampling's distribution, not its tokens
        return None if cfg.sampling else "plain greedy"
    return "plain"


#: the requests the defects were found with, kept as regressions
BASE = dict(max_tokens=3, cache_mode="fp16", cache_window=0, loops=None, temperature=0.0)
#: a partial cell (int4 x tree_speculative) warned "it works" before a rejected one (cache_window x
#: tree_speculative) refused the request, using up the default filter's one showing of the warning
PARTIAL_THEN_REJECTED = ("generate_tree_speculative", None, dict(BASE, cache_mode="int4", cache_window=5))
#: the same across two columns: cache_window is partial in the decoder's (speculative) and rejected
#: in the kept state's (prefix_reuse, warm_start), which Plan checked one after the other
PARTIAL_IN_DECODER_REJECTED_IN_REUSE = [
    (entry, "speculative", dict(BASE, cache_window=5, repetition_penalty=1.0, grammar=None, _split=6))
    for entry in ("prefix_cache", "prefix_pool_iter", "resume", "build_resume_handle")]


@settings(max_examples=int(os.environ.get("COMPAT_PROPERTY_EXAMPLES", 400)), **SETTINGS)
@given(req=requests())
@example(req=PARTIAL_THEN_REJECTED)
@example(req=PARTIAL_IN_DECODER_REJECTED_IN_REUSE[0])
@example(req=PARTIAL_IN_DECODER_REJECTED_IN_REUSE[1])
@example(req=PARTIAL_IN_DECODER_REJECTED_IN_REUSE[2])
@example(req=PARTIAL_IN_DECODER_REJECTED_IN_REUSE[3])
def test_compat_matrix_and_behaviour_agree(model, req):
    entry, decoder, k = req
    note(f"request: {req!r}")
    with pytest.MonkeyPatch.context() as mp:
        outcome, out = check(model, mp, entry, decoder, k)
    event(f"{entry}: {outcome}")
    if outcome != "ran":
        return
    cfg = request_config(entry, decoder, k)
    claim = exact_claim(entry, cfg)
    if claim is None:
        return
    ref_cfg = plain_of(cfg, model.cfg.default_loops)
    prompt = list(PROMPT)
    if entry == "score_decoded":
        # the rows are the decode steps' logits: teacher-forcing greedy generate's own output gives
        # back its tokens (argmax of each row from the prompt's last on) and its per-token depths
        gen = tl.generate(model, prompt, dataclasses.replace(ref_cfg, max_tokens=5))
        rows = tl.score_decoded(model, gen, cfg)
        assert [int(r.argmax()) for r in rows[len(prompt) - 1:-1]] == gen[len(prompt):]
        if cfg.cache_window == 0:           # at a fixed depth, score's logits bit for bit
            import numpy as np
            np.testing.assert_array_equal(rows, tl.score(model, gen, loops=ref_cfg.loops, cache_mode=cfg.cache_mode))
        return
    if entry.startswith("generate_batch"):
        lanes = [prompt, prompt[:6]]
        if entry == "generate_batch_lanes":         # used as given
            refs = [tl.generate(model, p, c) for p, c in zip(lanes, lane_configs(ref_cfg))]
        else:
            # one config: lane i samples with lane_seed(sample_seed, i); grammars= gives lane 1 none
            refs = [tl.generate(model, p, dataclasses.replace(
                ref_cfg, sample_seed=tl.lane_seed(ref_cfg.sample_seed, i) if ref_cfg.sampling else 0,
                grammar=None if i and entry == "generate_batch_grammars" else ref_cfg.grammar))
                for i, p in enumerate(lanes)]
        assert [list(x) for x in out] == refs
        return
    ref = tl.generate(model, prompt, ref_cfg)
    if entry == "stream_text":
        ref = tl.generate_text(model, prompt, ref_cfg)
    assert out == ref, f"{entry} {cfg} != plain generate"
    if entry == "stream_text":
        return
    if cfg.early_exit_patience > 0:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
            assert tl.generate(model, prompt, ref_cfg) == ref, "early exit cached != uncached"


# --------------------------------------------------------------------------- `when` vs the plugins
@settings(max_examples=200, **SETTINGS)
@given(k=st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.005, 0.01, 0.0100001, 0.5]),
    "beam_size": st.sampled_from([0, 1, 2, 3]),
    "repetition_penalty": st.sampled_from([1.0, 1.0 + 1e-9, 1.0 - 1e-9, 1.3]),
    "cache_window": st.sampled_from([0, 1, 5]),
    "early_exit_patience": st.sampled_from([0, 1, 2]),
    "grammar": st.sampled_from([None, {"regex": "[a-z]+"}]),
    "cache_mode": st.sampled_from(["fp16", "fp32", "int8", "int4"])}))
def test_when_rules_switch_on_exactly_the_plugins_that_run(model, k):
    """A YAML row is active exactly when the engine switches its plugin on (at the rules' value
    boundaries too): a mode the code runs is never invisible to the matrix, and the matrix never
    refuses a mode the request does not use."""
    from tinyloop.runtime.early_exit import resolve_exit
    from tinyloop.runtime.plugins import get_plugin_manager
    cfg = tl.GenerateConfig(max_tokens=2, loops=3, early_exit_min_L=1, **k)
    pm = get_plugin_manager()
    on = {pm.cache_mode_for(cfg).mode} | {p.mode for p in pm.processors_for(cfg)}
    slots = pm.slot_map_for(cfg)
    if slots is not None:
        on.add(slots.mode)
    if resolve_exit(model, cfg, 3, pm.exit_criteria()) is not None:
        on.add("early_exit")
    on.add(pm.decoder_for(cfg).mode)
    if cfg.beam_size >= 2:
        # the greedy / sampling rows read the temperature alone: under beam search they say which
        # temperature the beams were asked for (sampling's: refused by a pair rule)
        on.add("sampling" if cfg.sampling else "greedy")
    assert set(active_modes(cfg)) == on
