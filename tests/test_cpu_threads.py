"""The CPU kernels' threads (tinyloop/cpu/threads.py): TINYLOOP_CPU_THREADS is read and checked in
one place, the results do not depend on the thread count, and under numba's 'workqueue' layer (not
thread-safe) two models decoding from two threads take turns instead of aborting the process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest

import tinyloop as tl
from tinyloop.cpu import threads

ROOT = Path(__file__).resolve().parents[1]
IDS = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77]


def test_the_knob(monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    assert threads.requested_threads() == max(1, threads.available_cpus() // 2)
    for raw, n in (("3", 3), (" 1 ", 1), ("0", 0)):
        monkeypatch.setenv(threads.ENV, raw)
        assert threads.requested_threads() == n
    monkeypatch.setenv(threads.ENV, "0")
    assert threads.configure() == numba.config.NUMBA_NUM_THREADS          # 0: the whole pool
    monkeypatch.setenv(threads.ENV, str(numba.config.NUMBA_NUM_THREADS + 5))
    assert threads.configure() == numba.config.NUMBA_NUM_THREADS          # capped at the pool
    for bad in ("two", "-1", "1.5"):
        monkeypatch.setenv(threads.ENV, bad)
        with pytest.raises(tl.ConfigError, match="TINYLOOP_CPU_THREADS"):
            threads.requested_threads()


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU")
def test_same_logits_and_tokens_whatever_the_thread_count(tiny_path, monkeypatch):
    got = []
    for n in ("1", "2"):
        monkeypatch.setenv(threads.ENV, n)
        m = tl.load_model(str(tiny_path), max_seq_len=96, backend="cpu")
        try:
            assert m.backend.threads == int(n)
            got.append((tl.score(m, IDS, loops=3, cache_mode="fp32"),
                        tl.generate(m, IDS, tl.GenerateConfig(max_tokens=12))))
            assert numba.get_num_threads() == int(n)       # set in this thread by the launches
        finally:
            tl.free_model(m)
    (l1, t1), (l2, t2) = got
    assert l1.tobytes() == l2.tobytes() and t1 == t2


CHILD = r"""
import sys, threading
import numba
import tinyloop as tl
ms = [tl.load_model(sys.argv[1], backend="cpu", max_seq_len=96) for _ in range(2)]
ids = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77]
out = [None, None]
def work(i):
    for _ in range(3):
        out[i] = tl.generate(ms[i], ids, tl.GenerateConfig(max_tokens=16))
ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
[t.start() for t in ts]
[t.join() for t in ts]
assert numba.threading_layer() == "workqueue", numba.threading_layer()
assert out[0] == out[1] and len(out[0]) == len(ids) + 16, out
print("ok")
"""


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU")
def test_workqueue_layer_is_serialized(tiny_path):
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue", TINYLOOP_CPU_THREADS="2")
    r = subprocess.run([sys.executable, "-c", CHILD, str(tiny_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
