"""Documented early-exit claims (README "Early exit", docs/ARCHITECTURE.md "Early exit: per-token
depth") not covered by the other exit tests."""

from __future__ import annotations

import pytest

import tinyloop as tl


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model("demo", max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


@pytest.mark.parametrize("kw", [dict(early_exit_threshold=0.3), dict(early_exit_criterion="kl"),
                                dict(early_exit_min_L=3), dict(early_exit_peek_every=2),
                                dict(early_exit_kv="recompute"), dict(early_exit_logit_margin=2.0)])
def test_an_exit_knob_without_patience_names_the_switch(demo, kw):
    """ARCHITECTURE: "any exit knob with early_exit_patience=0 [is an error]". The greedy decoder
    does honour the exit knobs, so the refusal must point at early_exit_patience (early exit is
    off), not only at choosing another decoder."""
    name, value = next(iter(kw.items()))
    with pytest.raises(tl.IncompatibleModesError) as exc:
        tl.generate(demo, [1, 2, 3], tl.GenerateConfig(max_tokens=2, loops=4, **kw))
    msg = str(exc.value)
    assert f"{name}={value!r}" in msg
    assert "early_exit_patience" in msg
