"""Edges of the plugin extension points as a third-party author meets them, and of
configs/compat.yaml as data: a broken plugin is a PluginError naming it (when the registry is
built, before any work), never a crash deep in the engine or a silent override; a malformed matrix
file is a ConfigError naming the file and the rule."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import tinyloop as tl
from tinyloop.runtime.cache import CacheMode, KVCodec
from tinyloop.runtime.compat import load_matrix
from tinyloop.runtime.decoding import Decoder
from tinyloop.runtime.early_exit import ExitCriterion
from tinyloop.runtime.hookspecs import hookimpl
from tinyloop.runtime.plugins import PluginManager, get_plugin_manager
from tinyloop.runtime.processors import LogitProcessor

COMPAT = Path(__file__).resolve().parents[1] / "configs" / "compat.yaml"
EXIT_ROW = dict(load_matrix().modes["early_exit"].cells)


def _plugin(hook, result):
    """An object whose `hook` returns `result` (or raises it, when it is an exception)."""
    def impl(self):
        if isinstance(result, BaseException):
            raise result
        return result
    impl.__name__ = hook
    return type("EdgePlugin", (), {hook: hookimpl(impl)})()


class _Greedy(Decoder):
    def decode(self, session):
        session.start()
        while True:
            tok = session.greedy()
            yield tok
            session.advance(tok)


@pytest.fixture
def no_alloc(tiny_model, monkeypatch):
    """Fails the test if a KV cache is allocated (refusals must come before any work)."""
    def refuse(*a):
        raise AssertionError("a cache was allocated before the request was refused")
    monkeypatch.setattr(tiny_model.backend, "alloc_cache", refuse)
    return tiny_model


# ------------------------------------------------------------------ hooks
def test_a_hook_that_raises_is_a_plugin_error_naming_the_plugin(no_alloc, prompt):
    with get_plugin_manager().registered(_plugin("tinyloop_decoders", RuntimeError("boom")), name="edge-raiser"):
        with pytest.raises(tl.PluginError, match=r"plugin 'edge-raiser'.*tinyloop_decoders.*RuntimeError: boom"):
            tl.generate(no_alloc, prompt, tl.GenerateConfig(max_tokens=2))


def test_the_manager_recovers_once_the_raising_plugin_is_gone(tiny_model, prompt):
    with get_plugin_manager().registered(_plugin("tinyloop_cache_modes", KeyError("x")), name="edge-raiser"):
        with pytest.raises(tl.PluginError, match="edge-raiser"):
            get_plugin_manager().cache_modes()
    assert len(tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=2))) == len(prompt) + 2


class _D1(_Greedy):
    name = "edge_d1"


@pytest.mark.parametrize("result", [_D1, "edge_d1", {"edge_d1": _D1}], ids=["class", "str", "dict"])
def test_a_hook_returning_something_else_than_a_list(result):
    pm = PluginManager(load_entrypoints=False)
    pm.register(_plugin("tinyloop_decoders", result), name="edge-notlist")
    with pytest.raises(tl.PluginError, match=r"plugin 'edge-notlist': tinyloop_decoders returned .*not a list"):
        pm.decoders()


def test_a_name_that_is_not_a_string():
    class IntName(_Greedy):
        name = 7
    pm = PluginManager(load_entrypoints=False)
    pm.register(_plugin("tinyloop_decoders", [IntName]), name="edge-intname")
    with pytest.raises(tl.PluginError, match=r"plugin 'edge-intname'.*has no name .*got 7"):
        pm.decoders()


def test_a_duplicate_name_names_both_plugins():
    class Dup(KVCodec):
        name = "fp16"
    pm = PluginManager(load_entrypoints=False)
    pm.register(_plugin("tinyloop_kv_codecs", [Dup]), name="edge-dup")
    with pytest.raises(tl.PluginError, match=r"two plugins register the KVCodec name 'fp16'.*plugin 'edge-dup'"):
        pm.kv_codecs()


@pytest.mark.parametrize("obj, why", [
    (type("Typo", (), {"tinyloop_decoder": hookimpl(lambda self: [])})(), "unknown hook 'tinyloop_decoder'"),
    (type("Args", (), {"tinyloop_decoders": hookimpl(lambda self, config: [])})(), "config"),
], ids=["unknown-hook", "hook-arguments"])
def test_a_plugin_pluggy_refuses_is_a_plugin_error_and_stays_out(obj, why):
    pm = PluginManager(load_entrypoints=False)
    with pytest.raises(tl.PluginError, match=rf"(?s)plugin 'edge-refused' cannot be registered: .*{why}"):
        pm.register(obj, name="edge-refused")
    assert not pm.pm.has_plugin("edge-refused")
    assert "greedy" in pm.decoders()


def test_a_plugin_name_in_use_is_a_plugin_error():
    pm = PluginManager(load_entrypoints=False)
    pm.register(_plugin("tinyloop_decoders", []), name="edge-same")
    with pytest.raises(tl.PluginError, match="plugin 'edge-same' cannot be registered"):
        pm.register(_plugin("tinyloop_decoders", []), name="edge-same")


# ------------------------------------------------------------------ missing / wrong class attributes
class _NoDecode(Decoder):
    name = "edge_nodecode"


class _LockNoPick(_Greedy):
    name = "edge_locknopick"
    lockstep = True


class _DictOptions(_Greedy):
    name = "edge_dictopts"
    options_class = dict


@pytest.mark.parametrize("cls, why", [
    (_NoDecode, "does not implement decode"),
    (_LockNoPick, "lockstep = True but does not implement pick"),
    (_DictOptions, "options_class .* is not a dataclass"),
], ids=["no-decode", "lockstep-no-pick", "options-not-dataclass"])
def test_a_decoder_missing_what_it_needs(no_alloc, prompt, cls, why):
    with get_plugin_manager().registered(_plugin("tinyloop_decoders", [cls]), name="edge-decoder"):
        with pytest.raises(tl.PluginError, match=rf"plugin 'edge-decoder': .*{why}"):
            tl.generate_batch(no_alloc, [prompt, prompt[:3]], tl.GenerateConfig(max_tokens=2, decoder=cls.name))


class _NoStatistic(ExitCriterion):
    name = "edge_nostat"
    compat = EXIT_ROW
    default_threshold = 0.1


class _UnknownStat(_NoStatistic):
    name = "edge_cosine"
    stat = "cosine"


class _BadReads(_NoStatistic):
    name = "edge_reads"
    reads = "logit"

    def statistic(self, cur, prev):
        return 0.0


@pytest.mark.parametrize("cls, why", [
    (_NoStatistic, "declares no stat and no statistic"),
    (_UnknownStat, "stat='cosine' is not a backend statistic"),
    (_BadReads, "reads 'logit'; allowed"),
], ids=["no-statistic", "unknown-stat", "bad-reads"])
def test_an_exit_criterion_missing_what_it_needs(no_alloc, prompt, cls, why):
    cfg = tl.GenerateConfig(max_tokens=3, early_exit_patience=1, early_exit_criterion=cls.name)
    with get_plugin_manager().registered(_plugin("tinyloop_exit_criteria", [cls]), name="edge-exit"):
        with pytest.raises(tl.PluginError, match=rf"plugin 'edge-exit': .*{why}"):
            tl.generate(no_alloc, prompt, cfg)


def test_a_codec_with_a_bad_dtype(no_alloc, prompt):
    class BadDtype(KVCodec):
        name = "edge_bf17"
        data_dtype = "bfloat17"
        backend_impls = {"cpu": "tinyloop.cpu.kv_codecs:CPU_FP16"}

    class Mode(CacheMode):
        name = "edge_bf17"
        codec = "edge_bf17"
    pm = get_plugin_manager()
    with pm.registered(_plugin("tinyloop_kv_codecs", [BadDtype]), name="edge-codec"), \
            pm.registered(_plugin("tinyloop_cache_modes", [Mode]), name="edge-mode"):
        with pytest.raises(tl.PluginError, match=r"plugin 'edge-codec': .*data_dtype='bfloat17'"):
            tl.generate(no_alloc, prompt, tl.GenerateConfig(max_tokens=2, cache_mode="edge_bf17"))


def test_a_processor_whose_from_config_returns_a_non_processor(no_alloc, prompt):
    class Yes(LogitProcessor):
        name = "edge_yes"

        @classmethod
        def from_config(cls, config):
            return "yes"
    with get_plugin_manager().registered(_plugin("tinyloop_processors", [Yes]), name="edge-proc"):
        with pytest.raises(tl.PluginError, match=r"from_config returned 'yes', not a LogitProcessor"):
            tl.generate(no_alloc, prompt, tl.GenerateConfig(max_tokens=2))


# ------------------------------------------------------------------ declared compat vs the matrix
class _LooseCriterion(ExitCriterion):
    """Claims early exit composes with batches; the matrix rejects it."""
    name = "edge_loose"
    compat = {**EXIT_ROW, "batched": "ok"}
    stat = "rel_l2"
    default_threshold = 0.1


class _Bf16Row(CacheMode):
    """Claims a matrix row that does not exist."""
    name = "edge_bf16"
    codec = "fp16"
    mode = "bf16_cache"
    compat = {"single": "ok", "batched": "ok"}


@pytest.mark.parametrize("hook, cls, cfg, why", [
    ("tinyloop_exit_criteria", _LooseCriterion,
     dict(early_exit_patience=1, early_exit_criterion="edge_loose"), r"contradicts configs/compat.yaml"),
    ("tinyloop_cache_modes", _Bf16Row, dict(cache_mode="edge_bf16"), r"'bf16_cache', which is not a row"),
], ids=["contradicting-cells", "unknown-row"])
def test_a_declared_compat_the_matrix_contradicts(no_alloc, prompt, hook, cls, cfg, why):
    with get_plugin_manager().registered(_plugin(hook, [cls]), name="edge-compat"):
        with pytest.raises(tl.PluginError, match=rf"plugin 'edge-compat': .*{why}"):
            tl.generate(no_alloc, prompt, tl.GenerateConfig(max_tokens=2, **cfg))


# ------------------------------------------------------------------ entry points
def _install(tmp_path, monkeypatch, source):
    site = tmp_path / "site"
    pkg = site / "tl_edge_plugin"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(source))
    dist = site / "tl_edge_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tl-edge-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[tinyloop]\nedge = tl_edge_plugin\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "tl_edge_plugin", raising=False)


@pytest.mark.parametrize("source, why", [
    ("import tl_edge_missing_dependency\n", "ModuleNotFoundError"),
    ("from tinyloop import hookimpl\n@hookimpl\ndef tinyloop_decoder():\n    return []\n",
     "unknown hook 'tinyloop_decoder'"),
], ids=["import-error", "unknown-hook"])
def test_a_broken_installed_package_is_named(tmp_path, monkeypatch, source, why):
    _install(tmp_path, monkeypatch, source)
    try:
        with pytest.raises(tl.PluginError, match=rf"plugin 'edge' \(entry point edge = tl_edge_plugin.*{why}"):
            PluginManager()
    finally:
        sys.modules.pop("tl_edge_plugin", None)


# ------------------------------------------------------------------ the matrix file
def _matrix(tmp_path, edit, name="matrix.yaml"):
    text = COMPAT.read_text(encoding="utf-8")
    new = edit(text)
    assert new != text
    path = tmp_path / name
    path.write_text(new, encoding="utf-8")
    return str(path)


def test_a_rule_on_an_unknown_field_is_refused(tmp_path):
    """A typo in a `when` field would switch the mode off for every request (beams in a batch
    would run); the loader names the field."""
    path = _matrix(tmp_path, lambda t: t.replace("when: [beam_size,", "when: [beam_sizes,"))
    with pytest.raises(tl.ConfigError, match=r"modes.beam_search.when names 'beam_sizes', which is not a "
                                              r"GenerateConfig field"):
        load_matrix(path)


def test_a_rule_whose_value_cannot_compare_is_refused(tmp_path):
    path = _matrix(tmp_path, lambda t: t.replace('when: [cache_window, ">", 0]', 'when: [cache_window, ">", "0"]'))
    with pytest.raises(tl.ConfigError, match=r"modes.cache_window.when compares cache_window .* with '0'"):
        load_matrix(path)


def test_a_key_given_twice_is_refused(tmp_path):
    """PyYAML keeps the last of two equal keys: a second beam_search row allowing batches would
    silently replace the rejecting one."""
    row = ('  beam_search:\n    status: implemented\n    when: [beam_size, ">=", 2]\n    cells: {single: ok, '
           'batched: ok, speculative: ok, tree_speculative: ok, prefix_reuse: ok, warm_start: ok}\n')
    path = _matrix(tmp_path, lambda t: t.replace("\npairs:\n", "\n" + row + "\npairs:\n"))
    with pytest.raises(tl.ConfigError, match=r"found the key 'beam_search' twice"):
        load_matrix(path)


@pytest.mark.parametrize("pair, why", [
    ("  - modes: [grammar, grammar]\n    reason: x\n", r"pairs\[4\].modes must name two different known modes"),
    ("  - modes: [[grammar], sampling]\n    reason: x\n", r"pairs\[4\].modes must name two different known modes"),
    ("  - modes: [grammar, sampling]\n", r"pairs\[4\] \(grammar \+ sampling\) needs a reason"),
], ids=["same-mode", "unhashable", "no-reason"])
def test_a_malformed_pair_is_refused(tmp_path, pair, why):
    path = _matrix(tmp_path, lambda t: t.rstrip("\n") + "\n" + pair)
    with pytest.raises(tl.ConfigError, match=why):
        load_matrix(path).check("single", tl.GenerateConfig(grammar={"regex": "[a-z]+"}, temperature=0.5,
                                                             sample_seed=1))


@pytest.mark.parametrize("key", ["contexts", "modes"])
def test_a_section_that_is_not_a_mapping_is_refused(tmp_path, key):
    path = tmp_path / "m.yaml"
    path.write_text(f"version: 1\n{key}: [a, b]\n")
    with pytest.raises(tl.ConfigError, match=rf"{key} must be a mapping"):
        load_matrix(str(path))


def test_an_error_in_another_compat_yaml_names_that_file(tmp_path):
    """A matrix of one's own (TINYLOOP_COMPAT) is usually also called compat.yaml; its errors must
    point at it, not at the shipped configs/compat.yaml."""
    path = _matrix(tmp_path, lambda t: t.replace("when: [beam_size,", "when: [beam_sizes,"), name="compat.yaml")
    with pytest.raises(tl.ConfigError) as info:
        load_matrix(path)
    assert str(info.value).startswith(path)
    assert load_matrix().source == "configs/compat.yaml"


def test_the_shipped_matrix_still_loads_and_rejects_its_pairs():
    m = load_matrix()
    with pytest.raises(tl.IncompatibleModesError, match="per-token adaptive depth does not compose with beams"):
        m.check("single", tl.GenerateConfig(beam_size=2, early_exit_patience=1))
