"""The shipped exit-trained sibling of the demo model ("demo-exit", MODEL_CARD.md): it loads by
name, carries a learned exit gate, and its gate exits early on held-out text with the same tokens
and depths through the guarded step, the host probes and the uncached path."""

from __future__ import annotations

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.analysis.loopgain import HELDOUT_TEXT
from tinyloop.errors import ConfigError
from tinyloop.models import SHIPPED, model_path


@pytest.fixture(scope="module")
def m():
    model = tl.load_model("demo-exit", max_seq_len=256, backend="cpu")
    yield model
    tl.free_model(model)


def gate_cfg(q=0.9, **kw):
    return tl.GenerateConfig(early_exit_patience=1, early_exit_min_L=1, early_exit_criterion="gate",
                             early_exit_threshold=q, **kw)


def test_loads_by_name_with_the_demo_architecture_and_a_gate(m):
    assert model_path("demo-exit").endswith("demo-exit.tinyloop") and set(SHIPPED) == {"demo", "demo-exit"}
    cfg = m.cfg
    assert cfg.exit_gate and (cfg.d_model, cfg.n_pre, cfg.n_loop, cfg.n_post, cfg.default_loops) == (384, 1, 2, 1, 4)
    text = "def f(x):\n    return x  # the demo model's tokenizer"
    with tl.load_model("demo", backend="cpu") as demo:
        assert m.tokenizer.encode(text) == demo.tokenizer.encode(text)
    with pytest.raises(ConfigError, match="shipped model"):
        model_path(3)


def test_gate_exits_early_on_held_out_text_and_all_paths_agree(m, monkeypatch):
    ids = m.tokenizer.encode(HELDOUT_TEXT.read_text(encoding="utf-8")[:600])[:48]
    st = tl.GenerateStats()
    got = tl.score_decoded(m, ids, gate_cfg(), stats=st)
    depths = st.token_loops
    assert len(depths) == len(ids) and depths[0] == 4          # the first position is the prompt's
    assert min(depths) < 4 and np.mean(depths) < 3.8
    want = tl.score(m, ids, loops=4)
    assert np.isfinite(got).all() and got.shape == want.shape
    # rows before the first exit are full-depth positions with full-depth histories: plain scoring's
    first_exit = next(i for i, d in enumerate(depths) if d < 4)
    np.testing.assert_allclose(got[:first_exit], want[:first_exit], atol=1e-4)
    p = ids[:12]
    cfg = gate_cfg(max_tokens=24)
    ref = tl.GenerateStats()
    toks = tl.generate(m, p, cfg, stats=ref)
    caps = m.backend.capabilities
    with monkeypatch.context() as mp:
        mp.setattr(type(m.backend), "capabilities", property(lambda self: caps - {"guarded_steps"}))
        host = tl.GenerateStats()
        assert tl.generate(m, p, cfg, stats=host) == toks and host.token_loops == ref.token_loops
    monkeypatch.setenv("TINYLOOP_DISABLE_KV_CACHE", "1")
    unc = tl.GenerateStats()
    assert tl.generate(m, p, cfg, stats=unc) == toks and unc.token_loops == ref.token_loops
