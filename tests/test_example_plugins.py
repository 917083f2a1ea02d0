"""The worked third-party plugin package (examples/tinyloop-example, installed by CI with
``pip install -e examples/tinyloop-example``): found through the entry-point group like any
installed package; its decoder's options are validated; its bf16 cache codec is checked against its
own numpy reference and the quantizing float64 oracle, and refused on a backend it does not
implement."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

import tinyloop as tl
from tinyloop.runtime.plugins import PluginManager
from tinyloop.model.reference import reference_logits

from conftest import logical_weights, write_tiny

example = pytest.importorskip("tinyloop_example", reason="pip install -e examples/tinyloop-example")
from tinyloop_example.bf16_codec import BF16Codec  # noqa: E402
from tinyloop_example.min_p import min_p_probs  # noqa: E402


def test_found_through_the_entry_point_group():
    eps = [ep for ep in importlib.metadata.entry_points(group="tinyloop") if ep.name == "example"]
    assert eps, "examples/tinyloop-example is installed without its entry point"
    pm = PluginManager()                       # loads entry points like a fresh process
    assert "min_p" in pm.decoders() and "bf16" in pm.cache_modes() and "bf16" in pm.kv_codecs()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ex") / "tiny.tinyloop"
    cfg = write_tiny(path)
    m = tl.load_model(str(path), max_seq_len=96, backend="cpu")
    yield m, cfg, logical_weights(path)
    tl.free_model(m)


IDS = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77]


def test_bf16_codec_reference():
    x = np.array([[1.0, -2.5, 3.14159, 1e-8, 65504.0, -0.0, 1.0 + 2 ** -9, 1.0 + 3 * 2 ** -9]], np.float32)
    got = BF16Codec.roundtrip(x)
    # round to nearest even on the 8-bit mantissa: 1 + 2^-9 is a tie -> 1.0, 1 + 3*2^-9 -> 1 + 2^-7
    assert got[0, 0] == 1.0 and got[0, 6] == 1.0 and got[0, 7] == 1.0 + 2 ** -7
    assert np.all(np.abs(got - x) <= np.abs(x) * 2 ** -8)


def test_bf16_cache_matches_the_quantizing_oracle(tiny):
    m, cfg, W = tiny
    got = tl.score(m, IDS, loops=3, cache_mode="bf16")
    ref = reference_logits(cfg, W, IDS, 3, kv_codec=BF16Codec)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-3
    assert len(tl.generate(m, IDS, tl.GenerateConfig(max_tokens=6, cache_mode="bf16"))) == len(IDS) + 6


def test_bf16_is_refused_where_it_has_no_implementation(tiny):
    from tinyloop.runtime.plugins import get_plugin_manager
    codec = get_plugin_manager().codec("bf16")
    with pytest.raises(tl.PluginError, match="no implementation for the cuda backend"):
        codec.impl("cuda")


def test_min_p_decoder_options(tiny):
    m, _, _ = tiny
    cfg = tl.GenerateConfig(max_tokens=8, decoder="min_p", temperature=0.9, sample_seed=3,
                            options={"min_p": 0.2})
    a = tl.generate(m, IDS, cfg)
    assert a == tl.generate(m, IDS, cfg) and len(a) == len(IDS) + 8
    # each drawn token is inside the min-p set of its step
    for i in range(len(IDS), len(a)):
        p = min_p_probs(tl.score_last_token(m, a[:i]), 0.9, 0.2)
        assert p[a[i]] > 0
    greedy = tl.generate(m, IDS, tl.GenerateConfig(max_tokens=8, decoder="min_p"))
    assert greedy == tl.generate(m, IDS, tl.GenerateConfig(max_tokens=8))
    with pytest.raises(tl.ConfigError, match=r"min_p=1.5 is outside the allowed range"):
        tl.generate(m, IDS, tl.GenerateConfig(decoder="min_p", temperature=0.9, options={"min_p": 1.5}))
    with pytest.raises(tl.ConfigError, match="unknown key 'top_a'"):
        tl.generate(m, IDS, tl.GenerateConfig(decoder="min_p", temperature=0.9, options={"top_a": 1}))
    with pytest.raises(tl.IncompatibleModesError, match="top_p"):
        tl.generate(m, IDS, tl.GenerateConfig(decoder="min_p", temperature=0.9, top_p=0.5))
