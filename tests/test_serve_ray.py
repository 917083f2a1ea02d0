"""Replicas on Ray Serve (tinyloop.serve.ray), on the CPU with a local Ray instance: two replicas
each load their own model; requests spread over both (their /health pids differ) and give
tinyloop's own text; one replica killed in the middle of a burst of streams: every request either
completes (200 and [DONE]) or fails visibly (an error status or a broken stream), never a silent
truncation, and the other replica keeps serving."""

from __future__ import annotations

import concurrent.futures as cf
import socket
import time

import pytest

pytest.importorskip("fastapi")
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

import tinyloop as tl  # noqa: E402
from tinyloop.serve import ServeConfig  # noqa: E402
from tinyloop.serve.ray import application, deploy  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    port = free_port()
    deploy(ServeConfig(backend="cpu", max_seq_len=256, queue_size=32), num_replicas=2, num_cpus=0.5,
           http_port=port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_bad_arguments_are_config_errors():
    with pytest.raises(tl.ConfigError, match="num_replicas"):
        application(ServeConfig(), num_replicas=0)
    with pytest.raises(tl.ConfigError, match="num_gpus"):
        application(ServeConfig(), num_gpus=-1)
    with pytest.raises(tl.ConfigError, match="ServeConfig"):
        application({"port": 1})
    with pytest.raises(tl.ConfigError, match="num_replicas"):
        application(ServeConfig(), num_replicas="2")
    with pytest.raises(tl.ConfigError, match="num_cpus"):
        application(ServeConfig(), num_cpus="one")
    with pytest.raises(tl.ConfigError, match="name"):
        application(ServeConfig(), name="")
    with pytest.raises(tl.ConfigError, match="http_port"):
        deploy(ServeConfig(), http_port=70000)


def test_requests_spread_over_both_replicas(cluster):
    with cf.ThreadPoolExecutor(6) as ex:
        pids = set(ex.map(lambda _: httpx.get(cluster + "/health", timeout=60).json()["pid"], range(40)))
    assert len(pids) == 2
    m = tl.load_model(None, backend="cpu", max_seq_len=256)
    try:
        want = tl.generate_text(m, "def ", tl.GenerateConfig(max_tokens=10))
    finally:
        tl.free_model(m)
    body = {"model": "demo", "prompt": "def ", "max_tokens": 10, "temperature": 0}
    for _ in range(4):
        r = httpx.post(cluster + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def _stream(url):
    """'done' (200 and [DONE]), 'error' (an error status or a broken stream) or 'truncated'."""
    body = {"model": "demo", "prompt": "x", "max_tokens": 60, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return "error"
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError:
        return "error"
    if lines and lines[-1] == "data: [DONE]":
        return "done"
    return "error" if any('"error"' in line for line in lines) else "truncated"


def test_a_killed_replica_loses_no_request_silently(cluster):
    replicas = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::")]
    assert len(replicas) == 2
    with cf.ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(_stream, cluster) for _ in range(16)]
        time.sleep(1.0)
        ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=False)
        outcomes = [f.result() for f in futs]
    assert "truncated" not in outcomes, outcomes
    assert outcomes.count("done") >= 1
    t0 = time.time()                    # the survivor (and then the restarted replica) keeps serving
    while True:
        r = httpx.post(cluster + "/v1/completions", json={"model": "demo", "prompt": "a", "max_tokens": 4},
                       timeout=60)
        if r.status_code == 200:
            break
        assert time.time() - t0 < 90, r.text
        time.sleep(0.5)
