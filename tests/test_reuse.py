"""Cache reuse on the CPU backend (the suite: tests/reuse_suite.py), plus the CPU-only checks:
a backend without the cache_reuse capability is refused, and the uncached reference switch."""

from __future__ import annotations

import pytest

import tinyloop as tl

pytest.register_assert_rewrite("reuse_suite")

from reuse_suite import *  # noqa: E402,F401,F403  (the suite's tests and fixtures)
from reuse_suite import _prompt, cfg  # noqa: E402


@pytest.fixture(scope="module")
def load():
    def _load(path, **kw):
        return tl.load_model(str(path), backend="cpu", **kw)
    return _load


def test_uncached_reference_switch_is_refused(rm, monkeypatch):
    p = _prompt(10, 20)
    pc = tl.build_prefix_cache(rm, p[:5])
    try:
        monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
        with pytest.raises(tl.IncompatibleModesError, match="TINYLOOP_DISABLE_KV_CACHE"):
            tl.generate_from_prefix_cache(rm, pc, p[5:], cfg())
    finally:
        tl.free_prefix_cache(pc)


def test_a_backend_without_cache_reuse_is_refused(rm, monkeypatch):
    monkeypatch.setattr(type(rm.backend), "capabilities",
                        property(lambda self: frozenset({"tree"})))
    with pytest.raises(tl.BackendError, match="cache_reuse"):
        tl.build_prefix_cache(rm, [1, 2, 3])
    with pytest.raises(tl.BackendError, match="cache_reuse"):
        tl.build_resume_handle(rm, [1, 2, 3], 2)


def test_env_cap(rm, monkeypatch):
    from tinyloop.runtime import reuse
    monkeypatch.setattr(reuse._BUDGET, "cap_from_env", True)
    monkeypatch.setenv("TINYLOOP_MAX_HANDLE_BYTES", "100")
    with pytest.raises(tl.HandleBudgetError, match="cap of 100 bytes"):
        tl.build_prefix_cache(rm, [1, 2, 3])
    monkeypatch.setenv("TINYLOOP_MAX_HANDLE_BYTES", "lots")
    with pytest.raises(tl.ConfigError, match="TINYLOOP_MAX_HANDLE_BYTES='lots'"):
        tl.build_prefix_cache(rm, [1, 2, 3])
