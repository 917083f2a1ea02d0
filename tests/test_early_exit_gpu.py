"""Early exit on the CUDA backend (marker gpu): the guarded step (one graph of conditional nodes,
probes on the device) gives the CPU backend's depths and greedy tokens, the eager guarded path's
and the float64 oracle's logits at the same depths."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.analysis.loopgain import HELDOUT_TEXT
from tinyloop.model.reference import reference_logits_exit
from tinyloop.models import model_path

from conftest import logical_weights, real_gpu

pytestmark = pytest.mark.gpu

if not real_gpu():
    pytest.skip("no CUDA GPU", allow_module_level=True)

CONFIGS = [("hidden_l2", dict(early_exit_threshold=0.35)), ("kl", dict(early_exit_threshold=0.05)),
           ("argmax", {}), ("logit_margin", dict(early_exit_logit_margin=2.0))]


@pytest.fixture(scope="module")
def pair(demo_pair):
    return demo_pair


def cfg_of(criterion, kv, **kw):
    return tl.GenerateConfig(early_exit_patience=1, early_exit_criterion=criterion, early_exit_kv=kv,
                             **dict(CONFIGS)[criterion], **kw)


@pytest.mark.parametrize("criterion", [c for c, _ in CONFIGS])
@pytest.mark.parametrize("kv", ["copy_last", "recompute"])
def test_depths_and_tokens_equal_the_cpu(pair, criterion, kv):
    cpu, gpu = pair
    assert gpu.backend.guarded_graphs, "the guarded graph path is not available on this GPU"
    for prompt in ("Once upon a time", "The little dog ran to the"):
        p = cpu.tokenizer.encode(prompt)
        cfg = cfg_of(criterion, kv, max_tokens=40)
        want, got = tl.GenerateStats(), tl.GenerateStats()
        launches = gpu.backend.graph_launches
        assert tl.generate(gpu, p, cfg, stats=got) == tl.generate(cpu, p, cfg, stats=want)
        assert got.token_loops == want.token_loops and got.exit_probes == want.exit_probes
        assert gpu.backend.graph_launches - launches >= 30       # the steps replay captured graphs


@pytest.mark.parametrize("criterion", ["hidden_l2", "kl"])
@pytest.mark.parametrize("kv", ["copy_last", "recompute"])
def test_logits_equal_the_oracle_at_the_same_depths(pair, criterion, kv):
    _, gpu = pair
    ids = gpu.tokenizer.encode(HELDOUT_TEXT.read_text(encoding="utf-8")[:400])[:40]
    st = tl.GenerateStats()
    cfg = dataclasses.replace(cfg_of(criterion, kv), cache_mode="fp32")
    got = tl.score_decoded(gpu, ids, cfg, stats=st)
    assert min(st.token_loops) < 4
    ref = reference_logits_exit(gpu.cfg, logical_weights(model_path(None)), ids, st.token_loops, 4, kv)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


def test_guarded_graph_equals_the_eager_guarded_path(pair, monkeypatch):
    cpu, gpu = pair
    monkeypatch.setenv("TINYLOOP_CUDA_GRAPHS", "0")
    eager = tl.load_model(None, backend="cuda", max_seq_len=256)
    try:
        assert not eager.backend.guarded_graphs
        p = cpu.tokenizer.encode("She opened the door and")
        for criterion in ("kl", "argmax"):
            cfg = cfg_of(criterion, "copy_last", max_tokens=32)
            a, b = tl.GenerateStats(), tl.GenerateStats()
            assert tl.generate(eager, p, cfg, stats=a) == tl.generate(gpu, p, cfg, stats=b)
            assert a.token_loops == b.token_loops
    finally:
        tl.free_model(eager)
