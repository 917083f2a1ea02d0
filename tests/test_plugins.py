"""Plugins: hooks documented, built-ins registered like third-party ones, an outside decoder runs
through generate and through a YAML config."""

from __future__ import annotations

import inspect as pyinspect

import pytest
import yaml

import tinyloop as tl
from tinyloop.runtime import hookspecs
from tinyloop.runtime.decoding import Decoder
from tinyloop.runtime.hookspecs import hookimpl
from tinyloop.runtime.plugins import DEFAULT_PLUGINS, PluginManager, get_plugin_manager


class LowestIdDecoder(Decoder):
    """A third-party decoder: emits the smallest id among the top-2 logits."""

    name = "lowest_of_top2"
    contexts = frozenset({"single"})

    def decode(self, session):
        import numpy as np
        session.start()
        while True:
            lg = session.logits()
            tok = int(min(np.argsort(lg)[-2:]))
            yield tok
            session.advance(tok)


class ThirdParty:
    @hookimpl
    def tinyloop_decoders(self):
        return [LowestIdDecoder]


@pytest.fixture
def third_party():
    with get_plugin_manager().registered(ThirdParty(), name="third-party-test") as pm:
        yield pm


def test_every_hook_is_prefixed_and_documented():
    hooks = [n for n, f in vars(hookspecs).items() if pyinspect.isfunction(f) and n.startswith("tinyloop_")]
    assert len(hooks) >= 3
    for name in hooks:
        assert getattr(hookspecs, name).__doc__ and len(getattr(hookspecs, name).__doc__) > 40
    pm = PluginManager(load_entrypoints=False)
    for impl_name in pm.pm.hook.__dict__:
        if not impl_name.startswith("_"):
            assert impl_name.startswith("tinyloop_")


def test_a_hook_without_a_docstring_fails():
    """Every hookspec in hookspecs.py (whatever its name) is a documented tinyloop_* registry hook
    that says what it returns and how results combine; the manager knows exactly those hooks."""
    specs = {n: f for n, f in vars(hookspecs).items()
             if pyinspect.isfunction(f) and hasattr(f, "tinyloop_spec")}
    assert {"tinyloop_decoders", "tinyloop_processors", "tinyloop_stoppers", "tinyloop_cache_modes",
            "tinyloop_kv_codecs", "tinyloop_slot_maps"} <= set(specs)
    for name, f in specs.items():
        doc = pyinspect.getdoc(f) or ""
        assert name.startswith("tinyloop_"), name
        assert doc.startswith("Return a list of") and "Result:" in doc and len(doc) > 80, \
            f"hook {name} needs a docstring: what it returns and its result mode"
    pm = PluginManager(load_entrypoints=False)
    declared = {n for n in vars(pm.pm.hook) if not n.startswith("_")}
    assert declared == set(specs)


def test_plugin_author_api_is_exported():
    for name in ("hookimpl", "Decoder", "DecodeSession", "Session", "LogitProcessor", "Stopper", "StopOrder",
                 "CacheMode", "KVCodec", "SlotMapMode", "Stage"):
        obj = getattr(tl, name)
        assert name in tl.__all__ and (name == "hookimpl" or obj.__doc__), name
    assert tl.hookimpl is hookimpl and tl.Decoder is Decoder
    for meth in ("start", "logits", "greedy", "advance", "fork_pool", "copy_state", "lane_tokens"):
        assert getattr(tl.DecodeSession, meth).__doc__, meth
        assert callable(getattr(tl.Session, meth))


def _imports(path, package):
    """Absolute names of the modules a file imports (relative imports resolved)."""
    import ast
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_layers_import_no_plugin_module():
    """The runtime, the model layer, analysis and the backends name no plugin: the only way in is
    DEFAULT_PLUGINS, registered like a third party. The model layer imports nothing above it
    (runtime, analysis, backends)."""
    import pathlib
    root = pathlib.Path(tl.__file__).parent
    layers = {"model": ("tinyloop.runtime", "tinyloop.analysis", "tinyloop.cpu", "tinyloop.cuda"),
              "runtime": ("tinyloop.analysis",), "analysis": (), "cpu": (), "cuda": ()}
    checked = 0
    for layer, above in layers.items():
        for path in (root / layer).rglob("*.py"):
            rel = path.relative_to(root.parent).with_suffix("")
            package = ".".join(rel.parts[:-1])
            for mod in _imports(path, package):
                assert not mod.startswith("tinyloop.plugins"), f"{rel} imports {mod}"
                assert not mod.startswith(above), f"{rel} (layer {layer}) imports {mod} from a layer above it"
            checked += 1
    assert checked > 30
    for mod in _imports(root / "errors.py", "tinyloop"):
        assert not mod.startswith("tinyloop"), f"errors.py imports {mod}"

def test_builtins_registered_as_ordinary_plugins():
    pm = PluginManager(load_entrypoints=False)
    names = {n for n, _ in pm.pm.list_name_plugin()}
    assert set(DEFAULT_PLUGINS) <= names
    assert {"greedy", "sampling"} <= set(pm.decoders())
    assert {"fp16", "fp32"} <= set(pm.cache_modes())
    assert "repetition_penalty" in pm.processors()


def test_third_party_decoder_through_generate(third_party, tiny_model, prompt):
    out = tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=6, decoder="lowest_of_top2"))
    scores_ok = []
    for i in range(len(prompt), len(out)):
        import numpy as np
        lg = tl.score_last_token(tiny_model, out[:i])
        scores_ok.append(out[i] == int(min(np.argsort(lg)[-2:])))
    assert all(scores_ok) and len(out) == len(prompt) + 6


def test_third_party_decoder_context_declared(third_party, tiny_model, prompt):
    with pytest.raises(tl.PluginError, match="does not run in batched"):
        tl.generate_batch(tiny_model, [prompt], tl.GenerateConfig(max_tokens=2, decoder="lowest_of_top2"))


def test_third_party_decoder_through_yaml(third_party, tmp_path):
    from conftest import write_tiny
    from tinyloop.cli.main import main
    path = tmp_path / "bytes.tinyloop"
    write_tiny(path, vocab_size=256)
    cfg = {"model": str(path), "backend": "cpu", "max_seq_len": 64, "prompts": ["ab"],
           "output_jsonl": str(tmp_path / "o.jsonl"), "stream": False,
           "generate": {"max_tokens": 4, "decoder": "lowest_of_top2"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp_path / "c.yaml")]) == 0
    import json
    rec = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])
    m = tl.load_model(str(path), max_seq_len=64, backend="cpu")
    try:
        expect = tl.generate(m, [ord("a"), ord("b")], tl.GenerateConfig(max_tokens=4, decoder="lowest_of_top2"))
    finally:
        tl.free_model(m)
    assert rec["prompt_ids"] == [ord("a"), ord("b")] and rec["output_ids"] == expect[2:]


def test_unknown_plugin_names_are_typed_errors(tiny_model, prompt):
    with pytest.raises(tl.PluginError, match="decoder='nope' is not registered"):
        tl.generate(tiny_model, prompt, tl.GenerateConfig(decoder="nope"))
    with pytest.raises(tl.PluginError, match="cache_mode='bf13' is not registered"):
        tl.generate(tiny_model, prompt, tl.GenerateConfig(cache_mode="bf13"))


def test_duplicate_plugin_name_rejected():
    class Dup(Decoder):
        name = "greedy"

    class P:
        @hookimpl
        def tinyloop_decoders(self):
            return [Dup]
    pm = PluginManager(load_entrypoints=False)
    pm.register(P())
    with pytest.raises(tl.PluginError, match="two plugins register"):
        pm.decoders()


def test_bad_decoder_output_is_caught(tiny_model, prompt):
    class Bad(Decoder):
        name = "bad"

        def decode(self, session):
            session.start()
            yield 10_000

    class P:
        @hookimpl
        def tinyloop_decoders(self):
            return [Bad]
    pm = get_plugin_manager()
    p = P()
    pm.register(p)
    try:
        with pytest.raises(tl.PluginError, match="produced 10000"):
            tl.generate(tiny_model, prompt, tl.GenerateConfig(decoder="bad"))
        assert tl.vram_usage_bytes(tiny_model) == tiny_model.backend.memory_bytes()
    finally:
        pm.unregister(p)
