"""The built-in CPU kernels come from numba's disk cache in every process after the first (issue 16:
"first token fast in every process"): a second process compiles none of them (each dispatcher's
``stats`` counts cache hits and misses) and writes no new file to the cache directory, so the cache
does not grow per process. A third-party codec's kernel (the example package's bf16) compiles in each
process, and it must write nothing either. No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_tiny

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import importlib.util, json, sys
import tinyloop as tl
from numba.core.registry import CPUDispatcher
from tinyloop.cpu import ops

m = tl.load_model(sys.argv[1], backend="cpu", max_seq_len=64)
ids = [3, 17, 42, 8, 91, 23, 11, 60]
modes = ["fp32", "fp16", "int8", "int4"]
if importlib.util.find_spec("tinyloop_example") is not None:
    modes.append("bf16")                               # third-party: compiled, never cached
for mode in modes:
    tl.generate(m, ids, tl.GenerateConfig(max_tokens=3, cache_mode=mode))
    tl.generate(m, ids, tl.GenerateConfig(max_tokens=3, cache_mode=mode, cache_window=4))
tl.generate_tree_speculative(m, ids, tl.TreeSpeculativeConfig(max_tokens=4, draft_loops=1,
                                                              verify_loops=2, draft_ahead=2))
stats = {}
for name in dir(ops):
    f = getattr(ops, name)
    if isinstance(f, CPUDispatcher):
        hits, misses = sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values())
        if hits or misses:
            stats[name] = [hits, misses]
print(json.dumps({"stats": stats, "cache_dir": str(ops.matmul._cache.cache_path), "modes": modes}))
"""

#: every kernel the child's requests launch (argmax and topk: the tree decoder's picks)
USED = {"matmul", "rmsnorm", "embed", "swiglu", "add", "rope", "argmax", "topk",
        "attention_fp32", "attention_fp16", "attention_int8", "attention_int4"}


def _child(model):
    r = subprocess.run([sys.executable, "-c", CHILD, str(model)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _cache_files(d):
    # only the CPU kernels' entries (index .nbi and data .nbc files of tinyloop/cpu/ops.py)
    return sorted(p.name for p in Path(d).glob("ops.*") if p.suffix in (".nbi", ".nbc"))


@pytest.mark.skipif(os.environ.get("NUMBA_DISABLE_JIT") == "1", reason="needs numba's JIT")
def test_builtin_kernels_come_from_the_disk_cache_in_a_new_process(tmp_path):
    model = tmp_path / "tiny.tinyloop"
    write_tiny(model)
    first = _child(model)                        # fills the cache where this tree had no entry yet
    assert USED <= set(first["stats"]), sorted(USED - set(first["stats"]))
    before = _cache_files(first["cache_dir"])
    assert before, f"no cache files in {first['cache_dir']}"

    second = _child(model)
    missed = {n: s for n, s in second["stats"].items() if s[1]}
    assert not missed, f"compiled again in a new process instead of loaded from the cache: {missed}"
    assert all(second["stats"][n][0] >= 1 for n in USED)
    # nothing new in the cache directory: not for the built-ins, not for the third-party codec
    assert _cache_files(second["cache_dir"]) == before
