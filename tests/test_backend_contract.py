"""The backend contract as a plugin author meets it: one registry (the tinyloop_backends hook) that
every name check reads, optional capabilities a decoder asks for and falls back without, and
required capabilities refused before any allocation."""

from __future__ import annotations

import pytest

import tinyloop as tl
from tinyloop.runtime.backend import CAPABILITIES, BackendEntry
from tinyloop.runtime.config import RunConfig
from tinyloop.runtime.decoding import Decoder
from tinyloop.runtime.hookspecs import hookimpl
from tinyloop.analysis.memory import estimate_memory
from tinyloop.runtime.plugins import get_plugin_manager
from tinyloop.cpu.backend import CPUBackend


class PlainCPU(CPUBackend):
    """The CPU backend without any optional capability (as a minimal third-party backend)."""

    name = "plain-cpu"

    @property
    def capabilities(self):
        return frozenset()


class PlainEntry(BackendEntry):
    name = "plain-cpu"
    impl = f"{__name__}:PlainCPU"
    weights_dtype = "dequantized"
    description = "test: the CPU ops without optional capabilities"


class NowhereEntry(BackendEntry):
    name = "nowhere"
    impl = "no_such_module_here:Backend"

    @classmethod
    def available(cls, simulator_ok=False):
        return False, "this test backend never runs"


class NeedsChaining(Decoder):
    name = "needs_chaining"
    contexts = frozenset({"single"})
    requires = frozenset({"device_chaining"})

    def decode(self, session):
        session.start()
        while True:
            tok = session.greedy()
            yield tok
            session.advance(tok)


class Plugin:
    @hookimpl
    def tinyloop_backends(self):
        return [PlainEntry, NowhereEntry]

    @hookimpl
    def tinyloop_decoders(self):
        return [NeedsChaining]


@pytest.fixture
def plugin():
    with get_plugin_manager().registered(Plugin(), name="backend-contract-test") as pm:
        yield pm


def test_builtin_registry():
    pm = get_plugin_manager()
    assert {"cpu", "cuda"} <= set(pm.backends())
    assert pm.backend_names()[0] == "auto"
    assert set(CAPABILITIES) == {"tree", "device_chaining", "cache_reuse", "token_masks", "kv_layer_copy",
                                 "guarded_steps", "lanes", "device_sampling", "device_acceptance"}


def test_every_name_check_reads_the_registry(plugin, tiny_path):
    """A registered backend is accepted by load_model, RunConfig and estimate_memory, and listed by
    the CLI's --backend choices; an unregistered name is refused everywhere, listing the names."""
    m = tl.load_model(str(tiny_path), max_seq_len=32, backend="plain-cpu")
    try:
        assert m.backend_name == "plain-cpu" and m.backend.capabilities == frozenset()
    finally:
        tl.free_model(m)
    assert RunConfig(backend="plain-cpu").backend == "plain-cpu"
    est = estimate_memory(m.cfg, 32, backend="plain-cpu")
    assert est["weights_dtype"].startswith("float32")
    import argparse
    from tinyloop.cli.run import add_parser
    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    assert "plain-cpu" in parser._option_string_actions["--backend"].choices
    for bad in ("tpu", 3, None):
        with pytest.raises(tl.ConfigError, match="plain-cpu"):
            RunConfig(backend=bad)
        with pytest.raises(tl.ConfigError, match="plain-cpu"):
            tl.load_model(str(tiny_path), backend=bad)
        with pytest.raises(tl.ConfigError):
            estimate_memory(m.cfg, 32, backend=bad)


def test_unavailable_backend_is_typed(plugin, tiny_path):
    with pytest.raises(tl.BackendError, match="never runs"):
        tl.load_model(str(tiny_path), backend="nowhere")


def test_required_capability_refused_before_allocation(plugin, tiny_path, prompt):
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    try:
        held = tl.vram_usage_bytes(m)
        with pytest.raises(tl.BackendError, match="device_chaining"):
            tl.generate(m, prompt, tl.GenerateConfig(max_tokens=3, decoder="needs_chaining"))
        assert tl.vram_usage_bytes(m) == held
    finally:
        tl.free_model(m)


def test_tree_decoder_falls_back_to_the_chain(plugin, tiny_path, prompt):
    """tree_speculative on a backend without tree ops runs the chain decoder (the one-branch tree):
    the tokens of plain greedy decoding, the stats say which decoder ran."""
    cfg = dict(max_tokens=10, loops=3)
    opts = dict(draft_loops=1, draft_ahead=3, K_branches=3)
    ref = tl.generate(tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu"), prompt,
                      tl.GenerateConfig(**cfg))
    for backend, ran in (("cpu", "tree_speculative"), ("plain-cpu", "speculative")):
        m = tl.load_model(str(tiny_path), max_seq_len=64, backend=backend)
        try:
            st = tl.GenerateStats()
            out = tl.generate_stream(m, prompt, tl.GenerateConfig(decoder="tree_speculative", options=opts, **cfg),
                              stats=st)
            assert out == ref and st.decoder == ran and st.verify_forwards > 0
        finally:
            tl.free_model(m)


def test_a_model_with_biases_needs_add_bias(tmp_path, monkeypatch):
    """A backend without the add_bias op is refused at load for a qkv_bias model (named), before
    its weights are loaded; the same backend loads the model once it has the op."""
    from conftest import write_tiny
    from tinyloop.runtime.backend import Backend
    path = tmp_path / "bias.tinyloop"
    write_tiny(path, qkv_bias=True)
    monkeypatch.setattr(CPUBackend, "add_bias", Backend.add_bias)
    with pytest.raises(tl.BackendError, match="qkv_bias.*add_bias"):
        tl.load_model(str(path), backend="cpu", max_seq_len=32)
    monkeypatch.undo()
    m = tl.load_model(str(path), backend="cpu", max_seq_len=32)
    assert len(tl.generate(m, [1, 2, 3], tl.GenerateConfig(max_tokens=3))) == 6
    tl.free_model(m)
