"""free_model while a request runs (from its own callback, from another thread, with a generator
left open) never crashes: the request ends with ModelFreedError, frees its cache, and the model is
released as the request lets go; two models decode from two threads at once."""

from __future__ import annotations

import threading

import pytest

import tinyloop as tl

CFG = tl.GenerateConfig(max_tokens=12)


@pytest.fixture
def fresh(tiny_path):
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


def test_free_from_inside_on_token(fresh, prompt):
    seen = []

    def cb(tok, pos):
        seen.append(tok)
        if len(seen) == 3:
            tl.free_model(fresh)
        return True
    st = tl.GenerateStats()
    with pytest.raises(tl.ModelFreedError, match="free_model"):
        tl.generate_stream(fresh, prompt, CFG, on_token=cb, stats=st)
    assert len(seen) == 3 and fresh._freed and st.stop_reason == tl.StopReason.CALLBACK_ABORT
    with pytest.raises(tl.ModelFreedError):
        tl.generate(fresh, prompt, CFG)
    tl.free_model(fresh)                         # idempotent


def test_free_with_an_open_generator(fresh, prompt):
    it = tl.generate_iter(fresh, prompt, CFG)
    next(it)
    tl.free_model(fresh)                         # deferred: the generator holds the model
    assert not fresh._freed
    with pytest.raises(tl.ModelFreedError):
        next(it)
    assert fresh._freed


def test_free_from_another_thread(fresh, prompt):
    started, release = threading.Event(), threading.Event()
    result = {}

    def cb(tok, pos):
        started.set()
        release.wait(10)
        return True

    def run():
        try:
            result["out"] = tl.generate_stream(fresh, prompt, CFG, on_token=cb)
        except tl.TinyLoopError as e:
            result["err"] = e
    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30)
    tl.free_model(fresh)                         # the request is running: deferred
    release.set()
    t.join(60)
    assert not t.is_alive() and isinstance(result.get("err"), tl.ModelFreedError) and fresh._freed


def test_two_models_in_two_threads(tiny_path, prompt):
    models = [tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu") for _ in range(2)]
    try:
        want = tl.generate(models[0], prompt, CFG)
        outs, errs = [None, None], []

        def run(i):
            try:
                for _ in range(3):
                    outs[i] = tl.generate(models[i], prompt, CFG)
            except Exception as e:       # noqa: BLE001 - the assertion reports it
                errs.append(e)
        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not errs and outs == [want, want]
    finally:
        for m in models:
            tl.free_model(m)


def test_host_memory_exhaustion_is_typed(tiny_path, prompt, monkeypatch):
    """A CPU allocation the machine cannot hold is an OutOfMemoryError before it is made (numpy
    would map the pages lazily and the process be killed on first write), at load and per request;
    nothing is left held."""
    from tinyloop.cpu import backend as cpu_backend
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    try:
        held = tl.vram_usage_bytes(m)
        monkeypatch.setattr(cpu_backend, "available_host_bytes", lambda: 1024)
        with pytest.raises(tl.OutOfMemoryError, match="KV cache"):
            tl.generate(m, prompt, CFG)
        assert tl.vram_usage_bytes(m) == held
        with pytest.raises(tl.OutOfMemoryError, match="float32 weights"):
            tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    finally:
        tl.free_model(m)
