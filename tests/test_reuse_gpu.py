"""Cache reuse on the CUDA backend on a real GPU (the suite: tests/reuse_suite.py), and the same
tokens as the CPU backend (marker gpu)::

    python -m pytest -m gpu tests/test_reuse_gpu.py -q
"""

from __future__ import annotations

import pytest

import tinyloop as tl

from conftest import real_gpu

pytestmark = pytest.mark.gpu

if not real_gpu():
    pytest.skip("no CUDA GPU", allow_module_level=True)

pytest.register_assert_rewrite("reuse_suite")

from reuse_suite import *  # noqa: E402,F401,F403
from reuse_suite import _prompt, cfg  # noqa: E402


@pytest.fixture(scope="module")
def load():
    def _load(path, **kw):
        return tl.load_model(str(path), backend="cuda", **kw)
    return _load


def test_reuse_tokens_equal_the_cpu_backend(rm, model_path):
    cpu = tl.load_model(str(model_path), backend="cpu", max_seq_len=160, prefill_chunk=8)
    try:
        p = _prompt(33, 30)
        for mode in ("fp16", "int8"):
            pc = tl.build_prefix_cache(rm, p[:20], cache_mode=mode)
            h = tl.build_resume_handle(rm, p, 2, cfg(cache_mode=mode))
            try:
                c = cfg(cache_mode=mode)
                assert tl.generate_from_prefix_cache(rm, pc, p[20:], c) == tl.generate(cpu, p, c)
                assert tl.resume_generate(h, 6, c) == tl.generate(cpu, p, cfg(cache_mode=mode, loops=6))
            finally:
                tl.free_prefix_cache(pc)
                tl.free_resume_handle(h)
    finally:
        tl.free_model(cpu)
