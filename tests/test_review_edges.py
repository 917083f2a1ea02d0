"""Review of the audits d980b39..b081583 (beam / scoring, streaming / CLI, leftover edges,
concurrency / lifecycle, JSON whitespace): each test demonstrates a defect the changes introduced
or left, and passes with its fix.

* on_token's signature check read the signature *through* functools.wraps (``__wrapped__``), so a
  decorated callback that is called as on_token(token, position) perfectly well was refused.
* RunConfig's path fields refused os.PathLike values (pathlib.Path), accepted before, with an error
  saying a Path is not "a path".
* The worker recorded DEADLINE for a queued request whose client had gone away before its deadline
  (answered as a 499, documented as CALLBACK_ABORT), because the client-gone flag lost to the clock.
* A request racing Served.close() (validated against the scaffolds' pool as close() freed it) was a
  400 blaming the client (HandleFreedError) instead of the documented 503.
* Served.close() with a request that outlasts the worker's stop timeout raised ModelBusyError (the
  pool's release needs the model) and left the pool and the model loaded, instead of letting the
  running request finish and freeing them as it ends."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import socket
import threading
import time

import pytest

import tinyloop as tl

LIMIT = 30.0
P = [3, 17, 42, 8, 91]


@pytest.fixture(scope="module")
def model(tiny_path):
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


# =============================================================================== the Python API
def test_on_token_wrapped_by_a_decorator_is_called_as_given(model):
    """A callback made by a decorator (functools.wraps copies the wrapped function's name and
    __wrapped__) takes (token, position); the function it wraps takes more. It is called as the
    decorator made it, so it must be accepted (it was before the signature check)."""
    seen = []

    def numbered(f):
        n = [0]

        @functools.wraps(f)
        def wrapper(token, position):
            n[0] += 1
            return f(n[0], token, position)
        return wrapper

    @numbered
    def cb(i, token, position):
        seen.append((i, token, position))
        return True

    cfg = tl.GenerateConfig(max_tokens=3)
    out = tl.generate_stream(model, P, cfg, on_token=cb)
    assert out == tl.generate(model, P, cfg)
    assert seen == [(i + 1, t, len(P) + i) for i, t in enumerate(out[len(P):])]
    # a callable that really cannot take (token, position) is still refused before any work
    with pytest.raises(tl.InvalidInputError, match="on_token"):
        tl.generate_stream(model, P, cfg, on_token=lambda token: True)


def test_run_config_path_fields_take_path_objects(tmp_path):
    """RunConfig's tokenizer / prompts_file / output_jsonl took pathlib.Path before the 'path
    fields typed' change (which meant to refuse YAML numbers and lists); a Path is a path."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    cfg = tl.RunConfig(prompts_file=prompts, output_jsonl=tmp_path / "o.jsonl", tokenizer=tmp_path)
    assert os.fspath(cfg.prompts_file) == str(prompts) and os.fspath(cfg.output_jsonl) == str(tmp_path / "o.jsonl")
    assert os.fspath(cfg.tokenizer) == str(tmp_path)
    for bad in (5, ["a"], True):
        with pytest.raises(tl.ConfigError, match="prompts_file"):
            tl.RunConfig(prompts_file=bad)
    with pytest.raises(tl.ConfigError, match="NUL"):
        tl.RunConfig(prompts_file=pathlib.Path("a\0b"))


# =============================================================================== the HTTP server
def _serve():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    return pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def live():
    _serve()
    from tinyloop.serve import ServeConfig
    from test_serve_edges import Live
    s = Live(ServeConfig(backend="cpu", max_seq_len=128, queue_size=2))
    yield s
    s.close()


def _wait_for(cond, what):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < LIMIT, what
        time.sleep(0.01)


def test_a_client_gone_before_its_deadline_is_cancelled_not_deadline(live):
    """A non-streamed request waits behind another; its client goes away (a 499) well before its
    timeout; the worker reaches it only after that timeout. The request ended when its client left
    (CALLBACK_ABORT, as documented for a client that goes away), not at a deadline nobody was
    answered at."""
    from tinyloop.serve.worker import CANCELLED
    release, held = live.hold()
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=LIMIT)
    try:
        body = json.dumps({"model": "demo", "prompt": "x", "max_tokens": 4, "temperature": 0,
                           "timeout": 0.6}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        _wait_for(lambda: live.worker.queue.qsize() == 1, "the request was not queued")
        job = live.worker.queue.queue[0][0]
    finally:
        sock.close()
    try:
        assert job.cancelled.wait(LIMIT), "the request of a client that went away was not cancelled"
        assert time.perf_counter() < job.deadline, "the client must leave before the deadline"
        _wait_for(lambda: time.perf_counter() > job.deadline + 0.05, "deadline")
    finally:
        release.set()
    live.wait_finished(job)
    assert job.stop_reason == CANCELLED and job.stats.tokens_emitted == 0


def test_a_request_racing_close_is_a_503_not_a_400(monkeypatch):
    """A request validated while Served.close() runs: the handler picked the scaffolds' pool, and
    close() freed the pool (and the model it loaded) before the request was checked against it. The
    request is the server's refusal (503 with Retry-After, as documented for requests arriving
    during shutdown), not a 400 saying the client used a freed PrefixPool."""
    httpx = _serve()
    from tinyloop.runtime import reuse
    from tinyloop.serve import ServeConfig
    from test_serve_edges import Live
    s = Live(ServeConfig(backend="cpu", max_seq_len=128, queue_size=2, scaffolds=["def "]))
    served = s.app.state.served
    real, closer = reuse.generate_with_pool_iter, []

    def generate_with_pool_iter(model, pool, *a, **kw):
        if not closer:                  # close() runs now, between the handler's pick and the check
            closer.append(threading.Thread(target=served.close))
            closer[0].start()
            _wait_for(lambda: pool._freed, "close() did not free the pool")
        return real(model, pool, *a, **kw)
    monkeypatch.setattr(reuse, "generate_with_pool_iter", generate_with_pool_iter)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": "demo", "prompt": "def x", "max_tokens": 2,
                                                        "temperature": 0}, timeout=LIMIT)
        assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
    finally:
        for t in closer:
            t.join(LIMIT)
        monkeypatch.undo()
        s.close()
    assert closer and served.pool is None and s.model._freed


def test_close_with_a_request_running_past_the_stop_timeout(monkeypatch):
    """Served.close() 'lets the running one finish': a request still running when the worker's
    stop timeout (10 s by default; 0.3 s here) ends holds the model, and freeing the pool then was
    refused (ModelBusyError out of close(): pool and model never freed). close() returns; the
    running request finishes with its full text; the pool and the model are freed as it ends."""
    httpx = _serve()
    from tinyloop.serve import ServeConfig
    from tinyloop.serve.worker import ModelWorker
    from test_serve_edges import Live
    s = Live(ServeConfig(backend="cpu", max_seq_len=128, queue_size=2, scaffolds=["def "]))
    served = s.app.state.served
    pool = served.pool
    want = tl.generate_text(s.model, "def x", tl.GenerateConfig(max_tokens=4))
    monkeypatch.setattr(served.worker, "stop", functools.partial(ModelWorker.stop, served.worker, timeout=0.3))
    from test_concurrency_edges import _pause_after_first_token
    first, go = _pause_after_first_token(monkeypatch)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
        s.url + "/v1/completions", json={"model": "demo", "prompt": "def x", "max_tokens": 4, "temperature": 0},
        timeout=LIMIT)))
    t.start()
    try:
        assert first.wait(LIMIT)
        served.close()                              # returns after the stop timeout, without raising
        assert served.pool is None and not s.model._freed and s.model._lock.locked()
    finally:
        go.set()
        t.join(LIMIT)
    r = out["r"]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    _wait_for(lambda: s.model._freed and pool._freed, "the pool and the model were not freed as the request ended")
    monkeypatch.undo()
    s.close()
