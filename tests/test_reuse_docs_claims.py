"""Documented claims of cache reuse (README "Cache reuse", docs/ARCHITECTURE.md "Cache reuse") that
tests/reuse_suite.py does not pin: GenerateStats.warm_start_iters_saved counts what a fresh request
at that depth would have run and this one did not (computed here by counting the loop rows the
forward actually runs)."""

from __future__ import annotations

import warnings

import pytest

import tinyloop as tl
from tinyloop.runtime.compat import CompatWarning

from conftest import write_tiny


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs_claims") / "t.tinyloop"
    write_tiny(path, seed=5)
    model = tl.load_model(str(path), max_seq_len=96, backend="cpu", prefill_chunk=8)
    yield model
    tl.free_model(model)


@pytest.fixture(autouse=True)
def _quiet():
    tl.set_handle_bytes_cap(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompatWarning)
        yield


def _loop_rows(m, monkeypatch, call):
    """Loop iterations x rows the forward runs during `call` (prefill only: max_tokens=1)."""
    fwd, n = m.fwd, [0]
    orig = fwd.run_loop_iters_range

    def counting(pos, T, cache, a, b):
        n[0] += T * max(0, b - a)
        return orig(pos, T, cache, a, b)
    monkeypatch.setattr(fwd, "run_loop_iters_range", counting)
    try:
        out = call()
    finally:
        monkeypatch.setattr(fwd, "run_loop_iters_range", orig)
    return n[0], out


@pytest.mark.parametrize("L", [1, 3])
def test_warm_start_iters_saved_is_what_the_request_did_not_run(m, monkeypatch, L):
    """A handle already holding depth L: the request copies P - 1 positions and computes the last
    one at L (the last prompt position is always computed), so it spares L * (P - 1) row-iterations
    of a fresh L prefill, not L * P."""
    p = [int(t) for t in range(3, 3 + 19)]
    cfg = tl.GenerateConfig(max_tokens=1)
    h = tl.build_resume_handle(m, p, L)
    try:
        tl.resume_generate(h, L, cfg)                       # post blocks at L: nothing left to upgrade
        fresh, want = _loop_rows(m, monkeypatch, lambda: tl.generate(m, p, tl.GenerateConfig(max_tokens=1, loops=L)))
        st = tl.GenerateStats()
        warm, got = _loop_rows(m, monkeypatch, lambda: tl.resume_generate(h, L, cfg, stats=st))
        assert got == want
        assert fresh == L * len(p) and warm == L                 # the counter sees the whole prefill
        assert st.warm_start_iters_saved == fresh - warm == L * (len(p) - 1)
    finally:
        tl.free_resume_handle(h)


def test_warm_start_iters_saved_on_an_upgrade_counts_the_copied_rows(m, monkeypatch):
    """From depth 2 to 5: each copied row (reused_tokens of them) skips iterations 0 .. 1; the last
    prompt row is computed in full by the request, so none of its iterations were spared."""
    p = [int(t) for t in range(5, 5 + 13)]
    h = tl.build_resume_handle(m, p, 2)
    try:
        st = tl.GenerateStats()
        warm, got = _loop_rows(m, monkeypatch, lambda: tl.resume_generate(h, 5, tl.GenerateConfig(max_tokens=1),
                                                                         stats=st))
        assert got == tl.generate(m, p, tl.GenerateConfig(max_tokens=1, loops=5))
        # the upgrade runs iterations 2 .. 4 over every row, the request the last row at 5
        assert warm == 3 * len(p) + 5
        assert st.reused_tokens == len(p) - 1
        assert st.warm_start_iters_saved == 2 * st.reused_tokens
    finally:
        tl.free_resume_handle(h)
