"""Edges of the HTTP server under real use, against a live uvicorn server on 127.0.0.1: a
non-streamed client that goes away is cancelled (its queue slot and the model are freed for the
next request, not held until max_tokens or the deadline); a request that fails after it was
validated and queued is a 5xx (not a 400 blaming the client), answered as an OpenAI error object
and counted in tinyloop_requests_total like every other response; stopping the worker fails the
requests still queued visibly (503 / an error event), never as empty "successful" completions.

The worker is held by a job that waits on an event, so nothing here races with decode speed."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tinyloop.errors import BackendError  # noqa: E402
from tinyloop.runtime.config import GenerateStats  # noqa: E402
from tinyloop.serve import ServeConfig  # noqa: E402
from tinyloop.serve.worker import CANCELLED, Job  # noqa: E402

from test_serve import Live as ServedLive  # noqa: E402


class Live(ServedLive):
    """test_serve's live server; `finished` collects the worker's finished jobs (its on_finish
    hook, wrapped) so tests wait on them instead of sleeping."""

    def __init__(self, cfg: ServeConfig):
        super().__init__(cfg)
        self.worker = self.app.state.served.worker
        self.finished, self._cond = [], threading.Condition()
        inner = self.worker.on_finish

        def on_finish(job):
            inner(job)
            with self._cond:
                self.finished.append(job)
                self._cond.notify_all()
        self.worker.on_finish = on_finish
        self.port = int(self.url.rsplit(":", 1)[1])

    def wait_finished(self, job, limit=30.0):
        with self._cond:
            assert self._cond.wait_for(lambda: any(j is job for j in self.finished), limit), "job never finished"

    def hold(self):
        """Occupy the worker with a job that ends when the returned event is set."""
        release = threading.Event()

        def held():
            release.wait(60)
            yield from ()
        job = Job(tokens=held(), stats=GenerateStats(), sink=lambda ev: None)
        self.worker.submit([job])
        _wait_for(lambda: self.worker.running == 1 and self.worker.queue.qsize() == 0, "the held job did not start")
        return release, job


def _wait_for(cond, what, limit=30.0):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < limit, what
        time.sleep(0.01)


@pytest.fixture(scope="module")
def live():
    s = Live(ServeConfig(backend="cpu", max_seq_len=320, queue_size=2))
    yield s
    s.close()


LONG = {"model": "demo", "prompt": "x", "max_tokens": 300, "temperature": 0}


def test_a_non_streamed_client_that_disconnects_is_cancelled(live):
    """The client of a non-streamed request closes its connection while the request waits: the
    request is cancelled (it never runs, CALLBACK_ABORT), the next request is served at once, and
    the response nobody reads is counted as a 499, not a 200."""
    gone0 = live.metric("tinyloop_requests_total", '{code="499",route="/v1/completions"}')
    release, held = live.hold()
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
    try:
        body = json.dumps(LONG).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        _wait_for(lambda: live.worker.queue.qsize() == 1, "the request was not queued")
        job = live.worker.queue.queue[0][0]
    finally:
        sock.close()
    try:
        assert job.cancelled.wait(10), "the request of a client that went away was not cancelled"
    finally:
        release.set()
    live.wait_finished(job)
    assert job.stop_reason == CANCELLED and job.stats.tokens_emitted == 0
    r = live.post({"model": "demo", "prompt": "x", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    _wait_for(lambda: live.metric("tinyloop_requests_total", '{code="499",route="/v1/completions"}') == gone0 + 1,
              "the abandoned request was not counted as a 499")
    assert live.worker.depth == 0


def _failing_after(n, exc):
    """A _token_iter whose generator yields n real tokens, then raises exc (a backend failure or a
    bug while decoding: after validation, after queueing)."""
    from tinyloop.serve import app as app_mod
    real = app_mod._token_iter

    def token_iter(served, ids, config, stats):
        tokens = real(served, ids, config, stats)

        def gen():
            try:
                for i, t in enumerate(tokens):
                    if i == n:
                        raise exc
                    yield t
            finally:
                tokens.close()
        return gen()
    return token_iter


@pytest.mark.parametrize("exc", [RuntimeError("boom: a bug while decoding"),
                                 BackendError("boom: the device failed")], ids=["bug", "backend"])
def test_a_failure_while_decoding_is_a_counted_5xx(live, monkeypatch, exc):
    """A request that fails after it was validated and queued is the server's failure: a 500 with
    an OpenAI error object (not a 400 blaming the client's input, not a plain-text page), counted
    in tinyloop_requests_total{code="500"} and as stop reason ERROR; the server serves on."""
    from tinyloop.serve import app as app_mod
    c500 = live.metric("tinyloop_requests_total", '{code="500",route="/v1/completions"}')
    errs = live.metric("tinyloop_stop_reasons_total", '{reason="ERROR"}')
    monkeypatch.setattr(app_mod, "_token_iter", _failing_after(2, exc))
    r = live.post({**LONG, "max_tokens": 8})
    assert r.status_code == 500, r.text
    assert "boom" in r.json()["error"]["message"]
    live.wait_finished(live.finished[-1])
    assert live.metric("tinyloop_requests_total", '{code="500",route="/v1/completions"}') == c500 + 1
    assert live.metric("tinyloop_stop_reasons_total", '{reason="ERROR"}') == errs + 1
    # streamed: an error event in the SSE format, then [DONE]
    with httpx.stream("POST", live.url + "/v1/completions", json={**LONG, "max_tokens": 8, "stream": True},
                      timeout=60) as s:
        raw = s.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]", raw
    assert "boom" in json.loads(events[-2][6:])["error"]["message"]
    monkeypatch.undo()
    assert live.post({**LONG, "max_tokens": 2}).status_code == 200


def test_an_unhandled_error_is_counted_as_a_500(live, monkeypatch):
    """tinyloop_requests_total counts every response 'errors alike': a handler that raises (answered
    500 by Starlette's outermost middleware) is counted too."""
    from tinyloop.serve import app as app_mod

    def broken(served, prompt):
        raise RuntimeError("boom")
    c500 = live.metric("tinyloop_requests_total", '{code="500",route="/v1/completions"}')
    monkeypatch.setattr(app_mod, "_prompts", broken)
    assert live.post({**LONG, "max_tokens": 2}).status_code == 500
    assert live.metric("tinyloop_requests_total", '{code="500",route="/v1/completions"}') == c500 + 1


def test_stopping_the_worker_fails_queued_requests_visibly():
    """Served.close() / worker.stop() with requests still queued: they never ran, so a non-streamed
    one is a 503 (not a 200 with an empty text and finish_reason stop) and a streamed one carries
    an error event (not a finish chunk); a request arriving after the stop is a 503 too (the
    server is stopping; its queue is not full)."""
    s = Live(ServeConfig(backend="cpu", max_seq_len=320, queue_size=2))
    try:
        release, _ = s.hold()
        with cf.ThreadPoolExecutor(3) as ex:
            plain = ex.submit(s.post, LONG)
            _wait_for(lambda: s.worker.queue.qsize() == 1, "the request was not queued")

            def stream():
                with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True},
                                  timeout=60) as r:
                    return r.status_code, r.read().decode()
            streamed = ex.submit(stream)
            _wait_for(lambda: s.worker.queue.qsize() == 2, "the streamed request was not queued")
            stopper = ex.submit(s.worker.stop, 30)
            try:
                r = plain.result(30)
                assert r.status_code == 503, r.text
                assert "shut" in r.json()["error"]["message"] and r.headers.get("Retry-After")
                status, raw = streamed.result(30)
                assert status == 200
                events = [e for e in raw.split("\n\n") if e]
                assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2][6:]), raw
                assert not any('"finish_reason": "stop"' in e for e in events), raw
                later = s.post({**LONG, "max_tokens": 2})
                assert later.status_code == 503 and "shutting down" in later.json()["error"]["message"]
            finally:
                release.set()
            stopper.result(30)
    finally:
        s.close()
