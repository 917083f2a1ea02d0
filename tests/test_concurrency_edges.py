"""Concurrency and object lifecycle as a server or a multi-threaded application meets them (CPU).

The Python API: one model used from several threads keeps the documented contract (a second
concurrent call raises ModelBusyError at once, from every entry point; a call that runs gives the
tokens of the same call made alone); free_model from another thread is deferred and never lost,
even when it races the end of a request or a handle eviction that holds the model; handles and
pools of a freed model fail with typed errors; the live handle cap holds when two models build
handles at the same time, and a prefix pool cannot be bound to two models by concurrent first
registrations; models, handles and generators dropped without a free give their bytes back.

The HTTP server: more requests than the queue admits (429) with metrics that add up; a stream
dropped mid-generation frees the model for an identical next request; a request whose deadline
passes while it waits in the queue is answered at its deadline; an ``auto`` decoder request (which
calibrates on the model) is queued like any other instead of racing the worker; a failure outside
the decode loop fails its request without killing the worker; shutting the server down with
requests running and queued, and requests after it (503, as documented).

Threads are ordered with events and barriers; every wait and join has a generous limit that only
stops a hang."""

from __future__ import annotations

import concurrent.futures as cf
import gc
import json
import re
import threading
import weakref

import numpy as np
import pytest

import tinyloop as tl

LIMIT = 60.0                  # seconds: a safety net on every wait, never what decides an outcome
CFG = tl.GenerateConfig(max_tokens=6)
P = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77]


@pytest.fixture
def fresh(tiny_path):
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.fixture
def cap_restored():
    yield
    tl.set_handle_bytes_cap(None)


def _join(t: threading.Thread) -> None:
    t.join(LIMIT)
    assert not t.is_alive(), f"thread {t.name} did not finish"


class _Holder:
    """Another thread running a request on `model` that stays inside its first on_token callback
    until release(): the model is busy for exactly that long."""

    def __init__(self, model, prompt=P, config=CFG):
        self.model, self.inside, self.go = model, threading.Event(), threading.Event()
        self.result = self.error = None

        def cb(tok, pos):
            self.inside.set()
            assert self.go.wait(LIMIT)
            return True

        def run():
            try:
                self.result = tl.generate_stream(model, prompt, config, on_token=cb)
            except Exception as exc:        # noqa: BLE001 - the test reads it
                self.error = exc
        self.thread = threading.Thread(target=run, name="holder")
        self.thread.start()
        assert self.inside.wait(LIMIT), "the holding request never produced a token"

    def release(self):
        self.go.set()
        _join(self.thread)


def _in_thread(fn):
    """fn() on another thread (so a call that blocked instead of raising fails, not hangs)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:        # noqa: BLE001
            out["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    _join(t)
    return out


# =============================================================================== the Python API
def test_every_entry_point_is_refused_at_once_while_another_thread_runs(fresh):
    m = fresh
    pc = tl.build_prefix_cache(m, P[:4], loops=3)
    h = tl.build_resume_handle(m, P, 2)
    pool = tl.create_prefix_pool(4)
    tl.register_prefix(pool, m, P[:5], loops=3)
    small = tl.GenerateConfig(max_tokens=3)
    calls = {
        "generate": lambda: tl.generate(m, P, small),
        "generate_stream": lambda: tl.generate_stream(m, P, small, on_token=lambda t, p: True),
        "generate_iter": lambda: list(tl.generate_iter(m, P, small)),
        "generate_batch": lambda: tl.generate_batch(m, [P, P[:4]], small),
        "generate_speculative": lambda: tl.generate_speculative(
            m, P, tl.SpeculativeConfig(max_tokens=3, draft_loops=1, verify_loops=3)),
        "generate_tree_speculative": lambda: tl.generate_tree_speculative(
            m, P, tl.TreeSpeculativeConfig(max_tokens=3, draft_loops=1, verify_loops=3)),
        "score": lambda: tl.score(m, P, 3),
        "score_last_token": lambda: tl.score_last_token(m, P, 3),
        "score_decoded": lambda: tl.score_decoded(m, P),
        "score_logit_lens": lambda: tl.score_logit_lens(m, P, 3),
        "score_with_uncertainty": lambda: tl.score_with_uncertainty(m, P, 3),
        "score_with_consistency_escalation": lambda: tl.score_with_consistency_escalation(m, P, 2, 4, "entropy", .1),
        "build_prefix_cache": lambda: tl.build_prefix_cache(m, P[:3]),
        "generate_from_prefix_cache": lambda: tl.generate_from_prefix_cache(m, pc, P[4:], small),
        "generate_from_prefix_cache_iter": lambda: list(tl.generate_from_prefix_cache_iter(m, pc, P[4:], small)),
        "register_prefix": lambda: tl.register_prefix(pool, m, P[:6], loops=3),
        "generate_with_pool": lambda: tl.generate_with_pool(m, pool, P, small.replace(loops=3)),
        "generate_with_pool_iter": lambda: list(tl.generate_with_pool_iter(m, pool, P, small.replace(loops=3))),
        "build_resume_handle": lambda: tl.build_resume_handle(m, P, 2),
        "resume_generate": lambda: tl.resume_generate(h, 4, small),
        "resume_generate_iter": lambda: list(tl.resume_generate_iter(h, 4, small)),
        "calibrate": lambda: tl.calibrate(m, 3, prompts=[P[:3]], max_tokens=2),
        "free_prefix_cache": lambda: tl.free_prefix_cache(pc),
        "free_resume_handle": lambda: tl.free_resume_handle(h),
        "free_prefix_pool": lambda: tl.free_prefix_pool(pool),
    }
    want = {k: calls[k]() for k in ("generate", "score", "generate_from_prefix_cache", "resume_generate",
                                    "generate_with_pool")}
    alone = tl.generate(m, P, CFG)
    base, handles = tl.vram_usage_bytes(m), tl.live_handle_bytes()
    holder = _Holder(m)
    try:
        for name, call in calls.items():
            got = _in_thread(call)
            assert isinstance(got.get("error"), tl.ModelBusyError), (name, got)
        busy = tl.vram_usage_bytes(m)            # readable while busy: the running request's cache counts
        assert busy > base
    finally:
        holder.release()
    assert holder.error is None and holder.result == alone
    # nothing the refused calls touched changed: the handles serve as before, the bytes are back
    assert pc.alive and h.alive and len(pool.entries) == 1
    assert tl.vram_usage_bytes(m) == base and tl.live_handle_bytes() == handles
    for k, v in want.items():
        got = calls[k]()
        assert (np.array_equal(got, v) if isinstance(v, np.ndarray) else got == v), k
    tl.free_prefix_cache(pc)
    tl.free_resume_handle(h)
    tl.free_prefix_pool(pool)


def test_racing_threads_either_run_alone_or_are_refused(fresh):
    """Three threads start every kind of call at once, many times: each call either returns what
    the same call returns alone (token for token, logit for logit) or raises ModelBusyError; the
    model ends idle with its bytes back."""
    m = fresh
    pc = tl.build_prefix_cache(m, P[:4], loops=3)
    h = tl.build_resume_handle(m, P, 2)
    pool = tl.create_prefix_pool(2)
    tl.register_prefix(pool, m, P[:5], loops=3)
    cfg3 = tl.GenerateConfig(max_tokens=5, loops=3)
    calls = [
        lambda: tl.generate(m, P, CFG),
        lambda: tl.generate(m, P[:6], tl.GenerateConfig(max_tokens=5, temperature=0.9, top_k=20, sample_seed=4)),
        lambda: list(tl.generate_iter(m, P[2:], CFG)),
        lambda: tl.generate_batch(m, [P, P[:5]], CFG),
        lambda: tl.score(m, P, 3),
        lambda: tl.generate_from_prefix_cache(m, pc, P[4:], cfg3),
        lambda: tl.generate_with_pool(m, pool, P, cfg3),
        lambda: tl.resume_generate(h, 4, tl.GenerateConfig(max_tokens=5)),
        lambda: tl.generate_speculative(m, P, tl.SpeculativeConfig(max_tokens=5, draft_loops=1, verify_loops=3)),
    ]
    want = [c() for c in calls]
    base = tl.vram_usage_bytes(m)
    n_threads, rounds = 3, 4
    start = threading.Barrier(n_threads, timeout=LIMIT)
    results = [[] for _ in range(n_threads)]

    def worker(i):
        start.wait()
        for r in range(rounds):
            for j in range(len(calls)):
                k = (j + i * 3 + r) % len(calls)
                try:
                    results[i].append((k, calls[k]()))
                except tl.ModelBusyError:
                    results[i].append((k, "busy"))
                except Exception as exc:    # noqa: BLE001 - reported below
                    results[i].append((k, exc))
    ts = [threading.Thread(target=worker, args=(i,), name=f"racer{i}") for i in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        _join(t)
    ran = 0
    for rows in results:
        assert len(rows) == rounds * len(calls)
        for k, got in rows:
            if isinstance(got, str) and got == "busy":
                continue
            assert not isinstance(got, Exception), (k, got)
            same = np.array_equal(got, want[k]) if isinstance(want[k], np.ndarray) else got == want[k]
            assert same, k
            ran += 1
    assert ran >= 1                             # the first call to take the model always runs
    assert not m._lock.locked() and tl.vram_usage_bytes(m) == base
    assert pc.alive and h.alive and pool.entries


class _GatedLock:
    """The model's lock, with a hook run when a given thread's attempt to take it fails (to order
    that thread's next step after something another thread does, deterministically)."""

    def __init__(self, inner):
        self.inner, self.hook = inner, None

    def acquire(self, blocking=True, timeout=-1):
        ok = self.inner.acquire(blocking, timeout)
        hook = self.hook
        if not ok and hook is not None and threading.current_thread() is hook[0]:
            self.hook = None
            hook[1]()
        return ok

    def release(self):
        self.inner.release()

    def locked(self):
        return self.inner.locked()


def test_free_model_racing_the_end_of_a_request_still_releases_the_model(fresh):
    """free_model finds the model busy, and the request lets go of it before free_model has marked
    it: the free must not be lost (the model released, its handles ended and uncharged), whichever
    way the request itself ends."""
    m = fresh
    alone = tl.generate(m, P, CFG)
    base = tl.live_handle_bytes()
    pc = tl.build_prefix_cache(m, P[:4], loops=3)
    assert tl.live_handle_bytes() == base + pc.nbytes
    gate = m._lock = _GatedLock(m._lock)
    inside, go, done, out = threading.Event(), threading.Event(), threading.Event(), {}

    def cb(tok, pos):
        inside.set()
        assert go.wait(LIMIT)
        return False                    # the request ends after this token

    def run():
        try:
            out["tokens"] = tl.generate_stream(m, P, CFG, on_token=cb)
        except tl.TinyLoopError as exc:
            out["error"] = exc
        finally:
            done.set()
    t = threading.Thread(target=run)
    t.start()
    assert inside.wait(LIMIT)

    def let_the_request_finish():
        go.set()
        assert done.wait(LIMIT)
    gate.hook = (threading.current_thread(), let_the_request_finish)
    tl.free_model(m)
    _join(t)
    assert gate.hook is None, "free_model never found the model busy"
    # the request ends after its first token either way: with it (it let go first) or with
    # ModelFreedError (it saw the free first)
    assert out.get("tokens") == alone[:len(P) + 1] or isinstance(out.get("error"), tl.ModelFreedError), out
    assert m._freed, "free_model was lost: the model is still loaded"
    assert not pc.alive and tl.live_handle_bytes() == base
    with pytest.raises(tl.HandleFreedError):
        tl.generate_from_prefix_cache(m, pc, P[4:], tl.GenerateConfig(max_tokens=2))
    with pytest.raises(tl.ModelFreedError):
        tl.generate(m, P, CFG)
    tl.free_model(m)                    # idempotent


def test_free_model_during_a_cap_eviction_that_holds_the_model_is_not_lost(tiny_path, cap_restored):
    """Making room under the live handle cap takes an idle model's lock to evict its handle; a
    free_model of that model arriving meanwhile (from another thread) is carried out when the
    eviction lets go, not dropped."""
    a = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    b = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    try:
        base = tl.live_handle_bytes()
        hb = tl.build_prefix_cache(b, P, loops=3)
        tl.set_handle_bytes_cap(base + hb.nbytes + hb.nbytes // 2)
        real_evict, freer = hb._evict, {}

        def evict():                    # b's lock is held by the evicting thread right now
            t = threading.Thread(target=tl.free_model, args=(b,))
            t.start()
            _join(t)
            freer["saw_busy"] = not b._freed
            real_evict()
        hb._evict = evict
        ha = tl.build_prefix_cache(a, P, loops=3)           # evicts hb to fit
        assert freer.get("saw_busy"), "the eviction did not hold b"
        assert not hb.alive and ha.alive
        assert b._freed, "the free_model that came during the eviction was lost"
        with pytest.raises(tl.ModelFreedError):
            tl.generate(b, P, CFG)
        assert tl.live_handle_bytes() == base + ha.nbytes
        tl.free_prefix_cache(ha)
    finally:
        tl.free_model(a)
        tl.free_model(b)


def test_free_from_another_thread_ends_handles_pools_and_generators_with_typed_errors(fresh):
    m = fresh
    base = tl.live_handle_bytes()
    pc = tl.build_prefix_cache(m, P[:4], loops=3)
    h = tl.build_resume_handle(m, P, 2)
    pool = tl.create_prefix_pool(4)
    tl.register_prefix(pool, m, P[:5], loops=3)
    it = tl.generate_iter(m, P, CFG)            # validated, not started: holds nothing yet
    holder = _Holder(m)
    t = threading.Thread(target=tl.free_model, args=(m,))
    t.start()
    _join(t)                                    # returns at once: deferred while the request runs
    assert not m._freed and pc.alive
    with pytest.raises(tl.ModelFreedError):     # nothing new starts on a model being freed
        tl.generate(m, P, CFG)
    holder.release()
    assert isinstance(holder.error, tl.ModelFreedError) and m._freed
    assert tl.live_handle_bytes() == base and not tl.live_handles(m)
    with pytest.raises(tl.ModelFreedError):
        next(it)
    for call in (lambda: tl.generate_from_prefix_cache(m, pc, P[4:], CFG),
                 lambda: tl.resume_generate(h, 4, CFG),
                 lambda: tl.resume_generate_iter(h, 4, CFG)):
        with pytest.raises(tl.HandleFreedError):
            call()
    for call in (lambda: tl.generate_with_pool(m, pool, P, CFG), lambda: tl.register_prefix(pool, m, P[:3]),
                 lambda: tl.vram_usage_bytes(m), lambda: tl.build_prefix_cache(m, P[:3])):
        with pytest.raises(tl.ModelFreedError):
            call()
    # frees after the model's: the handles ended with it (no-ops), the pool once, the model idempotent
    tl.free_prefix_cache(pc)
    tl.free_resume_handle(h)
    tl.free_prefix_pool(pool)
    with pytest.raises(tl.HandleFreedError):
        tl.free_prefix_pool(pool)
    tl.free_model(m)
    assert tl.live_handle_bytes() == base


def test_a_generator_suspended_in_one_thread_freed_from_another_and_dropped(tiny_path):
    """A generator advanced on one thread holds the model; free_model from another thread is
    deferred; the generator is never resumed, only dropped on a third: the model is released then
    and its cache bytes are gone."""
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    alone = tl.generate(m, P, CFG)
    idle = tl.vram_usage_bytes(m)
    box = {}
    _in_thread(lambda: box.setdefault("it", tl.generate_iter(m, P, CFG)))
    first = _in_thread(lambda: next(box["it"]))
    assert first.get("value") == alone[len(P)]
    assert tl.vram_usage_bytes(m) > idle                        # the suspended request's cache
    assert isinstance(_in_thread(lambda: tl.generate(m, P, CFG)).get("error"), tl.ModelBusyError)
    _in_thread(lambda: tl.free_model(m))
    assert not m._freed and m._lock.locked()
    _in_thread(lambda: box.pop("it"))           # the last reference goes on a third thread
    gc.collect()
    assert m._freed and not m._lock.locked() and m._live_cache_bytes == 0


def test_the_handle_cap_holds_when_two_models_build_at_once(tiny_path, cap_restored):
    """Two models (one per thread, the spec's per-worker pattern) build handles at the same time
    under a process-wide cap: the bytes one build has been admitted for count against the other's
    admission, so the older handle is evicted instead of both fitting 'alone' and the cap being
    exceeded."""
    a = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    b = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    try:
        base = tl.live_handle_bytes()
        old = tl.build_prefix_cache(b, P[:8], loops=3)
        size = tl.build_prefix_cache(a, P[:8], loops=3)
        one = size.nbytes
        tl.free_prefix_cache(size)
        cap = base + 2 * one + one // 2
        tl.set_handle_bytes_cap(cap)
        admitted, go, out = threading.Event(), threading.Event(), {}
        real_alloc = a.backend.alloc_kept_cache

        def alloc(spec):                # a's build, admitted, allocating: b's build runs now
            admitted.set()
            assert go.wait(LIMIT)
            return real_alloc(spec)
        a.backend.alloc_kept_cache = alloc

        def build_a():
            try:
                out["a"] = tl.build_prefix_cache(a, P[:8], loops=3)
            except Exception as exc:    # noqa: BLE001
                out["a"] = exc
        t = threading.Thread(target=build_a)
        t.start()
        try:
            assert admitted.wait(LIMIT)
            try:
                out["b"] = tl.build_prefix_cache(b, P[:8], loops=3)
            except tl.HandleBudgetError as exc:
                out["b"] = exc
        finally:
            go.set()
            _join(t)
        del a.backend.alloc_kept_cache
        assert isinstance(out["a"], tl.PrefixCache) and out["a"].alive
        assert tl.live_handle_bytes() <= cap, (tl.live_handle_bytes(), cap, tl.live_handles())
        assert isinstance(out["b"], tl.PrefixCache) and out["b"].alive and not old.alive
        with pytest.raises(tl.HandleFreedError):
            tl.generate_from_prefix_cache(b, old, P[8:], tl.GenerateConfig(max_tokens=2))
        for pc in (out["a"], out["b"]):
            tl.free_prefix_cache(pc)
        assert tl.live_handle_bytes() == base
    finally:
        tl.free_model(a)
        tl.free_model(b)


def test_a_pool_cannot_be_bound_to_two_models_by_concurrent_first_registrations(tiny_path, tmp_path):
    """A pool serves only the model it was first registered with. Two models registering into the
    same fresh pool at the same time must not both bind it (a request would then copy the other
    model's K/V: wrong tokens, silently): one registration is refused with InvalidInputError and
    requests through the pool give the tokens of plain generate."""
    from conftest import write_tiny
    other = tmp_path / "other.tinyloop"
    write_tiny(other, seed=5)                   # same shapes, other weights
    a = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    b = tl.load_model(str(other), max_seq_len=64, backend="cpu")
    try:
        pool = tl.create_prefix_pool(4)
        admitted, go, out = threading.Event(), threading.Event(), {}
        real_alloc = a.backend.alloc_kept_cache

        def alloc(spec):
            admitted.set()
            assert go.wait(LIMIT)
            return real_alloc(spec)
        a.backend.alloc_kept_cache = alloc

        def register_a():
            try:
                out["a"] = tl.register_prefix(pool, a, P[:6], loops=3)
            except Exception as exc:    # noqa: BLE001
                out["a"] = exc
        t = threading.Thread(target=register_a)
        t.start()
        try:
            assert admitted.wait(LIMIT)
            try:
                out["b"] = tl.register_prefix(pool, b, P[:5], loops=3)
            except tl.InvalidInputError as exc:
                out["b"] = exc
        finally:
            go.set()
            _join(t)
        del a.backend.alloc_kept_cache
        assert isinstance(out["a"], tl.PrefixCache) and isinstance(out["b"], tl.InvalidInputError), out
        assert all(pc.model is a for pc in pool.entries)
        cfg = tl.GenerateConfig(max_tokens=8, loops=3)
        prompt = P[:5] + [9, 9]
        assert tl.generate_with_pool(a, pool, prompt, cfg) == tl.generate(a, prompt, cfg)
        tl.free_prefix_pool(pool)
    finally:
        tl.free_model(a)
        tl.free_model(b)


def test_models_handles_and_generators_dropped_without_free_give_their_bytes_back(tiny_path):
    base = tl.live_handle_bytes()
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    alone = tl.generate(m, P, CFG)
    idle = tl.vram_usage_bytes(m)
    pc = tl.build_prefix_cache(m, P[:4], loops=3)
    h = tl.build_resume_handle(m, P, 2)
    tl.resume_generate(h, 4, CFG)                    # the handle grows to depth 4
    pool = tl.create_prefix_pool(2)
    tl.register_prefix(pool, m, P[:5], loops=3)
    it = tl.generate_iter(m, P, CFG)
    next(it)
    assert tl.vram_usage_bytes(m) > idle and tl.live_handle_bytes() > base
    del pc, h, it                                    # handles and a suspended generator, no free
    assert not m._lock.locked() and m._live_cache_bytes == 0
    del pool
    gc.collect()                                     # a pool and its entries refer to each other
    assert tl.vram_usage_bytes(m) == idle and tl.live_handle_bytes() == base
    assert tl.generate(m, P, CFG) == alone
    ref = weakref.ref(m)
    tl.build_prefix_cache(m, P[:3])                  # dropped at once
    del m
    gc.collect()
    assert ref() is None, "a model dropped without free_model is kept alive"
    assert tl.live_handle_bytes() == base


# =============================================================================== the HTTP server
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tinyloop.runtime.config import GenerateStats, StopReason  # noqa: E402
from tinyloop.serve import ServeConfig, create_app  # noqa: E402
from tinyloop.serve import app as app_mod  # noqa: E402
from tinyloop.serve.worker import Job  # noqa: E402

from test_serve_edges import Live, _wait_for  # noqa: E402

X = {"model": "demo", "prompt": "x", "temperature": 0}


@pytest.fixture(scope="module")
def live():
    s = Live(ServeConfig(backend="cpu", max_seq_len=256, queue_size=2))
    yield s
    s.close()


def _metrics(s) -> dict:
    text = httpx.get(s.url + "/metrics", timeout=LIMIT).text
    return {k: float(v) for k, v in re.findall(r"^(tinyloop_\w+?_total(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _hold_with(s, reason):
    """Occupy the worker with a job that ends (with stop reason `reason`) when the returned event is set."""
    release = threading.Event()

    def held():
        assert release.wait(2 * LIMIT)          # longer than any wait on a response: ends only when released
        yield from ()
    st = GenerateStats()
    st.stop_reason = reason
    job = Job(tokens=held(), stats=st, sink=lambda ev: None)
    s.worker.submit([job])
    _wait_for(lambda: s.worker.running == 1 and s.worker.queue.qsize() == 0, "the held job did not start")
    return release, job


def _expected(model, prompt, n, **kw):
    _wait_for(lambda: not model._lock.locked(), "the model stayed busy")
    return tl.generate_text(model, prompt, tl.GenerateConfig(max_tokens=n, **kw))


def _stream(s, body, n_lines=None):
    """(status, data lines): read n_lines data lines (all when None), then close the connection."""
    got = []
    with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=LIMIT) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(line[6:])
                if n_lines is not None and len(got) >= n_lines:
                    break
        return r.status_code, got


def test_more_requests_than_the_queue_admits_and_the_metrics_add_up(live):
    """With the worker held and a queue of 2, of 6 simultaneous requests exactly 2 are queued and 4
    refused (429 with Retry-After, nothing decoded for them); released, the queued ones give
    tinyloop's own text; every counter moved by exactly what was answered and decoded."""
    before = _metrics(live)
    n0 = len(live.finished)
    release, held = _hold_with(live, StopReason.MAX_TOKENS)
    bodies = [{**X, "prompt": p, "max_tokens": n} for p, n in
              (("x", 4), ("def ", 5), ("x", 3), ("The", 4), ("a", 2), ("import ", 6))]
    with cf.ThreadPoolExecutor(len(bodies)) as ex:
        try:
            fs = [ex.submit(live.post, b) for b in bodies]
            _wait_for(lambda: sum(f.done() for f in fs) == 4 and live.worker.queue.qsize() == 2,
                      "4 refusals and 2 queued requests")
            refused = [f.result() for f in fs if f.done()]
            assert all(r.status_code == 429 and int(r.headers["Retry-After"]) >= 0 for r in refused)
        finally:
            release.set()
        rs = [f.result(LIMIT) for f in fs]
    live.wait_finished(held)
    ok = [(b, r.json()) for b, r in zip(bodies, rs) if r.status_code == 200]
    assert len(ok) == 2 and sum(r.status_code == 429 for r in rs) == 4
    for b, r in ok:
        assert r["choices"][0]["text"] == _expected(live.model, b["prompt"], b["max_tokens"])
        assert r["usage"]["completion_tokens"] == b["max_tokens"]
    _wait_for(lambda: live.worker.depth == 0 and len(live.finished) == n0 + 3, "the queue did not drain")
    d = _delta(_metrics(live), before)
    assert d.get('tinyloop_requests_total{code="429",route="/v1/completions"}') == 4
    assert d.get('tinyloop_requests_total{code="200",route="/v1/completions"}') == 2
    assert d.get('tinyloop_stop_reasons_total{reason="MAX_TOKENS"}') == 3        # the held job + 2
    assert sum(v for k, v in d.items() if k.startswith("tinyloop_stop_reasons_total")) == 3
    assert d.get("tinyloop_generated_tokens_total") == sum(r["usage"]["completion_tokens"] for _, r in ok)
    assert d.get("tinyloop_prompt_tokens_total") == sum(r["usage"]["prompt_tokens"] for _, r in ok)


def test_a_stream_dropped_mid_generation_frees_the_model_for_an_identical_next_request(live):
    m = live.model
    idle = tl.vram_usage_bytes(m)
    before = _metrics(live)
    n0 = len(live.finished)
    status, lines = _stream(live, {**X, "prompt": "def ", "max_tokens": 200}, n_lines=3)
    assert status == 200 and len(lines) == 3
    _wait_for(lambda: len(live.finished) > n0, "the dropped stream's request never ended")
    job = live.finished[n0]
    assert job.stop_reason == StopReason.CALLBACK_ABORT and 3 <= job.stats.tokens_emitted < 200
    _wait_for(lambda: not m._lock.locked(), "the model stayed busy after the stream was dropped")
    assert tl.vram_usage_bytes(m) == idle                    # its cache is gone
    r = live.post({**X, "prompt": "def ", "max_tokens": 24}).json()
    assert r["choices"][0]["text"] == _expected(m, "def ", 24)
    status, lines = _stream(live, {**X, "prompt": "def ", "max_tokens": 24})
    assert lines[-1] == "[DONE]"
    text = "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1] if json.loads(x)["choices"])
    assert text == r["choices"][0]["text"]
    _wait_for(lambda: live.worker.depth == 0 and len(live.finished) >= n0 + 3, "requests did not finish")
    d = _delta(_metrics(live), before)
    assert d.get('tinyloop_stop_reasons_total{reason="CALLBACK_ABORT"}') == 1
    assert d.get('tinyloop_stop_reasons_total{reason="MAX_TOKENS"}') == 2
    assert d.get("tinyloop_generated_tokens_total") == job.stats.tokens_emitted + 48


def test_a_request_whose_deadline_passes_in_the_queue_is_answered_at_its_deadline(live):
    """'A request runs at most deadline_s (or its timeout), queueing included': one that is still
    waiting behind another request when its timeout passes is answered then (finish_reason
    length, stop_reason DEADLINE, nothing generated), streamed or not, without waiting for the
    request ahead of it; the worker later skips it (counted once, as DEADLINE)."""
    before = _metrics(live)
    release, held = _hold_with(live, StopReason.MAX_TOKENS)
    with cf.ThreadPoolExecutor(2) as ex:
        try:
            plain = ex.submit(live.post, {**X, "max_tokens": 8, "timeout": 0.3})
            streamed = ex.submit(_stream, live, {**X, "max_tokens": 8, "timeout": 0.3})
            r = plain.result(LIMIT).json()
            status, lines = streamed.result(LIMIT)
            assert not any(j is held for j in live.finished)     # answered while the worker is still held
        finally:
            release.set()
    c = r["choices"][0]
    assert c["text"] == "" and c["finish_reason"] == "length" and c["tinyloop"]["stop_reason"] == "DEADLINE"
    assert r["usage"]["completion_tokens"] == 0
    assert status == 200 and lines[-1] == "[DONE]"
    last = json.loads(lines[-2])["choices"][0]
    assert last["finish_reason"] == "length" and last["tinyloop"]["stop_reason"] == "DEADLINE"
    live.wait_finished(held)
    _wait_for(lambda: live.worker.depth == 0, "the expired requests were never dequeued")
    _wait_for(lambda: _delta(_metrics(live), before).get('tinyloop_stop_reasons_total{reason="DEADLINE"}') == 2,
              "the expired requests were not counted as DEADLINE")
    d = _delta(_metrics(live), before)
    assert 'tinyloop_stop_reasons_total{reason="CALLBACK_ABORT"}' not in d
    assert "tinyloop_generated_tokens_total" not in d
    # the server serves on, within deadlines
    assert live.post({**X, "max_tokens": 3, "timeout": 30}).json()["usage"]["completion_tokens"] == 3


def _pause_after_first_token(monkeypatch):
    """The next request's generator pauses after its first token (holding the model) until the
    returned event is set; later requests run normally."""
    real = app_mod._token_iter
    first, go = threading.Event(), threading.Event()
    used = []

    def token_iter(served, ids, config, stats):
        tokens = real(served, ids, config, stats)
        if used:
            return tokens
        used.append(True)

        def gen():
            try:
                for i, t in enumerate(tokens):
                    yield t
                    if i == 0:
                        first.set()
                        assert go.wait(LIMIT)
            finally:
                tokens.close()
        return gen()
    monkeypatch.setattr(app_mod, "_token_iter", token_iter)
    return first, go


def test_an_auto_decoder_request_is_queued_while_the_worker_decodes(live, monkeypatch):
    """decoder=auto calibrates (runs requests on the model) on its first request at a depth. Sent
    while the worker is decoding another request, it is not refused as the client's error
    (ModelBusyError as a 400) and does not race the worker: it waits in the queue and answers the
    tokens of plain greedy decoding."""
    from tinyloop.plugins.decoders import autotune
    monkeypatch.setattr(autotune, "default_candidates", lambda loops: [])     # a quick calibration
    monkeypatch.setattr(autotune, "DEFAULT_MAX_TOKENS", 2)
    live.model.decoder_choices.clear()
    first, go = _pause_after_first_token(monkeypatch)
    with cf.ThreadPoolExecutor(2) as ex:
        try:
            running = ex.submit(live.post, {**X, "prompt": "def ", "max_tokens": 4})
            assert first.wait(LIMIT)
            assert live.model._lock.locked()
            auto = ex.submit(live.post, {**X, "prompt": "x", "max_tokens": 6, "decoder": "auto"})
            _wait_for(lambda: auto.done() or live.worker.queue.qsize() == 1, "the auto request was not queued")
            assert not auto.done(), auto.result().text
        finally:
            go.set()
        r1, r2 = running.result(LIMIT), auto.result(LIMIT)
    assert r1.status_code == 200 and r2.status_code == 200, r2.text
    assert r2.json()["choices"][0]["text"] == _expected(live.model, "x", 6)
    assert r2.json()["choices"][0]["tinyloop"]["decoder"] == "greedy"
    assert live.model.decoder_choices                       # calibrated, on the worker
    live.model.decoder_choices.clear()


class _Server:
    """create_app over a given model, in uvicorn on a free port."""

    def __init__(self, app):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        _wait_for(lambda: self.server.started, "server did not start")
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def post(self, body):
        return httpx.post(self.url + "/v1/completions", json=body, timeout=LIMIT)

    def close(self):
        self.server.should_exit = True
        self.thread.join(LIMIT)
        self.app.state.served.close()


def test_a_failure_outside_the_decode_loop_fails_the_request_not_the_worker(tiny_path):
    """A model without a usable tokenizer (the worker turns tokens into text) fails each request
    with an OpenAI error object; the worker thread survives and answers the next request instead
    of leaving every later client hanging."""
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    s = _Server(create_app(ServeConfig(backend="cpu", model_name="tiny", queue_size=2), model=m))
    try:
        for _ in range(2):
            r = s.post({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
            assert r.status_code >= 400 and "tokenizer" in r.json()["error"]["message"], r.text
            assert s.app.state.served.worker._thread.is_alive()
        assert s.app.state.served.worker.depth == 0 and not m._lock.locked()
    finally:
        s.close()
        tl.free_model(m)


def test_shutting_down_with_requests_running_and_queued(monkeypatch):
    """Served.close() while a request decodes and two wait: the waiting ones fail visibly (503 /
    an error event), the running one ends with its full text, the pool and the model are freed;
    requests arriving afterwards are 503s (the server is stopping), never a 400 blaming the
    client; close() again is a no-op."""
    s = Live(ServeConfig(backend="cpu", max_seq_len=256, queue_size=4, scaffolds=["def "]))
    served = s.app.state.served
    try:
        want = _expected(s.model, "def x", 5)
        first, go = _pause_after_first_token(monkeypatch)
        with cf.ThreadPoolExecutor(4) as ex:
            try:
                running = ex.submit(s.post, {**X, "prompt": "def x", "max_tokens": 5})
                assert first.wait(LIMIT)
                queued = ex.submit(s.post, {**X, "max_tokens": 5})
                streamed = ex.submit(_stream, s, {**X, "max_tokens": 5})
                _wait_for(lambda: s.worker.queue.qsize() == 2, "the requests were not queued")
                closer = ex.submit(served.close)
                r = queued.result(LIMIT)
                assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
                status, lines = streamed.result(LIMIT)
                assert lines[-1] == "[DONE]" and "error" in json.loads(lines[-2]), lines
                assert not closer.done()                        # the running request is let finish
            finally:
                go.set()
            r = running.result(LIMIT)
            closer.result(LIMIT)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert s.model._freed and served.pool is None
        for body in ({**X, "max_tokens": 2}, {**X, "max_tokens": 2, "stream": True}):
            late = s.post(body)
            assert late.status_code == 503 and late.headers.get("Retry-After"), late.text
        served.close()
    finally:
        s.close()
