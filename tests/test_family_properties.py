"""Property tests of the model family's numerics on the CPU backend over COMBINATIONS of header
flags (tests/test_reference.py and the conformance suite check fixed variants one flag group at a
time; here hypothesis draws them together).

Every example is a tiny random model (conftest.random_weights) written through the real writer:
GQA ratio, head_dim (explicit, not d_model / n_heads, not a power of two), n_pre / n_loop / n_post
(0 where allowed), tied / untied head, head norm, q/k/v biases, embedding scale, pre / sandwich /
sublayer blocks, loop injection none / add / adapter, loop initial state pre / zeros / seeded
random, loop norm none / after / every, the exit gate's tensors, the model's own sliding window,
RoPE base and scaling, norm epsilon, and per-tensor storage f32 / f16 / q8 / q4 / q2 (group 8 or
16, mixed per tensor; vectors f32 or f16). Properties:

1. tl.score equals the float64 oracle (reference_logits of the file's logical weights, with the
   cache codec's effect modelled) within the tolerances of the existing tests per cache mode;
2. greedy tl.generate follows the oracle step by step (teacher-forced on the runtime's tokens):
   every token is the oracle's argmax up to the tolerance, and exactly it where the oracle's
   top-1 / top-2 margin exceeds twice the tolerance; a window cache past the model's window too;
3. prefill-then-decode (score_decoded, generate) equals whole-sequence scoring bit for bit;
4. the logits and tokens do not depend on prefill_chunk, bit for bit;
5. the PyTorch twin (tinyloop.torch_model, no model window) equals the oracle, and its
   prefill + decode_one its own forward;
6. over the raw flag space, valid or not, every refusal is a TinyLoopError;
7. early exit (every criterion, the learned gate where the model has one, both K/V policies, a
   window cache too) equals the oracle at the depths each position ran (reference_logits_exit);
8. lockstep lanes, chain / tree self-speculation, a resume handle and a prefix cache give plain
   greedy generate's tokens.

TINYLOOP_PROPERTY_SCALE=k multiplies every test's examples (a longer hunt; the default run takes
about 30 s on two cores).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import tinyloop as tl
from tinyloop.errors import IncompatibleModesError, InvalidInputError, TinyLoopError
from tinyloop.model.arch import (BLOCK_NORM, LOOP_INIT, LOOP_INJECT, LOOP_NORM, ModelConfig, TensorQuant,
                                 is_matrix, required_tensors)
from tinyloop.model.format import write_model
from tinyloop.model.reference import reference_logits
from tinyloop.runtime.plugins import get_plugin_manager

from conftest import logical_weights, random_weights

MAX_SEQ = 40
#: Relative tolerances (of max |oracle|) by cache mode: the existing tests' (test_reference.py:
#: fp32 1e-4, fp16 2e-3; backend_conformance.TOL: int8 1e-2, int4 5e-2).
TOL = {"fp32": 1e-4, "fp16": 2e-3, "int8": 1e-2, "int4": 5e-2}
QUANTS = ("f32", "f16", "q8", "q4", "q2")
#: TINYLOOP_PROPERTY_SCALE=k runs k times the examples (a longer bug hunt; default 1).
SCALE = max(1, int(os.environ.get("TINYLOOP_PROPERTY_SCALE", "1") or 1))
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# =============================================================================== strategies
@st.composite
def families(draw, window: bool = True):
    """(ModelConfig, quant map, weight seed) of a valid tiny model over the flag space."""
    n_heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    n_kv = draw(st.sampled_from([k for k in range(1, n_heads + 1) if n_heads % k == 0]))
    d_model = draw(st.sampled_from([8, 12, 16, 24, 32]))
    head_dim = draw(st.sampled_from([0, 2, 4, 6, 10, 16]))
    if head_dim == 0 and (d_model % n_heads or (d_model // n_heads) % 2):
        head_dim = 6                                    # d_model / n_heads is not an even width
    inject = draw(st.sampled_from(LOOP_INJECT))
    init = draw(st.sampled_from(LOOP_INIT + ("random",))) if inject == "adapter" else "pre"
    max_loops = draw(st.integers(1, 4))
    scaling = draw(st.sampled_from(["none", "none", "linear", "llama3"]))
    rope = {"linear": dict(rope_factor=draw(st.sampled_from([2.0, 8.0]))),
            "llama3": dict(rope_factor=4.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                           rope_original_max_positions=draw(st.sampled_from([4, 8, 64])))}.get(scaling, {})
    d = dict(vocab_size=draw(st.integers(5, 70)), d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv,
             head_dim=head_dim, d_ff=draw(st.sampled_from([4, 8, 12, 16, 20, 40])),
             n_pre=draw(st.integers(0, 2)), n_loop=draw(st.integers(1, 2)), n_post=draw(st.integers(0, 2)),
             max_loops=max_loops, default_loops=draw(st.integers(1, max_loops)),
             rope_theta=draw(st.sampled_from([10000.0, 50.0, 1e6])), norm_eps=draw(st.sampled_from([1e-5, 1e-6])),
             tied_embeddings=draw(st.booleans()), loop_inject=inject, loop_init=init,
             qkv_bias=draw(st.booleans()), embed_scale=draw(st.sampled_from([1.0, 1.0, 0.5, 2.75])),
             block_norm=draw(st.sampled_from(BLOCK_NORM)), loop_norm=draw(st.sampled_from(LOOP_NORM)),
             head_norm=draw(st.booleans()), exit_gate=draw(st.booleans()),
             sliding_window=draw(st.one_of(st.just(0), st.sampled_from([1, 2, 3, 5]))) if window else 0,
             rope_scaling=scaling, **rope)
    if init == "random":
        d.update(loop_init_scale=draw(st.sampled_from([0.3, 1.0, 2.5])),
                 loop_init_seed=draw(st.sampled_from([0, 7, 2 ** 64 - 1])))
    cfg = ModelConfig(**d)
    default = draw(st.sampled_from(QUANTS))
    group = draw(st.sampled_from([8, 16]))
    mixed = draw(st.booleans())
    vectors = draw(st.sampled_from(["f32", "f16"]))
    seed = draw(st.integers(0, 2 ** 16))
    rng = np.random.default_rng(seed + 1)
    quant = {}
    for name, shape in required_tensors(cfg).items():
        if not is_matrix(name):
            quant[name] = TensorQuant(vectors)
            continue
        t = str(rng.choice(QUANTS)) if mixed else default
        if t[0] == "q" and shape[1] % group:
            t = "f16"                                    # in_features not a whole number of groups
        quant[name] = TensorQuant(t, group if t[0] == "q" else 0)
    return cfg, quant, seed


def prompts(cfg: ModelConfig, max_len: int):
    return st.lists(st.integers(0, cfg.vocab_size - 1), min_size=1, max_size=max_len)


@contextlib.contextmanager
def built(cfg, quant, seed, chunks=(0,), max_seq_len=MAX_SEQ):
    """The model file's logical weights and the file loaded on the CPU backend once per
    prefill_chunk in `chunks`."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.tinyloop")
        write_model(path, cfg, random_weights(cfg, seed), quant=quant)
        W = logical_weights(path)
        models = []
        try:
            for c in chunks:
                models.append(tl.load_model(path, max_seq_len=max_seq_len, backend="cpu", prefill_chunk=c))
            yield (W, *models)
        finally:
            for m in models:
                tl.free_model(m)


def oracle(cfg, W, ids, loops, mode="fp32", window=0):
    codec = None if mode == "fp32" else get_plugin_manager().codec(mode)
    return reference_logits(cfg, W, ids, loops, kv_codec=codec, window=window)


def assert_close(got, ref, tol, what):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape and np.all(np.isfinite(got)), what
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(got - ref).max()) / scale
    assert err <= tol, f"{what}: relative error {err:.3g} exceeds {tol:g}"


def assert_bits(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    bad = got.view(np.uint32) != want.view(np.uint32)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.size} values differ, first at {np.argwhere(bad)[0]}"


def in_window(cfg, n):
    return cfg.sliding_window == 0 or n <= cfg.sliding_window


# =============================================================================== 1. score vs oracle
@settings(max_examples=200 * SCALE, **SETTINGS)
@given(fam=families(), data=st.data())
def test_score_matches_oracle(fam, data):
    cfg, quant, seed = fam
    ids = data.draw(prompts(cfg, 12), label="ids")
    loops = data.draw(st.integers(1, cfg.max_loops), label="loops")
    mode = data.draw(st.sampled_from(["fp32", "fp32", "fp16", "int8", "int4"]), label="cache_mode")
    with built(cfg, quant, seed) as (W, m):
        if not in_window(cfg, len(ids)):
            with pytest.raises(IncompatibleModesError, match="sliding_window"):
                tl.score(m, ids, loops=loops, cache_mode=mode)
            ids = ids[:cfg.sliding_window]
        got = tl.score(m, ids, loops=loops, cache_mode=mode)
        assert_close(got, oracle(cfg, W, ids, loops, mode), TOL[mode], f"score ({mode} cache) vs oracle")


# =============================================================================== 2. greedy vs oracle
@settings(max_examples=150 * SCALE, **SETTINGS)
@given(fam=families(), data=st.data())
def test_greedy_generation_follows_oracle(fam, data):
    cfg, quant, seed = fam
    ids = data.draw(prompts(cfg, 8), label="prompt")
    loops = data.draw(st.integers(1, cfg.max_loops), label="loops")
    n = data.draw(st.integers(1, 8), label="max_tokens")
    W = cfg.sliding_window
    window = 0
    if not in_window(cfg, len(ids) + n):
        window = data.draw(st.integers(1, W), label="cache_window")   # a ring of at most the model's window
    elif data.draw(st.booleans(), label="ring"):                           # a window cache by choice
        window = data.draw(st.integers(1, min(W or 6, len(ids) + n)), label="cache_window")
    event(f"cache_window {'past the model window' if window and len(ids) + n > W > 0 else 'set' if window else 'none'}")
    tol = TOL["fp32"]
    slack = data.draw(st.sampled_from([0, 1, 20]), label="max_seq_len slack")    # the sequence may fill the model
    with built(cfg, quant, seed, max_seq_len=len(ids) + n + slack) as (Wt, m):
        out = tl.generate(m, ids, tl.GenerateConfig(max_tokens=n, loops=loops, cache_mode="fp32",
                                                    cache_window=window))
        assert out[:len(ids)] == ids and len(out) == len(ids) + n
        ref = oracle(cfg, Wt, out[:-1], loops, window=window)
        for p in range(len(ids), len(out)):
            row = ref[p - 1]
            scale = float(np.abs(row).max())
            best = int(np.argmax(row))
            tok = out[p]
            assert row[tok] >= row[best] - tol * scale, (
                f"step {p - len(ids)}: token {tok} (oracle {row[tok]:.6g}) is not the oracle's best "
                f"{best} ({row[best]:.6g})")
            top2 = np.sort(row)[-2] if row.size > 1 else -np.inf
            if row[best] - top2 > 2 * tol * scale:
                assert tok == best, f"step {p - len(ids)}: token {tok}, oracle's clear argmax {best}"


# =============================================================================== 3. cache correctness
@settings(max_examples=150 * SCALE, **SETTINGS)
@given(fam=families(), data=st.data())
def test_prefill_then_decode_equals_scoring(fam, data):
    """score_decoded (prefill of one token, then one-token cached steps) == score (the whole
    sequence in one launch) bit for bit in every cache mode; greedy generate == the argmax chain
    of whole-sequence scoring of its own output."""
    cfg, quant, seed = fam
    seq = data.draw(prompts(cfg, 12), label="seq")
    loops = data.draw(st.integers(1, cfg.max_loops), label="loops")
    mode = data.draw(st.sampled_from(["fp32", "fp16", "int8", "int4"]), label="cache_mode")
    if not in_window(cfg, len(seq)):
        seq = seq[:cfg.sliding_window]
    with built(cfg, quant, seed) as (_, m):
        whole = tl.score(m, seq, loops=loops, cache_mode=mode)
        dec = tl.score_decoded(m, seq, tl.GenerateConfig(loops=loops, cache_mode=mode))
        assert_bits(dec, whole, f"score_decoded vs score ({mode} cache)")
        k = data.draw(st.integers(1, len(seq)), label="prompt_len")
        n = len(seq) - k
        if n:
            out = tl.generate(m, seq[:k], tl.GenerateConfig(max_tokens=n, loops=loops, cache_mode=mode))
            chain = tl.score(m, out, loops=loops, cache_mode=mode)
            assert out[k:] == [int(np.argmax(chain[p - 1])) for p in range(k, len(out))], \
                f"generate ({mode} cache) vs the argmax chain of scoring its output"


# =============================================================================== 4. prefill_chunk
@settings(max_examples=100 * SCALE, **SETTINGS)
@given(fam=families(), data=st.data())
def test_prefill_chunk_does_not_change_results(fam, data):
    cfg, quant, seed = fam
    seq = data.draw(prompts(cfg, 14), label="seq")
    loops = data.draw(st.integers(1, cfg.max_loops), label="loops")
    mode = data.draw(st.sampled_from(["fp32", "fp16", "int4"]), label="cache_mode")
    chunks = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=2, unique=True), label="chunks")
    if not in_window(cfg, len(seq)):
        seq = seq[:cfg.sliding_window]
    with built(cfg, quant, seed, chunks=[0] + chunks) as (_, base, *others):
        want = tl.score(base, seq, loops=loops, cache_mode=mode)
        n = min(4, MAX_SEQ - len(seq))
        gen = tl.GenerateConfig(max_tokens=n, loops=loops, cache_mode=mode,
                                cache_window=0 if in_window(cfg, len(seq) + n) else cfg.sliding_window)
        want_tokens = tl.generate(base, seq, gen)
        for c, m in zip(chunks, others):
            assert_bits(tl.score(m, seq, loops=loops, cache_mode=mode), want, f"score, prefill_chunk={c}")
            assert tl.generate(m, seq, gen) == want_tokens, f"generate, prefill_chunk={c}"


# =============================================================================== 5. PyTorch twin
@settings(max_examples=80 * SCALE, **SETTINGS)
@given(fam=families(window=False), data=st.data())
def test_torch_twin_matches_oracle(fam, data):
    torch = pytest.importorskip("torch")
    from tinyloop.torch_model import LoopedLM
    cfg, quant, seed = fam
    ids = data.draw(prompts(cfg, 10), label="ids")
    loops = data.draw(st.integers(1, cfg.max_loops), label="loops")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.tinyloop")
        write_model(path, cfg, random_weights(cfg, seed), quant=quant)
        W = logical_weights(path)
    slack = data.draw(st.sampled_from([0, 5]), label="max_seq_len slack")      # the cache may be exactly full
    m = LoopedLM.from_logical(cfg, W, max_seq_len=len(ids) + slack).eval()
    t = torch.tensor(ids)
    with torch.no_grad():
        full = m(t, loops)
    ref = oracle(cfg, W, ids, loops)
    assert_close(full.double().numpy(), ref, TOL["fp32"], "torch forward vs oracle")
    k = data.draw(st.integers(1, len(ids)), label="prefill_len")
    m.allocate_cache(batch_size=1)
    steps = [m.prefill(t[:k], loops)] + [m.decode_one(int(t[p]), p, loops) for p in range(k, len(ids))]
    cached = torch.cat([steps[0].reshape(k, -1)] + [s.reshape(1, -1) for s in steps[1:]])
    assert_close(cached.double().numpy(), full.double().numpy(), TOL["fp32"], "torch prefill + decode_one vs forward")


# =============================================================================== 7. early exit
@settings(max_examples=120 * SCALE, **SETTINGS)
@given(fam=families(), data=st.data())
def test_early_exit_decoding_matches_oracle_at_its_depths(fam, data):
    """Adaptive depth (early exit) on the family's combinations: score_decoded with an exit
    criterion (the learned gate where the model has one) gives every position the oracle's
    logits at the depth that position ran (stats.token_loops), the skipped iterations' K/V as
    the policy says (reference_logits_exit)."""
    from tinyloop.model.reference import reference_logits_exit
    cfg, quant, seed = fam
    if cfg.max_loops < 2:
        cfg = ModelConfig(**{**cfg.to_dict(), "max_loops": 3})
    seq = data.draw(prompts(cfg, 10), label="seq")
    window = 0                                  # a window cache: past the model's window, or by choice
    if not in_window(cfg, len(seq)) or data.draw(st.booleans(), label="ring"):
        window = data.draw(st.integers(1, min(cfg.sliding_window or 6, len(seq))), label="cache_window")
    loops = data.draw(st.integers(2, cfg.max_loops), label="loops")
    kv = data.draw(st.sampled_from(["copy_last", "recompute"]), label="kv")
    crit = data.draw(st.sampled_from(["hidden_l2", "kl", "argmax", "logit_margin"]
                                     + (["gate"] if cfg.exit_gate else [])), label="criterion")
    kw = dict(early_exit_patience=1, early_exit_criterion=crit, early_exit_kv=kv, loops=loops, cache_mode="fp32",
              cache_window=window)
    if crit == "gate":
        kw.update(early_exit_min_L=1, early_exit_threshold=data.draw(st.sampled_from([0.3, 0.6, 0.9])))
    else:
        kw.update(early_exit_min_L=data.draw(st.integers(1, loops - 1)),
                  early_exit_peek_every=data.draw(st.integers(1, 2)))
        if crit == "logit_margin":
            kw.update(early_exit_logit_margin=data.draw(st.sampled_from([0.5, 2.0])))
        elif crit != "argmax":
            kw.update(early_exit_threshold=data.draw(st.sampled_from([0.05, 0.3, 0.8])))
    with built(cfg, quant, seed) as (W, m):
        stats = tl.GenerateStats()
        got = tl.score_decoded(m, seq, tl.GenerateConfig(**kw), stats=stats)
        depths = stats.token_loops
        assert len(depths) == len(seq) and all(1 <= d <= loops for d in depths)
        event(f"early exit: {'some' if min(depths) < loops else 'none'}")
        ref = reference_logits_exit(cfg, W, seq, depths, loops, kv, window=window)
        assert_close(got, ref, TOL["fp32"], f"early exit ({crit}, {kv}) at depths {depths} vs oracle")


# =============================================================================== 8. other greedy paths
@settings(max_examples=80 * SCALE, **SETTINGS)
@given(fam=families(), data=st.data())
def test_batch_and_speculative_greedy_equal_plain_greedy(fam, data):
    """The exact greedy paths on the family's combinations: lockstep lanes (generate_batch), chain
    and tree self-speculation, a warm start from a resume handle and a reused prefix cache give
    plain greedy generate's tokens (as tests/conftest.py's check_decode_modes asserts on fixed
    models)."""
    cfg, quant, seed = fam
    if cfg.max_loops < 2:
        cfg = ModelConfig(**{**cfg.to_dict(), "max_loops": 3})
    W = cfg.sliding_window
    prompts_ = data.draw(st.lists(prompts(cfg, 6), min_size=1, max_size=3), label="prompts")
    n = data.draw(st.integers(1, 8), label="max_tokens")
    loops = data.draw(st.integers(2, cfg.max_loops), label="loops")
    if W:                                  # stay within the model's window (a draft tree has no ring)
        prompts_ = [p[:W] for p in prompts_]
        n = min(n, W - max(len(p) for p in prompts_))
        if n < 1:
            event("no room in the model window")
            return
    mode = data.draw(st.sampled_from(["fp32", "fp16", "int8"]), label="cache_mode")
    g = tl.GenerateConfig(max_tokens=n, loops=loops, cache_mode=mode)
    with built(cfg, quant, seed) as (_, m):
        plain = [tl.generate(m, p, g) for p in prompts_]
        assert [list(x) for x in tl.generate_batch(m, prompts_, g)] == plain, "generate_batch"
        draft = data.draw(st.integers(1, loops - 1), label="draft_loops")
        ahead = data.draw(st.integers(1, 4), label="draft_ahead")
        spec = tl.SpeculativeConfig(max_tokens=n, draft_loops=draft, verify_loops=loops, draft_ahead=ahead,
                                    cache_mode=mode)
        assert tl.generate_speculative(m, prompts_[0], spec) == plain[0], "chain speculation"
        tree = tl.TreeSpeculativeConfig(max_tokens=n, draft_loops=draft, verify_loops=loops, draft_ahead=ahead,
                                        cache_mode=mode)
        assert tl.generate_tree_speculative(m, prompts_[0], tree) == plain[0], "tree speculation"
        handle = tl.build_resume_handle(m, prompts_[0], draft, tl.GenerateConfig(max_tokens=n, cache_mode=mode))
        try:                                   # warm start: the prompt's loop state kept at draft_loops
            assert tl.resume_generate(handle, loops) == plain[0], "resume_generate"
        finally:
            tl.free_resume_handle(handle)
        k = data.draw(st.integers(1, len(prompts_[0])), label="prefix_len")
        pc = tl.build_prefix_cache(m, prompts_[0][:k], loops=loops, cache_mode=mode)
        try:
            got = tl.generate_from_prefix_cache(m, pc, prompts_[0][k:], g)
            assert got == plain[0], "generate_from_prefix_cache"
        finally:
            tl.free_prefix_cache(pc)


# =============================================================================== 6. typed refusals
#: Values of each flag outside the valid combinations (wrong ranges, types and pairings).
RAW = dict(vocab_size=[0, 1, 2, -3, 2.0], d_model=[0, 1, 2, 6, 7], n_heads=[0, 5, 7], n_kv_heads=[0, 3, 5, 8],
           head_dim=[0, 1, 3, 2, 2 ** 21], d_ff=[0, 1, 3], n_pre=[-1, 0, 3], n_loop=[0, 1, 3], n_post=[-1, 0, 3],
           max_loops=[0, 1, 5], default_loops=[0, 4, 9], tied_embeddings=[0, 1, None],
           loop_inject=["mul", "add", "adapter", "none"], loop_init=["pre", "zeros", "random", "gauss"],
           loop_init_scale=[0.0, 0.5, -0.5, float("nan"), 1e7], loop_init_seed=[0, 3, 2 ** 64 - 1, 2 ** 64, -1],
           qkv_bias=[True, False, 1], embed_scale=[0.0, -1.0, 3.0, float("inf"), True],
           block_norm=["pre", "sandwich", "sublayer", "post"], loop_norm=["none", "after", "every", "before"],
           head_norm=[True, False, "yes"], exit_gate=[True, False, 0], sliding_window=[-1, 0, 1, 3, 40],
           rope_theta=[0.0, -1.0, 1.0, 1e13], norm_eps=[0.0, 1e-30, 1.0],
           rope_scaling=["none", "linear", "llama3", "yarn"], rope_factor=[1.0, 0.0, 2.0],
           rope_low_freq_factor=[1.0, 4.0, 8.0], rope_high_freq_factor=[4.0, 1.0],
           rope_original_max_positions=[0, 1, 8], eos_id=[None, 0, 4, 200], bos_id=[None, 1, 200],
           extra_eos_ids=[(), (1,), (0, 0), [2, 3]])


@st.composite
def raw_configs(draw):
    """A valid family's config dict with up to three flags set to values from RAW (which may
    break any flag's range, type or pairing with the others), and a default storage."""
    cfg, _, _ = draw(families())
    d = cfg.to_dict()
    for name in draw(st.lists(st.sampled_from(sorted(RAW)), max_size=3, unique=True)):
        d[name] = draw(st.sampled_from(RAW[name]))
    qtype = draw(st.sampled_from(QUANTS + ("f32", "f16")))
    group = draw(st.sampled_from([8, 16, 12] if qtype[0] == "q" else [0, 0, 0, 8]))
    return d, qtype, group


@settings(max_examples=250 * SCALE, **SETTINGS)
@given(raw=raw_configs(), data=st.data())
def test_flag_combinations_are_refused_with_typed_errors(raw, data):
    """Any combination is either refused with a TinyLoopError (at ModelConfig, write_model or
    load_model) or loads and runs score / generate / score_decoded."""
    d, qtype, group = raw
    try:
        cfg = ModelConfig(**d)
    except TinyLoopError:
        event("refused: ModelConfig")
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.tinyloop")
        try:
            tq = TensorQuant(qtype, group)
            write_model(path, cfg, random_weights(cfg, 1), default_quant=tq)
        except TinyLoopError:
            event("refused: write_model")
            return
        max_seq = data.draw(st.integers(1, 12), label="max_seq_len")
        m = tl.load_model(path, max_seq_len=max_seq, backend="cpu", prefill_chunk=data.draw(st.integers(0, 3)))
    event("loaded and ran")
    try:
        ids = data.draw(st.lists(st.integers(0, cfg.vocab_size - 1), min_size=1, max_size=6), label="ids")
        try:
            out = tl.score(m, ids, cache_mode="fp32")
            assert out.shape == (len(ids), cfg.vocab_size) and np.all(np.isfinite(out))
        except IncompatibleModesError:
            assert cfg.sliding_window and len(ids) > cfg.sliding_window
        except InvalidInputError:
            assert len(ids) > max_seq
        n = data.draw(st.integers(1, 4), label="max_tokens")
        window = min(cfg.sliding_window, max_seq) if not in_window(cfg, len(ids) + n) else 0
        try:
            out = tl.generate(m, ids, tl.GenerateConfig(max_tokens=n, cache_window=window))
            assert out[:len(ids)] == ids and len(out) <= len(ids) + n
        except InvalidInputError:
            assert len(ids) + n > max_seq
        ids = ids[:min(cfg.sliding_window or max_seq, max_seq)]
        tl.score_decoded(m, ids, tl.GenerateConfig(cache_mode="int4"))
    finally:
        tl.free_model(m)
