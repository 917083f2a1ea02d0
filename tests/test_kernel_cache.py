"""The on-disk kernel cache's folder and switch (tinyloop/cuda/kernels/_cache.py); no GPU needed:
a kernel's cache is set up when it is declared, and used when it is compiled."""

from __future__ import annotations

import numba
import pytest
from numba import config

_cache = pytest.importorskip("tinyloop.cuda.kernels._cache")

pytestmark = pytest.mark.skipif(numba.config.ENABLE_CUDASIM, reason="the simulator never caches")


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setitem(_cache._state, "dir", None)
    return monkeypatch


def _k(out):
    out[0] = 1


def test_cache_folder_is_keyed_by_the_kernel_sources(fresh, tmp_path):
    fresh.setenv("TINYLOOP_KERNEL_CACHE", str(tmp_path))
    d = _cache.cache_dir()
    assert d.startswith(str(tmp_path)) and len(d.rsplit("kernels-", 1)[1]) == 16
    fresh.setitem(_cache._state, "dir", None)
    assert _cache.cache_dir() == d                      # the same sources, the same folder


def test_cache_off_and_default_folder(fresh, monkeypatch, tmp_path):
    fresh.setenv("TINYLOOP_KERNEL_CACHE", "0")
    assert _cache.cache_dir() is None
    assert type(_cache.jit_kernel(_k)._cache).__name__ == "NullCache"
    fresh.setitem(_cache._state, "dir", None)
    fresh.delenv("TINYLOOP_KERNEL_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _cache.cache_dir().startswith(str(tmp_path / ".cache" / "tinyloop" / "kernels-"))


def test_jit_kernel_caches_in_the_folder_and_restores_numba_config(fresh, tmp_path):
    fresh.setenv("TINYLOOP_KERNEL_CACHE", str(tmp_path))
    before = config.CACHE_DIR
    for k in (_cache.jit_kernel(_k), _cache.jit_kernel(max_registers=32)(_k)):
        assert type(k._cache).__name__ == "CUDACache"
        assert k._cache.cache_path.startswith(_cache.cache_dir())
    assert config.CACHE_DIR == before


def test_unwritable_folder_compiles_without_a_cache(fresh, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    fresh.setenv("TINYLOOP_KERNEL_CACHE", str(blocker))
    k = _cache.jit_kernel(_k)
    assert type(k._cache).__name__ == "NullCache"
