"""Early exit against an INDEPENDENT float64 reference decoder written from the documented rules
(tinyloop/runtime/early_exit.py, tinyloop/plugins/exits/criteria.py, docs/ARCHITECTURE.md "Early
exit"), not from the runtime's code: :class:`ExitReference` runs every position one loop
iteration at a time on the float64 oracle's building blocks (tinyloop.model.reference), keeps
its own K/V per (layer, position), probes at min_L, min_L + peek_every, ... below loops (a
comparing criterion's first reference at max(0, min_L - peek_every)), computes each statistic from
its documented formula (the gate's cumulative exit probability in the Ouro paper's form,
sum_t lambda_t prod_{s<t} (1 - lambda_s)), exits after `patience` consecutive stable probes and
fills the skipped iterations' K/V by the documented policy. The runtime's greedy tokens, per-token
depths (GenerateStats.token_loops), probe counts, loops_used and loop_iters_run must equal it on
small random models over the parameter space (hypothesis, derandomized) and on the shipped
demo-exit model, through every path that decodes with early exit (guarded and host probes,
uncached, prefix cache and pool, streaming, iterator, teacher-forced scoring, sampling).

Decisions closer to their boundary than float32 arithmetic can resolve are ill-conditioned: such
examples are skipped (hypothesis.assume), and the fixed cases are checked to be clear of them.

Also: the criteria's statistics and stability directions against the docs' table, the learned
gate's cumulative formula, bad input (typed errors naming the value, before any work, nothing
left behind) and the docs' statements about the schedule and the defaults."""

from __future__ import annotations

import ast
import inspect
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings, strategies as st

import tinyloop as tl
from tinyloop.analysis.loopgain import HELDOUT_TEXT
from tinyloop.model import reference as R
from tinyloop.model.reference import reference_logits_exit
from tinyloop.models import model_path
from tinyloop.plugins.exits import criteria as criteria_module
from tinyloop.runtime.plugins import get_plugin_manager

from conftest import logical_weights, write_tiny

ROOT = Path(__file__).resolve().parents[1]
CRITERIA = ("hidden_l2", "kl", "argmax", "logit_margin", "gate")
LOGIT_CRITERIA = ("kl", "argmax", "logit_margin")
#: A decision is resolved only when its statistic is further than this (relative) from the
#: threshold, and at least FLOOR[criterion] (absolute) away: the runtime computes in float32.
REL = 1e-3
FLOOR = {"hidden_l2": 1e-5, "kl": 1e-6, "logit_margin": 1e-4, "gate": 1e-6}
#: A greedy or argmax choice is resolved when top-1 exceeds top-2 by this much of max(1, |top-1|).
GAP = 1e-4
SETTINGS = dict(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])


# =============================================================================== the reference
def _log_softmax(z):
    m = float(np.max(z))
    return z - m - math.log(float(np.sum(np.exp(z - m))))


def _top2(z):
    a = np.sort(z)
    return float(a[-1]), float(a[-2])


def ouro_cdf(lams):
    """The Ouro paper's cumulative exit probability after len(lams) steps: the sum over steps t of
    p(t) = lambda_t * prod_{s<t} (1 - lambda_s)."""
    total, survive = 0.0, 1.0
    for lam in lams:
        total += lam * survive
        survive *= 1.0 - lam
    return total


def doc_statistic(name, cur, prev, lams=()):
    """The statistic of criterion `name` as the criteria table defines it."""
    if name == "hidden_l2":
        return float(np.sqrt(np.sum((cur - prev) ** 2)) / np.sqrt(np.sum(cur * cur)))
    if name == "logit_margin":
        t1, t2 = _top2(cur)
        return t1 - t2
    if name == "kl":
        lp, lq = _log_softmax(cur), _log_softmax(prev)
        return float(np.sum(np.exp(lp) * (lp - lq)))
    if name == "argmax":
        return 0.0 if int(np.argmax(cur)) == int(np.argmax(prev)) else 1.0
    if name == "gate":
        return ouro_cdf(lams)
    raise AssertionError(name)


def doc_stable(name, value, threshold):
    """The table's "stable when" column."""
    if name in ("logit_margin", "gate"):
        return value >= threshold
    if name == "argmax":
        return value == 0.0
    return value < threshold


class ExitReference:
    """Float64 early-exit decoding of one request, one position and one loop iteration at a time.

    Prompt positions run at full depth; every later position probes as documented. K/V live in
    ``self.kv[layer][position]`` (layer: "pre.i", ("loop", iteration, j), "post.i"), so an exited
    position's skipped iterations hold exactly what the policy puts there. ``ill`` is set when a
    decision was too close to call in float32 (see REL, FLOOR, GAP)."""

    def __init__(self, cfg, W, loops, criterion, threshold, patience, min_L, peek_every, kv,
                 window=0, kv_round=None):
        self.cfg, self.L = cfg, loops
        self.W = {k: np.asarray(v, np.float64) for k, v in W.items()}
        self.crit, self.th, self.patience = criterion, threshold, patience
        self.min_L, self.peek, self.policy = min_L, peek_every, kv
        self.window = R._window(cfg, window)
        self.round = R._kv_model(kv_round, None)
        self.kv = {}
        self.probes = 0
        self.ill = ""             # why a decision was too close to call
        self.iters = 0

    # ---------------------------------------------------------------- one row on the oracle's blocks
    def _rows(self, row, pos):
        X = np.zeros((pos + 1, row.shape[-1]))
        X[pos] = row
        return X

    def _qkv(self, p, x, pos):
        q, k, v = R._qkv(self.cfg, self.W, p, self._rows(x, pos), self.round)    # RoPE at `pos`
        return q[pos], k[pos], v[pos]

    def _block(self, p, layer, x, pos):
        q, k, v = self._qkv(p, x, pos)
        kept = self.kv.setdefault(layer, {})
        kept[pos] = (k, v)
        K = np.stack([kept[i][0] for i in range(pos + 1)])
        V = np.stack([kept[i][1] for i in range(pos + 1)])
        return R._block_with(self.cfg, self.W, p, self._rows(x, pos), self._rows(q, pos), K, V, self.window)[pos]

    def _head(self, x):
        return R._head(self.cfg, self.W, x[None])[0]

    def _gate(self, x):
        z = float(self.W["exit_gate"] @ x + self.W["exit_gate_bias"][0])
        return 1.0 / (1.0 + math.exp(-z))

    def _check_gap(self, z):
        t1, t2 = _top2(z)
        if t1 - t2 <= GAP * max(1.0, abs(t1)) and not np.all(z == z[0]):    # (all equal: token 0 exactly)
            self.ill = f"top-2 gap {t1 - t2:.2e}"

    # ---------------------------------------------------------------- the documented decision
    def _stable(self, cur, prev, lams):
        c = self.crit
        value = doc_statistic(c, cur, prev, lams)
        if c == "argmax":
            self._check_gap(cur)
            self._check_gap(prev)
        elif abs(value - self.th) <= max(REL * self.th, FLOOR[c]):
            self.ill = f"{c} statistic {value:.6g} at threshold {self.th:.6g}"
        return doc_stable(c, value, self.th)

    def step(self, tok, pos, probing):
        """(logits, depth) of the position holding `tok`."""
        cfg, W, L = self.cfg, self.W, self.L
        x = R._embed(cfg, W, [tok])[0]
        for i in range(cfg.n_pre):
            x = self._block(f"pre.{i}.", f"pre.{i}", x, pos)
        e = x
        x = R._loop_start(cfg, self._rows(x, pos))[pos]          # the seeded draw is per position
        value = self._head if self.crit in LOGIT_CRITERIA else (lambda s: s)
        probes = set(range(self.min_L, L, self.peek)) if probing else set()
        compares = self.crit in ("hidden_l2", "kl", "argmax")
        ref = max(0, self.min_L - self.peek) if probing and compares else None
        prev = value(x) if ref == 0 else None
        lams, run, depth = [], 0, L
        for it in range(L):
            x = R._inject(cfg, W, x[None], e[None], it)[0]
            for j in range(cfg.n_loop):
                x = self._block(f"loop.{j}.", ("loop", it, j), x, pos)
            x = R._iter_end(cfg, W, x[None])[0]
            d = it + 1
            if self.crit == "gate":
                lams.append(self._gate(x))
            if d == ref:
                prev = value(x)
            elif d in probes:
                cur = value(x)
                self.probes += 1
                run = run + 1 if self._stable(cur, prev, lams) else 0
                prev = cur
                if run >= self.patience:
                    depth = d
                    break
        self.iters += depth
        for i in range(depth, L):                 # the skipped iterations' K/V
            for j in range(cfg.n_loop):
                if self.policy == "copy_last":    # the last iteration run, same loop layer
                    kv = self.kv[("loop", depth - 1, j)][pos]
                else:                             # layer j's projections of the exited state, injected
                    kv = self._qkv(f"loop.{j}.", R._inject(cfg, W, x[None], e[None], i)[0], pos)[1:]
                self.kv.setdefault(("loop", i, j), {})[pos] = kv
        x = R._loop_end(cfg, W, x[None])[0]
        for i in range(cfg.n_post):
            x = self._block(f"post.{i}.", f"post.{i}", x, pos)
        return self._head(x), depth

    def generate(self, prompt, n):
        """Greedy decoding: (prompt + n tokens, the depth behind each generated token)."""
        for p, t in enumerate(prompt):
            logits, _ = self.step(t, p, probing=False)
        self.iters = self.L                       # the prompt: one forward at full depth
        toks, depths = list(prompt), [self.L]
        while True:
            self._check_gap(logits)
            toks.append(int(np.argmax(logits)))
            if len(toks) - len(prompt) == n:
                return toks, depths
            logits, d = self.step(toks[-1], len(toks) - 1, probing=True)
            depths.append(d)

    def score(self, toks, prompt_len=1):
        """Teacher forcing: (logits of every position, its depth)."""
        rows, depths = [], []
        for p, t in enumerate(toks):
            z, d = self.step(t, p, probing=p >= prompt_len)
            rows.append(z)
            depths.append(d)
        return np.array(rows), depths


# =============================================================================== one BLAS thread
def _openblas():
    """numpy's OpenBLAS (its thread-count calls), or None."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            libs = sorted(set(re.findall(r"\S*openblas\S*\.so\S*", f.read())))
        for path in libs:
            lib = ctypes.CDLL(path)
            for prefix in ("scipy_openblas", "openblas"):
                for suffix in ("64_", ""):
                    get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                    put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                    if get is not None and put is not None:
                        return get, put
    except OSError:
        pass
    return None


@pytest.fixture(scope="module", autouse=True)
def one_blas_thread():
    """The reference's small float64 products on one BLAS thread: beside the CPU backend's thread
    team, a multi-threaded OpenBLAS runs them several times slower on a 2-core machine."""
    calls = _openblas()
    if calls is None:
        yield
        return
    get, put = calls
    n = get()
    put(1)
    yield
    put(n)


# =============================================================================== models
#: Small random models over the layouts that change what a probe reads and what a fill writes.
VARIANTS = {
    "add": dict(),                                                       # n_loop 2, input injection
    "flat": dict(n_post=0, loop_inject="none", n_loop=1),
    "ouro": dict(n_pre=0, n_post=0, loop_inject="none", loop_norm="every", head_norm=False,
                 block_norm="sublayer", tied_embeddings=False),          # Ouro's layout
    "adapter": dict(loop_inject="adapter", loop_init="zeros", loop_norm="after", block_norm="sandwich"),
    "seeded": dict(loop_inject="adapter", loop_init="random", loop_init_scale=1.0, loop_init_seed=7),
}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("exitref")
    out = {}
    for name, over in VARIANTS.items():
        path = d / f"{name}.tinyloop"
        write_tiny(path, seed=4, quant="f32", default_loops=5, max_loops=8, exit_gate=True, **over)
        out[name] = (tl.load_model(str(path), max_seq_len=64, backend="cpu"), logical_weights(path))
    yield out
    for m, _ in out.values():
        tl.free_model(m)


@pytest.fixture(scope="module")
def demo_exit():
    m = tl.load_model("demo-exit", max_seq_len=128, backend="cpu")
    yield m, logical_weights(model_path("demo-exit"))
    tl.free_model(m)


#: Thresholds by regime: "never" no probe is stable, "always" every probe is; "mixed" draws.
NEVER = {"hidden_l2": 1e-9, "kl": 1e-9, "logit_margin": 1e6, "gate": 1.0}
ALWAYS = {"hidden_l2": 1e6, "kl": 1e6, "logit_margin": 1e-9, "gate": 1e-9}
MIXED = {"hidden_l2": (0.05, 1.2), "kl": (1e-3, 0.5), "logit_margin": (0.3, 6.0), "gate": (0.05, 0.99)}


@st.composite
def requests(draw):
    """(criterion, loops, min_L, peek_every, patience, kv, regime, threshold, config kwargs)."""
    crit = draw(st.sampled_from(CRITERIA), label="criterion")
    L = draw(st.integers(2, 6), label="loops")
    if crit == "gate":
        min_L = peek = 1
    else:
        min_L = draw(st.integers(1, L - 1), label="min_L")
        peek = draw(st.integers(1, 3), label="peek_every")
    patience = draw(st.integers(1, min(3, len(range(min_L, L, peek)))), label="patience")
    kv = draw(st.sampled_from(["copy_last", "recompute"]), label="kv")
    regime = "mixed" if crit == "argmax" else draw(st.sampled_from(["mixed", "never", "always"]), label="regime")
    th = None
    if crit != "argmax":
        if regime == "mixed":
            lo, hi = MIXED[crit]
            th = float(math.exp(draw(st.floats(math.log(lo), math.log(hi)), label="log threshold")))
        else:
            th = (NEVER if regime == "never" else ALWAYS)[crit]
    kw = dict(loops=L, early_exit_patience=patience, early_exit_criterion=crit, early_exit_min_L=min_L,
              early_exit_peek_every=peek, early_exit_kv=kv)
    if crit == "logit_margin":
        kw["early_exit_logit_margin"] = th
    elif th is not None:
        kw["early_exit_threshold"] = th
    return crit, L, min_L, peek, patience, kv, regime, th, kw


def _ref(m, W, req, window=0, mode="fp32"):
    crit, L, min_L, peek, patience, kv, _, th, _ = req
    return ExitReference(m.cfg, W, L, crit, th, patience, min_L, peek, kv, window=window,
                         kv_round=np.float16 if mode == "fp16" else None)


def _resolved(ref):
    """Skip an example whose reference met a decision too close to call in float32."""
    event("skipped: " + " ".join(ref.ill.split()[:2]) if ref.ill else "resolved")
    assume(not ref.ill)


def _check_stats(st_, depths, ref, iters=True):
    assert st_.token_loops == depths, f"depths {st_.token_loops}, the reference's {depths}"
    assert st_.exit_probes == ref.probes, f"probes {st_.exit_probes}, the reference's {ref.probes}"
    assert st_.loops_used == pytest.approx(float(np.mean(depths)), abs=1e-12)
    if iters:
        assert st_.loop_iters_run == ref.iters


# =============================================================================== generate vs the reference
@settings(max_examples=120, **SETTINGS)
@given(data=st.data())
def test_greedy_decoding_equals_the_reference(small, data):
    """Tokens, per-token depths, probe counts, loops_used and loop_iters_run of greedy generate
    equal the reference's, for every criterion, threshold regime, patience, peek_every, min_L, K/V
    policy, fp32 / fp16 cache and a window cache."""
    variant = data.draw(st.sampled_from(sorted(VARIANTS)), label="model")
    m, W = small[variant]
    req = data.draw(requests(), label="request")
    crit, L, min_L, peek, patience, kv, regime, th, kw = req
    mode = data.draw(st.sampled_from(["fp32", "fp16"]), label="cache_mode")
    window = data.draw(st.sampled_from([0, 0, 3, 6]), label="cache_window")
    prompt = data.draw(st.lists(st.integers(0, m.cfg.vocab_size - 1), min_size=1, max_size=6), label="prompt")
    n = data.draw(st.integers(2, 12), label="max_tokens")
    ref = _ref(m, W, req, window, mode)
    want, depths = ref.generate(prompt, n)
    _resolved(ref)
    event(f"{regime}: {'some exits' if min(depths) < L else 'no exit'}")
    event(f"{crit}, {kv}")
    st_ = tl.GenerateStats()
    got = tl.generate(m, prompt, tl.GenerateConfig(max_tokens=n, cache_mode=mode, cache_window=window, **kw),
                      stats=st_)
    assert got == want
    _check_stats(st_, depths, ref, iters=window == 0)
    if regime == "never":
        assert depths == [L] * n
    elif regime == "always":
        assert depths == [L] + [min_L + (patience - 1) * peek] * (n - 1)


PATHS = ("host_probes", "uncached", "prefix_cache", "prefix_pool", "stream", "iter", "score_decoded", "sampling")


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=20, **SETTINGS)
@given(data=st.data())
def test_every_decoding_path_equals_the_reference(small, path, data):
    """The same through the host probes (no guarded_steps), the uncached path, a prefix cache and a
    prefix pool, generate_stream (each token's depth visible to its callback), generate_iter,
    score_decoded (teacher forcing: depths and logits) and sampling (its depths against the
    reference teacher-forced on the sampled tokens)."""
    variant = data.draw(st.sampled_from(sorted(VARIANTS)), label="model")
    m, W = small[variant]
    req = data.draw(requests(), label="request")
    kw = req[-1]
    V = m.cfg.vocab_size
    prompt = data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=6), label="prompt")
    n = data.draw(st.integers(2, 10), label="max_tokens")
    cfg = tl.GenerateConfig(max_tokens=n, cache_mode="fp32", **kw)
    ref = _ref(m, W, req)
    st_ = tl.GenerateStats()
    if path == "score_decoded":
        toks = prompt + data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n), label="tokens")
        rows, depths = ref.score(toks)
        _resolved(ref)
        got = tl.score_decoded(m, toks, cfg.replace(max_tokens=0), stats=st_)
        _check_stats(st_, depths, ref, iters=False)
        scale = np.abs(rows).max()
        assert np.abs(got - rows).max() <= 1e-4 * scale
        # the reference's logits are the oracle's at the depths it chose (reference_logits_exit)
        oracle = reference_logits_exit(m.cfg, W, toks, depths, req[1], req[5])
        assert np.abs(oracle - rows).max() <= 1e-9 * scale
        return
    if path == "sampling":
        cfg = cfg.replace(temperature=0.9, top_k=20, sample_seed=data.draw(st.integers(0, 99), label="seed"))
        got = tl.generate(m, prompt, cfg, stats=st_)
        _, depths = ref.score(got[:-1], len(prompt))
        _resolved(ref)
        _check_stats(st_, [req[1]] + depths[len(prompt):], ref, iters=False)
        return
    want, depths = ref.generate(prompt, n)
    _resolved(ref)
    seen = []
    with pytest.MonkeyPatch.context() as mp:          # per example: hypothesis reuses the test's fixtures
        if path == "host_probes":
            caps = m.backend.capabilities
            mp.setattr(type(m.backend), "capabilities", property(lambda self: caps - {"guarded_steps"}))
            got = tl.generate(m, prompt, cfg, stats=st_)
        elif path == "uncached":
            mp.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
            got = tl.generate(m, prompt, cfg, stats=st_)
        elif path == "prefix_cache":
            k = data.draw(st.integers(1, len(prompt)), label="prefix")
            pc = tl.build_prefix_cache(m, prompt[:k], loops=req[1], cache_mode="fp32")
            try:
                got = tl.generate_from_prefix_cache(m, pc, prompt[k:], cfg, stats=st_)
            finally:
                tl.free_prefix_cache(pc)
            assert st_.reused_tokens == min(k, len(prompt) - 1)
        elif path == "prefix_pool":
            k = data.draw(st.integers(1, len(prompt)), label="prefix")
            pool = tl.create_prefix_pool(2)
            try:
                tl.register_prefix(pool, m, prompt[:k], loops=req[1], cache_mode="fp32")
                got = tl.generate_with_pool(m, pool, prompt, cfg, stats=st_)
            finally:
                tl.free_prefix_pool(pool)
        elif path == "stream":
            got = tl.generate_stream(m, prompt, cfg, stats=st_,
                                     on_token=lambda tok, pos: seen.append((tok, st_.token_loops[-1])) or True)
            assert seen == list(zip(want[len(prompt):], depths))     # each token with its own depth
        else:
            got = list(prompt) + list(tl.generate_iter(m, prompt, cfg, stats=st_))
    event(f"{req[0]}: {'some exits' if min(depths) < req[1] else 'no exit'}")
    assert got == want
    _check_stats(st_, depths, ref, iters=path != "uncached")


# =============================================================================== the shipped demo-exit model
DEMO_CASES = [("gate", 0.9), ("gate", 0.6), ("kl", 0.05), ("hidden_l2", 0.4), ("argmax", None), ("logit_margin", 2.0)]


@pytest.mark.parametrize("kv", ["copy_last", "recompute"])
@pytest.mark.parametrize("crit,th", DEMO_CASES)
def test_demo_exit_equals_the_reference(demo_exit, crit, th, kv):
    """demo-exit (INT4, its learned exit gate): greedy tokens, depths and probes of 14 tokens equal
    the reference's (patience 1; gate min_L 1, the others min_L 2 or 1)."""
    m, W = demo_exit
    min_L = 1 if crit in ("gate", "argmax") else 2
    L = m.cfg.default_loops
    kw = dict(early_exit_logit_margin=th) if crit == "logit_margin" else (
        dict(early_exit_threshold=th) if th is not None else {})
    prompt = m.tokenizer.encode("def fibonacci(n):\n    ")
    ref = ExitReference(m.cfg, W, L, crit, th, 1, min_L, 1, kv)
    want, depths = ref.generate(prompt, 14)
    assert not ref.ill, f"a decision of this fixed case is too close to call ({ref.ill}): pick another prompt"
    st_ = tl.GenerateStats()
    cfg = tl.GenerateConfig(max_tokens=14, cache_mode="fp32", early_exit_patience=1, early_exit_criterion=crit,
                            early_exit_min_L=min_L, early_exit_kv=kv, **kw)
    assert tl.generate(m, prompt, cfg, stats=st_) == want
    _check_stats(st_, depths, ref)
    assert min(depths) < L


def test_demo_exit_gate_teacher_forced(demo_exit):
    """The gate at threshold 0.9 with patience 2 on held-out text, teacher-forced: the depth of
    every position and the probes equal the reference's (an exit needs two stable probes, so
    none happens before depth 2)."""
    m, W = demo_exit
    ids = m.tokenizer.encode(HELDOUT_TEXT.read_text(encoding="utf-8")[400:800])[:28]
    ref = ExitReference(m.cfg, W, 4, "gate", 0.9, 2, 1, 1, "copy_last")
    _, depths = ref.score(ids)
    assert not ref.ill, ref.ill
    st_ = tl.GenerateStats()
    tl.score_decoded(m, ids, tl.GenerateConfig(cache_mode="fp32", early_exit_patience=2, early_exit_min_L=1,
                                               early_exit_criterion="gate", early_exit_threshold=0.9), stats=st_)
    _check_stats(st_, depths, ref, iters=False)
    assert set(depths) <= {2, 3, 4} and min(depths) < 4


@pytest.mark.parametrize("kw,crit,th", [
    (dict(early_exit_criterion="hidden_l2"), "hidden_l2", 0.1),
    (dict(), "hidden_l2", 0.1),                                             # "": the spec's default criterion
    (dict(early_exit_criterion="kl"), "kl", 0.01),
    (dict(early_exit_criterion="logit_margin"), "logit_margin", 3.0),
    (dict(early_exit_logit_margin=1.5), "logit_margin", 1.5),              # a margin selects logit_margin
    (dict(early_exit_criterion="gate", early_exit_min_L=1), "gate", 0.5),
])
def test_unset_thresholds_and_criterion_take_the_documented_defaults(small, kw, crit, th):
    """early_exit_threshold 0 is the criterion's documented default, early_exit_criterion "" the
    spec's choice (logit_margin when early_exit_logit_margin > 0, else hidden_l2)."""
    m, W = small["add"]
    min_L = kw.get("early_exit_min_L", 2)
    ref = ExitReference(m.cfg, W, 5, crit, th, 1, min_L, 1, "copy_last")
    prompt = [3, 1, 4, 1, 5]
    want, depths = ref.generate(prompt, 10)
    assert not ref.ill, ref.ill
    st_ = tl.GenerateStats()
    assert tl.generate(m, prompt, tl.GenerateConfig(max_tokens=10, loops=5, early_exit_patience=1,
                                                    cache_mode="fp32", **kw), stats=st_) == want
    _check_stats(st_, depths, ref)


# =============================================================================== the criteria as documented
def _table():
    """{criterion: (statistic, stable when, default)} from criteria.py's table."""
    rows = {}
    for line in criteria_module.__doc__.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 4 and cells[0] in CRITERIA:
            rows[cells[0]] = tuple(cells[1:])
    return rows


def test_the_criteria_table_describes_the_plugins():
    """Each built-in's stat, the row it reads, whether it compares, its default and its stability
    direction (ties included) are what the table in tinyloop/plugins/exits/criteria.py says, and
    its statistic is the table's formula on random rows."""
    table = _table()
    plugins = get_plugin_manager().exit_criteria()
    assert set(table) == set(CRITERIA) <= set(plugins)
    rng = np.random.default_rng(0)
    stats = {"hidden_l2": "rel_l2", "logit_margin": "top2_margin", "kl": "kl", "argmax": "argmax_change",
             "gate": "gate_cdf"}
    for name, (formula, when, default) in table.items():
        cls = plugins[name]
        assert cls.stat == stats[name]
        assert cls.reads == ("logits" if "z" in formula else "hidden"), name
        assert cls.needs_previous == ("'" in formula), name
        assert cls.default_threshold == (None if default == "none" else float(default)), name
        if name == "gate":
            continue            # its own test below
        crit = cls(cls.threshold_of(tl.GenerateConfig()))
        for _ in range(5):
            a, b = rng.standard_normal(40) * 3, rng.standard_normal(40) * 3
            want = doc_statistic(name, a, b)
            got = crit.statistic(a, b if cls.needs_previous else None)
            assert got == pytest.approx(want, rel=1e-12, abs=1e-15), name
            assert crit.stable(got) == doc_stable(name, want, crit.threshold)
        if name != "argmax":
            below = when.startswith("statistic <")
            assert crit.stable(crit.threshold) == (not below), f"{name} at its threshold ({when})"
            assert crit.stable(crit.threshold * (1 - 1e-9)) == below


def test_gate_statistic_is_the_ouro_cumulative_exit_probability(demo_exit):
    """The gate's statistic after d iterations is sum_{t<=d} lambda_t prod_{s<t} (1 - lambda_s)
    with lambda_t = sigmoid(g . x_t + b) (equal to 1 - prod_{t<=d} (1 - lambda_t)), reset per
    token, on the host criterion and on the CPU backend's guarded probe alike."""
    m, _ = demo_exit
    g, b = m.exit_gate
    plugins = get_plugin_manager().exit_criteria()
    cfg = tl.GenerateConfig(early_exit_patience=1, early_exit_min_L=1, early_exit_criterion="gate")
    rng = np.random.default_rng(1)
    be = m.backend
    gate = (np.asarray(g, np.float64), np.asarray([b], np.float64))
    firsts = []
    for scale, q in [(0.1, 0.9), (4.0, 0.9995), (8.0, 0.5)]:      # one token each
        crit = plugins["gate"](q)
        crit.bind(m, cfg)
        crit.begin_token()
        be.exit_reset()
        lams = []
        for d in range(1, 7):
            x = (rng.standard_normal(m.cfg.d_model) * scale).astype(np.float32)
            lams.append(1.0 / (1.0 + math.exp(-(float(g @ x.astype(np.float64)) + b))))
            want = ouro_cdf(lams)
            assert abs(want - q) > 1e-6
            assert want == pytest.approx(1.0 - np.prod([1.0 - v for v in lams]), rel=1e-12)
            assert crit.statistic(x.astype(np.float64), None) == pytest.approx(want, rel=1e-12, abs=1e-15)
            assert crit.stable(want) == (want >= q)
            be.exit_probe(m.ws, x[None], "gate_cdf", q, 1, d, True, gate=gate)
            first = next((i + 1 for i in range(d) if ouro_cdf(lams[:i + 1]) >= q), 0)
            assert be.exit_depth() == first
        firsts.append(first)
    assert 0 in firsts and max(firsts) > 0, firsts


# =============================================================================== bad input
BAD = [
    (dict(early_exit_patience=1, early_exit_min_L=4), tl.ConfigError, r"early_exit_min_L=4 .*loops=4"),   # == loops
    (dict(early_exit_patience=1, early_exit_min_L=6, loops=4), tl.ConfigError, r"early_exit_min_L=6"),
    (dict(early_exit_patience=1, early_exit_min_L=0), tl.ConfigError, r"early_exit_min_L=0"),
    (dict(early_exit_patience=1, early_exit_peek_every=0), tl.ConfigError, r"early_exit_peek_every=0"),
    (dict(early_exit_patience=1, early_exit_peek_every=-3), tl.ConfigError, r"early_exit_peek_every=-3"),
    (dict(early_exit_patience=1, early_exit_threshold=-0.5), tl.ConfigError, r"early_exit_threshold=-0.5"),
    (dict(early_exit_patience=1, early_exit_threshold=float("nan")), tl.ConfigError, r"early_exit_threshold"),
    (dict(early_exit_patience=1, early_exit_logit_margin=-2.0), tl.ConfigError, r"early_exit_logit_margin=-2.0"),
    (dict(early_exit_patience=1, early_exit_criterion="Gate"), tl.PluginError, r"early_exit_criterion='Gate'"),
    (dict(early_exit_patience=1, early_exit_criterion="gate"), tl.ConfigError, r"early_exit_min_L=1 .*got 2"),
    (dict(early_exit_patience=1, early_exit_criterion="gate", early_exit_min_L=1, early_exit_peek_every=2),
     tl.ConfigError, r"got 1 and 2"),
    (dict(early_exit_patience=1, early_exit_criterion="gate", early_exit_min_L=1, early_exit_threshold=1.5),
     tl.ConfigError, r"early_exit_threshold=1.5"),
    (dict(early_exit_patience=4, early_exit_criterion="gate", early_exit_min_L=1), tl.ConfigError,
     r"early_exit_patience=4"),
    (dict(early_exit_patience=1, early_exit_criterion="gate", early_exit_min_L=1, early_exit_logit_margin=1.0),
     tl.IncompatibleModesError, r"early_exit_logit_margin=1.0"),
    (dict(early_exit_patience=1, early_exit_criterion="argmax", early_exit_threshold=0.3), tl.ConfigError,
     r"early_exit_threshold=0.3"),
    (dict(early_exit_criterion="gate"), tl.IncompatibleModesError, r"early_exit_criterion='gate'"),
    (dict(early_exit_threshold=0.2), tl.IncompatibleModesError, r"early_exit_threshold=0.2"),
    (dict(early_exit_patience=1, beam_size=2), tl.IncompatibleModesError, r"beam"),
]

ENTRY_POINTS = {
    "generate": lambda m, ids, cfg, pc, pool: tl.generate(m, ids, cfg),
    "generate_iter": lambda m, ids, cfg, pc, pool: tl.generate_iter(m, ids, cfg),
    "score_decoded": lambda m, ids, cfg, pc, pool: tl.score_decoded(m, ids, cfg.replace(max_tokens=0)),
    "prefix_cache": lambda m, ids, cfg, pc, pool: tl.generate_from_prefix_cache(m, pc, ids[2:], cfg),
    "prefix_pool": lambda m, ids, cfg, pc, pool: tl.generate_with_pool(m, pool, ids, cfg),
}


@pytest.mark.parametrize("kw,exc,match", BAD)
def test_bad_input_is_refused_before_any_work(demo_exit, monkeypatch, kw, exc, match):
    """Every entry point that decodes with early exit refuses bad exit settings with a typed error
    naming the value, before any cache is allocated, with nothing left live and the pool's counters
    untouched."""
    m, _ = demo_exit
    ids = [5, 6, 7, 8]
    pc = tl.build_prefix_cache(m, ids[:2], loops=4)
    pool = tl.create_prefix_pool(2)
    tl.register_prefix(pool, m, ids[:2], loops=4)
    live, counters = m._live_cache_bytes, dict(pool.stats())
    calls = []
    monkeypatch.setattr(m.backend, "alloc_cache", lambda *a: calls.append(a))
    try:
        for name, call in ENTRY_POINTS.items():
            with pytest.raises(exc, match=match):
                call(m, ids, tl.GenerateConfig(max_tokens=3, **kw), pc, pool)
            assert calls == [], name
            assert m._live_cache_bytes == live and pool.stats() == counters, name
    finally:
        monkeypatch.undo()
        tl.free_prefix_cache(pc)
        tl.free_prefix_pool(pool)
    assert m._live_cache_bytes == 0


def test_rejected_compositions(demo_exit, monkeypatch):
    """compat.yaml's early_exit row: batched, speculative, tree-speculative and warm start (a
    resume handle, built or served) are refused by name before any work; the gate needs a gate."""
    m, _ = demo_exit
    cfg = tl.GenerateConfig(max_tokens=3, early_exit_patience=1, early_exit_criterion="kl", early_exit_threshold=0.05)
    handle = tl.build_resume_handle(m, [5, 6, 7], 2)
    calls = []
    monkeypatch.setattr(m.backend, "alloc_cache", lambda *a: calls.append(a))
    try:
        with pytest.raises(tl.IncompatibleModesError, match="batched"):
            tl.generate_batch(m, [[5, 6], [7]], cfg)
        for depth in (2, 4):
            with pytest.raises(tl.IncompatibleModesError, match="warm_start"):
                tl.resume_generate(handle, depth, cfg.replace(early_exit_min_L=1))
        with pytest.raises(tl.IncompatibleModesError, match="warm_start"):
            tl.build_resume_handle(m, [5, 6, 7], 2, cfg.replace(max_tokens=0, early_exit_min_L=1))
        with pytest.raises(tl.IncompatibleModesError, match="speculative"):
            tl.generate(m, [5, 6], cfg.replace(decoder="speculative", options={"draft_loops": 1, "verify_loops": 4}))
        with pytest.raises(tl.IncompatibleModesError, match="tree_speculative"):
            tl.generate(m, [5, 6], cfg.replace(decoder="tree_speculative",
                                               options={"draft_loops": 1, "verify_loops": 4}))
        assert calls == []
    finally:
        monkeypatch.undo()
        tl.free_resume_handle(handle)
    plain = tl.load_model("demo", max_seq_len=32, backend="cpu")
    try:
        with pytest.raises(tl.IncompatibleModesError, match="exit gate"):
            tl.generate(plain, [5, 6], tl.GenerateConfig(max_tokens=2, early_exit_patience=1, early_exit_min_L=1,
                                                         early_exit_criterion="gate"))
        assert plain._live_cache_bytes == 0
    finally:
        tl.free_model(plain)


# =============================================================================== the host-probe path's work
@pytest.mark.parametrize("min_L,peek", [(1, 1), (1, 2), (2, 2), (2, 1), (3, 1)])
def test_host_probes_run_the_pre_blocks_once_per_step(small, monkeypatch, min_L, peek):
    """Without guarded_steps the host reads the state at each stop; a reference probe at depth 0
    (min_L <= peek_every) reads the loop's initial state. The step must still embed the token and
    run the pre blocks once (they write the position's pre-layer K/V), not once more after that
    probe; depths and tokens as with the guarded step."""
    m, W = small["add"]
    cfg = tl.GenerateConfig(max_tokens=6, loops=4, early_exit_patience=1, early_exit_min_L=min_L,
                            early_exit_peek_every=peek, early_exit_criterion="hidden_l2",
                            early_exit_threshold=0.5, cache_mode="fp32")
    want = tl.GenerateStats()
    out = tl.generate(m, [3, 9, 27], cfg, stats=want)
    caps = m.backend.capabilities
    monkeypatch.setattr(type(m.backend), "capabilities", property(lambda self: caps - {"guarded_steps"}))
    calls = []
    real = m.fwd.prefix
    monkeypatch.setattr(m.fwd, "prefix", lambda *a, **k: (calls.append(a[2]), real(*a, **k))[1])
    got = tl.GenerateStats()
    assert tl.generate(m, [3, 9, 27], cfg, stats=got) == out
    assert got.token_loops == want.token_loops and got.exit_probes == want.exit_probes
    assert len(calls) == 1 + 5, f"{len(calls)} prefix runs for 1 prompt forward and 5 decode steps"


# =============================================================================== the docs
def test_docs_state_the_reference_probe_depth():
    """The first comparison's reference lies at max(0, min_L - peek_every) (ExitPlan.reference_depth):
    every place that describes it says so."""
    from tinyloop.runtime.early_exit import ExitPlan
    crit = get_plugin_manager().exit_criteria()["kl"](0.1)
    for min_L, peek, want in [(3, 1, 2), (1, 2, 0), (2, 2, 0), (5, 2, 3)]:
        assert ExitPlan(crit, 1, min_L, peek, 8, "copy_last").reference_depth == want
    import tinyloop.runtime.early_exit as ee
    texts = {"early_exit.py": ee.__doc__, "docs/ARCHITECTURE.md": (ROOT / "docs/ARCHITECTURE.md").read_text(),
             "docs/PLUGINS.md": (ROOT / "docs/PLUGINS.md").read_text().split("## Early-exit criteria")[1][:2500]}
    for where, text in texts.items():
        assert "max(0, min_L - peek_every)" in text, where


def _field_doc(cls, name):
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and getattr(a.target, "id", None) == name and isinstance(b, ast.Expr):
            return b.value.value
    raise AssertionError(name)


def test_config_docs_name_every_built_in_criterion():
    doc = _field_doc(tl.GenerateConfig, "early_exit_criterion")
    for name in CRITERIA:
        assert re.search(rf"\b{name}\b", doc), f"GenerateConfig.early_exit_criterion's doc omits {name!r}"
    assert "loops" in _field_doc(tl.GenerateConfig, "early_exit_min_L")       # min_L < loops is required


def test_documented_default_thresholds():
    """criteria.py says which defaults keep the demo model within about 1 % perplexity at its
    default depth; measured (held-out text, teacher-forced decoding, 2 windows of 96) on the model
    each criterion runs on (the gate on demo-exit), every default so described is within 1.5 %."""
    from tinyloop.analysis.evaluate import decoded_perplexity
    doc = " ".join(criteria_module.__doc__.split())
    claim = re.search(r"The defaults of (.*?) keep", doc)
    table = _table()
    claimed = (set(re.findall(r"[a-z_0-9]+", claim.group(1))) & set(CRITERIA) if claim
               else {n for n, row in table.items() if row[2] != "none"})
    text = HELDOUT_TEXT.read_text(encoding="utf-8")
    out = {}
    for model_name, names in [("demo", ["hidden_l2", "kl", "logit_margin"]), ("demo-exit", ["gate"])]:
        m = tl.load_model(model_name, max_seq_len=160, backend="cpu")
        try:
            ids = m.tokenizer.encode(text[:96 * 2 * 8])
            base = decoded_perplexity(m, ids, tl.GenerateConfig(), window=96, max_windows=2)["ppl"]
            for n in names:
                cfg = tl.GenerateConfig(early_exit_patience=1, early_exit_criterion=n,
                                        early_exit_min_L=1 if n == "gate" else 2)
                out[n] = decoded_perplexity(m, ids, cfg, window=96, max_windows=2)["ppl"] / base - 1
        finally:
            tl.free_model(m)
    worse = {n: f"{100 * out[n]:+.1f} %" for n in claimed if out[n] > 0.015}
    assert not worse, f"criteria.py claims these defaults stay within about 1 %, measured: {worse}"
