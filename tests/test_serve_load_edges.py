"""The HTTP server under load and abuse, against a live uvicorn server on 127.0.0.1 (test_serve's,
with test_serve_edges' worker hold and finished-job hook):

- a request that leaves the queue's view (its client went away while it waited, streamed or not,
  or it was answered at its deadline) gives its queue slot back at once: the next client is
  queued, not refused with a 429 while the worker is still busy, and /health and
  tinyloop_queue_depth count only requests somebody waits for;
- a streamed request with several prompts whose first prompt fails while decoding ends at its
  error event (then ``[DONE]``): its other prompts are not decoded and no chunk or usage follows
  the error, as the non-streamed request is a 500 with no choices;
- stopping the server as ``python -m tinyloop serve`` does (SIGINT / SIGTERM: uvicorn's shutdown)
  fails the queued requests with a 503 / an error event at once and lets the running one finish,
  as Served.close() documents, instead of decoding every queued request in full first.

The worker is held by a job that waits on an event, so nothing here races with decode speed; every
wait has a generous limit that only stops a hang."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import threading

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tinyloop.runtime.config import GenerateStats, StopReason  # noqa: E402
from tinyloop.serve import ServeConfig, create_app  # noqa: E402
from tinyloop.serve import app as app_mod  # noqa: E402
from tinyloop.serve.worker import CANCELLED, Job  # noqa: E402

from test_serve_edges import Live, _failing_after, _wait_for  # noqa: E402

LIMIT = 30.0
X = {"model": "demo", "prompt": "x", "temperature": 0}


@pytest.fixture(scope="module")
def live():
    s = Live(ServeConfig(backend="cpu", max_seq_len=256, queue_size=2))
    yield s
    s.close()


def _raw_post(port, body) -> socket.socket:
    """A client that sends a completion request on a raw socket (closed later to go away)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=LIMIT)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def _health_depth(s) -> int:
    return httpx.get(s.url + "/health", timeout=LIMIT).json()["queue_depth"]


def _metric(s, name, labels=""):
    return s.metric(name, labels)


def test_clients_that_go_away_while_queued_give_their_queue_slots_back(live):
    """queue_size 2, the worker busy: two clients (one streamed, one not) queue their requests and
    go away. Their requests are cancelled and leave the queue now: a third client is queued (not
    a 429 while the queue holds only requests nobody waits for), the depth counts the held job and
    that client, the abandoned ones are counted once (CALLBACK_ABORT, a 499 for the non-streamed),
    and once released the third client gets its completion."""
    aborts = _metric(live, "tinyloop_stop_reasons_total", '{reason="CALLBACK_ABORT"}')
    gone = _metric(live, "tinyloop_requests_total", '{code="499",route="/v1/completions"}')
    release, held = live.hold()
    try:
        socks = [_raw_post(live.port, {**X, "max_tokens": 5}),
                 _raw_post(live.port, {**X, "max_tokens": 5, "stream": True})]
        _wait_for(lambda: live.worker.queue.qsize() == 2, "the two requests were not queued")
        jobs = [entry[0] for entry in list(live.worker.queue.queue)]
        for sock in socks:
            sock.close()
        for job in jobs:
            assert job.cancelled.wait(LIMIT), "the request of a client that went away was not cancelled"
        _wait_for(lambda: live.worker.queue.qsize() == 0, "the cancelled requests kept their queue slots", 5)
        for job in jobs:
            live.wait_finished(job, 5)
            assert job.stop_reason == CANCELLED and job.stats.tokens_emitted == 0
        assert _health_depth(live) == 1                       # the held job only
        with cf.ThreadPoolExecutor(1) as ex:
            third = ex.submit(live.post, {**X, "max_tokens": 3})
            _wait_for(lambda: third.done() or live.worker.queue.qsize() == 1, "the third request was not queued")
            assert not third.done(), third.result().text       # queued, not refused
            assert _health_depth(live) == 2
            assert _metric(live, "tinyloop_queue_depth") == 2
            release.set()
            r = third.result(LIMIT)
    finally:
        release.set()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    live.wait_finished(held)
    _wait_for(lambda: live.worker.depth == 0, "the queue did not drain")
    assert _metric(live, "tinyloop_stop_reasons_total", '{reason="CALLBACK_ABORT"}') == aborts + 2
    _wait_for(lambda: _metric(live, "tinyloop_requests_total", '{code="499",route="/v1/completions"}') == gone + 1,
              "the abandoned request was not counted as a 499")


def test_requests_answered_at_their_deadline_in_the_queue_give_their_slots_back(live):
    """Two requests answered at their deadline while the worker is busy (nothing generated) are
    done for their clients: their slots are free for the next ones at once (queued, not 429s), and
    they are counted once, as DEADLINE."""
    dl = _metric(live, "tinyloop_stop_reasons_total", '{reason="DEADLINE"}')
    release, held = live.hold()
    try:
        with cf.ThreadPoolExecutor(2) as ex:
            expired = [ex.submit(live.post, {**X, "max_tokens": 4, "timeout": 0.2}) for _ in range(2)]
            rs = [f.result(LIMIT) for f in expired]
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
            assert all(r.json()["choices"][0]["tinyloop"]["stop_reason"] == "DEADLINE" for r in rs)
            _wait_for(lambda: live.worker.queue.qsize() == 0, "the expired requests kept their queue slots", 5)
            _wait_for(lambda: _metric(live, "tinyloop_stop_reasons_total", '{reason="DEADLINE"}') == dl + 2,
                      "the expired requests were not counted as DEADLINE", 5)
            later = [ex.submit(live.post, {**X, "prompt": p, "max_tokens": 2}) for p in ("x", "def ")]
            _wait_for(lambda: any(f.done() for f in later) or live.worker.queue.qsize() == 2,
                      "the next requests were not queued")
            assert not any(f.done() for f in later), [f.result().text for f in later if f.done()]
            release.set()
            assert all(f.result(LIMIT).status_code == 200 for f in later)
    finally:
        release.set()
    live.wait_finished(held)
    _wait_for(lambda: live.worker.depth == 0, "the queue did not drain")
    assert _metric(live, "tinyloop_stop_reasons_total", '{reason="DEADLINE"}') == dl + 2


def test_a_streamed_request_whose_first_prompt_fails_ends_at_its_error_event(live, monkeypatch):
    """Two prompts, streamed with usage; the first fails while decoding (after 2 tokens): the
    stream is its chunks, the error event, then [DONE]; the second prompt is not decoded (no chunk
    of choice 1, no finish chunk, no usage chunk after the error) and ends CANCELLED untouched. The
    non-streamed request fails the same way (a 500), and the server serves on."""
    monkeypatch.setattr(app_mod, "_token_iter", _failing_after(2, RuntimeError("boom: a bug while decoding")))
    n0 = len(live.finished)
    body = {**X, "prompt": ["x", "def "], "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=LIMIT) as r:
        raw = r.read().decode()
    events = [e[6:] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]" and "boom" in json.loads(events[-2])["error"]["message"], raw
    chunks = [json.loads(e) for e in events[:-2]]
    assert len(chunks) == 2 and all(c["choices"][0]["index"] == 0 for c in chunks), raw
    _wait_for(lambda: len(live.finished) >= n0 + 2 and live.worker.depth == 0, "the request did not end")
    first, second = live.finished[n0:n0 + 2]
    assert first.failed and first.stop_reason is None
    assert second.stop_reason == CANCELLED and second.stats.tokens_emitted == 0

    n0 = len(live.finished)
    r = live.post({**X, "prompt": ["x", "def "], "max_tokens": 6})
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"], r.text
    _wait_for(lambda: len(live.finished) >= n0 + 2 and live.worker.depth == 0, "the request did not end")
    assert live.finished[n0 + 1].stop_reason == CANCELLED and live.finished[n0 + 1].stats.tokens_emitted == 0
    monkeypatch.undo()
    r = live.post({**X, "prompt": ["x", "def "], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_stopping_the_uvicorn_server_fails_queued_requests_at_once():
    """SIGINT / SIGTERM (uvicorn's shutdown, as ``should_exit``) with one request running and two
    queued: the queued ones are answered at once (a 503, an error event then [DONE]) while the
    running one still runs, instead of uvicorn waiting for every queued request to be decoded
    in full; the running one is let finish, then the server stops and the model is freed."""
    app = create_app(ServeConfig(backend="cpu", max_seq_len=256, queue_size=4))
    served = app.state.served
    server = app_mod.uvicorn_server(app, host="127.0.0.1", port=0, log_level="critical")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    release = threading.Event()
    try:
        _wait_for(lambda: server.started, "the server did not start")
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        ran = []

        def held():
            assert release.wait(2 * LIMIT)
            ran.append(True)
            yield from ()
        st = GenerateStats()
        st.stop_reason = StopReason.MAX_TOKENS
        served.worker.submit([Job(tokens=held(), stats=st, sink=lambda ev: None)])
        _wait_for(lambda: served.worker.running == 1 and served.worker.queue.qsize() == 0, "the held job did not start")

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json={**X, "max_tokens": 50, "stream": True},
                              timeout=LIMIT) as r:
                return r.status_code, r.read().decode()
        with cf.ThreadPoolExecutor(2) as ex:
            plain = ex.submit(httpx.post, url + "/v1/completions", json={**X, "max_tokens": 50}, timeout=LIMIT)
            _wait_for(lambda: served.worker.queue.qsize() == 1, "the request was not queued")
            streamed = ex.submit(stream)
            _wait_for(lambda: served.worker.queue.qsize() == 2, "the streamed request was not queued")
            server.should_exit = True
            try:
                r = plain.result(8)
                status, raw = streamed.result(8)
            except cf.TimeoutError:
                pytest.fail("the shutdown waited for the queued requests instead of failing them")
            assert not ran and thread.is_alive()               # the running request still runs
        assert r.status_code == 503 and "shut" in r.json()["error"]["message"], r.text
        events = [e for e in raw.split("\n\n") if e]
        assert status == 200 and events[-1] == "data: [DONE]" and "error" in json.loads(events[-2][6:]), raw
        release.set()
        thread.join(LIMIT)
        assert not thread.is_alive() and ran
        _wait_for(lambda: served.model._freed, "the model was not freed")
    finally:
        release.set()
        server.should_exit = True
        thread.join(LIMIT)
        served.close()


def test_the_cli_serves_through_the_shutdown_aware_server(monkeypatch):
    """``python -m tinyloop serve`` runs uvicorn_server (so SIGINT / SIGTERM fail the queued
    requests first), and frees what it loaded when uvicorn returns."""
    from tinyloop.cli import serve as cli_serve
    seen = {}

    class Fake:
        def __init__(self, app, **kw):
            seen["app"], seen["kw"] = app, kw

        def run(self):
            seen["ran"] = True
    monkeypatch.setattr(app_mod, "uvicorn_server", Fake)
    args = cli_serve.add_parser(__import__("argparse").ArgumentParser().add_subparsers()).parse_args(
        ["--backend", "cpu", "--port", "0"])
    assert cli_serve.run(args) == 0
    assert seen["ran"] and seen["kw"]["port"] == 0
    assert seen["app"].state.served.model._freed
