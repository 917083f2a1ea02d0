"""A third-party author's view of the plugin extension points (docs/PLUGINS.md): new plugins of every
documented kind (a decoder with options, a KV codec and the cache mode that selects it, a logit
processor, a stopper, an exit criterion), registered in-process and through an installed entry point,
used through every public path (generate, generate_stream, generate_iter, generate_text,
generate_batch, prefix caches, speculative decoders, `python -m tinyloop run`, the server's request
options) and against compat.yaml rules for a new mode. What may go wrong is a typed error before any
work or, while decoding, a PluginError naming the plugin with the model left usable; registration is
safe against concurrent requests and a request keeps the plugins it was validated with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop as tl
from tinyloop.runtime import plugins as plugins_mod
from tinyloop.runtime.compat import CompatWarning, load_matrix
from tinyloop.runtime.early_exit import ExitCriterion, kl, rel_l2, top2_margin
from tinyloop.runtime.plugins import PluginManager, get_plugin_manager

ROOT = Path(__file__).resolve().parents[1]
EXIT_ROW = dict(load_matrix().modes["early_exit"].cells)

# --------------------------------------------------------------------------- the third-party package
# The files of `tp_plugins`, a package written from docs/PLUGINS.md alone: the docs' bf16 codec, its
# CPU implementation and cache mode, the docs' cosine exit criterion, a decoder with options (argmax
# plus a shift, so that an ignored option shows in the tokens; shift 0 is greedy decoding) and a
# stopper with its own reason. Installed as a dist-info (entry point) or registered by hand.
PACKAGE = {
    "bf16.py": '''
        import numpy as np
        import tinyloop as tl

        BF16_TO_FLOAT = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)


        class BF16Codec(tl.KVCodec):
            name = "tp_bf16"
            data_dtype = "uint16"
            pack = 1
            has_scale = False
            has_zero = False
            backend_impls = {"cpu": "tp_plugins.cpu_bf16:CPU_BF16"}

            @classmethod
            def encode(cls, x):
                return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16), None, None

            @classmethod
            def decode(cls, data, scale, zero):
                return BF16_TO_FLOAT[data]
    ''',
    "cpu_bf16.py": '''
        from numba import njit
        from tinyloop.cpu.kv_codecs import CPUCodec

        from tp_plugins.bf16 import BF16_TO_FLOAT


        @njit(inline="always", cache=True)
        def _load(data, scale, zero, layer, slot, head, d, lut):
            return lut[data[layer, slot, head, d]]


        class _CPUBF16(CPUCodec):
            lut = BF16_TO_FLOAT
            load = staticmethod(_load)


        CPU_BF16 = _CPUBF16()
    ''',
    "plugin.py": '''
        import dataclasses

        import numpy as np
        import tinyloop as tl
        from tinyloop.runtime.config import check_int
        from tinyloop.runtime.early_exit import ExitCriterion

        from tp_plugins.bf16 import BF16Codec


        class BF16Cache(tl.CacheMode):
            name = "tp_bf16"
            codec = "tp_bf16"


        @dataclasses.dataclass(frozen=True)
        class ShiftOptions:
            shift: int = 0

            def __post_init__(self):
                check_int("shift", self.shift, 0, 1000)


        class ShiftDecoder(tl.Decoder):
            """The argmax of the processed logits plus `shift` (mod the vocabulary)."""
            name = "tp_shift"
            options_class = ShiftOptions
            adaptive_depth = True
            lockstep = True

            def decode(self, session):
                session.start()
                while True:
                    tok = (int(np.argmax(session.logits())) + self.options.shift) % session.vocab_size
                    yield tok
                    session.advance(tok)

            def pick(self, lane):
                return (int(np.argmax(lane.logits())) + self.options.shift) % lane.vocab_size


        class CosineStable(ExitCriterion):
            name = "tp_cosine"
            compat = {"single": "ok", "batched": "rejected", "speculative": "rejected",
                      "tree_speculative": "rejected", "prefix_reuse": "ok", "warm_start": "rejected"}
            reads = "hidden"
            default_threshold = 0.01

            def statistic(self, cur, prev):
                return 1.0 - float(cur @ prev) / float(np.linalg.norm(cur) * np.linalg.norm(prev) + 1e-30)


        class ZeroStop(tl.Stopper):
            """Ends a sequence at token 0 with its own reason."""
            name = "tp_zero"
            ending_tokens = 1

            @classmethod
            def from_config(cls, config, model_config):
                return cls()

            def check(self, output_tokens):
                return tl.StopReason("TP_ZERO") if output_tokens[-1] == 0 else None


        @tl.hookimpl
        def tinyloop_kv_codecs():
            return [BF16Codec]


        @tl.hookimpl
        def tinyloop_cache_modes():
            return [BF16Cache]


        @tl.hookimpl
        def tinyloop_decoders():
            return [ShiftDecoder]


        @tl.hookimpl
        def tinyloop_exit_criteria():
            return [CosineStable]


        @tl.hookimpl
        def tinyloop_stoppers():
            return [ZeroStop]
    ''',
}


def _write_dist(site: Path, package: str, files: dict, entry_points: str, dist: str = None) -> Path:
    """`package` (its files) and a dist-info declaring `entry_points` under `site`."""
    pkg = site / package
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    dist = dist or package
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[tinyloop]\n{entry_points}\n")
    return site


@pytest.fixture(scope="module")
def tp_site(tmp_path_factory):
    """The package installed as a distribution with the entry point `tp = tp_plugins.plugin`."""
    return _write_dist(tmp_path_factory.mktemp("site"), "tp_plugins", PACKAGE, "tp = tp_plugins.plugin")


@pytest.fixture(scope="module")
def tp_module(tp_site):
    """The package's plugin module, imported (not registered)."""
    sys.path.insert(0, str(tp_site))
    try:
        import tp_plugins.plugin as mod
        yield mod
    finally:
        sys.path.remove(str(tp_site))
        for name in [n for n in sys.modules if n == "tp_plugins" or n.startswith("tp_plugins.")]:
            del sys.modules[name]


@pytest.fixture
def tp(tp_module):
    """The package's module registered by hand (docs: "without installing, register the module")."""
    with get_plugin_manager().registered(tp_module, name="tp-hand"):
        yield tp_module


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A tiny model with 256 ids (the raw-byte tokenizer serves text) and its path."""
    from conftest import write_tiny
    path = tmp_path_factory.mktemp("tp_bytes") / "bytes.tinyloop"
    write_tiny(path, vocab_size=256)
    m = tl.load_model(str(path), max_seq_len=96, backend="cpu")
    yield m, path
    tl.free_model(m)


class _Allocs:
    """Counts KV caches allocated on a model, to tell a refusal before any work from a failure after."""

    def __init__(self, model, monkeypatch):
        self.n, real = 0, model.backend.alloc_cache

        def alloc(*a, **k):
            self.n += 1
            return real(*a, **k)
        monkeypatch.setattr(model.backend, "alloc_cache", alloc)


@pytest.fixture
def allocs(tiny_model, monkeypatch):
    return _Allocs(tiny_model, monkeypatch)


def _usable(model, prompt):
    """Nothing of a failed request is left: no live cache, the lock free, the model decodes."""
    assert model._live_cache_bytes == 0 and not model._lock.locked()
    assert tl.vram_usage_bytes(model) == model.backend.memory_bytes()
    assert len(tl.generate(model, prompt, tl.GenerateConfig(max_tokens=2))) == len(prompt) + 2


def _hooks(**hooks):
    """A plugin object whose hooks return the given lists of classes."""
    ns = {}
    for hook, classes in hooks.items():
        def impl(self, _classes=classes):
            return list(_classes)
        impl.__name__ = hook
        ns[hook] = tl.hookimpl(impl)
    return type("TPPlugin", (), ns)()


# =========================================================================== registration
def test_a_plugin_registered_while_a_registry_is_built_is_not_lost():
    """register() in one thread while another thread builds the same registry: once register has
    returned, the plugin is visible (the registry being built before it must not be cached over it)."""
    entered, go = threading.Event(), threading.Event()

    class Slow:
        @tl.hookimpl
        def tinyloop_decoders(self):
            entered.set()
            go.wait(10)
            return []

    class Late(tl.Decoder):
        name = "tp_late"

        def decode(self, session):
            yield 0

    pm = PluginManager(load_entrypoints=False)
    pm.register(Slow(), name="tp-slow")
    builder = threading.Thread(target=pm.decoders)
    builder.start()
    assert entered.wait(10)
    registrar = threading.Thread(target=pm.register, args=(_hooks(tinyloop_decoders=[Late]),),
                                 kwargs={"name": "tp-late"})
    registrar.start()
    registrar.join(0.3)
    go.set()
    builder.join(10)
    registrar.join(10)
    assert pm.pm.has_plugin("tp-late")
    assert "tp_late" in pm.decoders()


def test_registration_racing_concurrent_requests(tiny_model, prompt):
    """A thread registering and unregistering a plugin of every registry the requests read, while
    requests run on two models: every request succeeds with the tokens it gets alone."""
    other = tl.load_model(str(tiny_model.path), max_seq_len=64, backend="cpu")

    class Noise(tl.CacheMode):
        name = "tp_noise"
        codec = "fp16"

    noise = _hooks(tinyloop_cache_modes=[Noise], tinyloop_processors=[], tinyloop_stoppers=[],
                   tinyloop_decoders=[], tinyloop_exit_criteria=[], tinyloop_slot_maps=[],
                   tinyloop_kv_codecs=[])
    cfg = tl.GenerateConfig(max_tokens=3)
    want = tl.generate(tiny_model, prompt, cfg)
    stop, errors = threading.Event(), []

    def churn():
        pm = get_plugin_manager()
        while not stop.is_set():
            try:
                pm.register(noise, name="tp-noise")
                pm.unregister(noise)
            except Exception as exc:          # pragma: no cover - reported below
                errors.append(exc)
                return

    def requests(model):
        try:
            for _ in range(25):
                assert tl.generate(model, prompt, cfg) == want
        except Exception as exc:              # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn), threading.Thread(target=requests, args=(tiny_model,)),
               threading.Thread(target=requests, args=(other,))]
    try:
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join(60)
    finally:
        stop.set()
        threads[0].join(10)
        tl.free_model(other)
    assert not errors, errors
    assert not get_plugin_manager().pm.has_plugin("tp-noise")


class _Ban(tl.LogitProcessor):
    """Allows token 5 only."""
    name = "tp_ban"

    @classmethod
    def from_config(cls, config):
        return cls()

    def apply(self, logits):
        logits[:] = -np.inf
        logits[5] = 0.0

    def clone(self):
        return _Ban()


def test_a_request_keeps_the_plugins_it_was_validated_with(tiny_model, prompt):
    """generate_iter validates at the call and decodes when read: a processor registered in between
    must not slip into it (beam search refuses processors: they would be applied to the beams
    unchecked), and one unregistered in between is not dropped from a request it was checked for."""
    beam = tl.GenerateConfig(max_tokens=4, beam_size=2)
    want = tl.generate(tiny_model, prompt, beam)[len(prompt):]
    it = tl.generate_iter(tiny_model, prompt, beam)
    with get_plugin_manager().registered(_hooks(tinyloop_processors=[_Ban]), name="tp-ban"):
        with pytest.raises(tl.PluginError, match="does not run logit processors"):
            tl.generate(tiny_model, prompt, beam)
        assert list(it) == want
    with get_plugin_manager().registered(_hooks(tinyloop_processors=[_Ban]), name="tp-ban"):
        it = tl.generate_iter(tiny_model, prompt, tl.GenerateConfig(max_tokens=3))
    assert list(it) == [5, 5, 5]
    _usable(tiny_model, prompt)


def test_unregistering_what_is_not_registered_is_a_plugin_error():
    pm = PluginManager(load_entrypoints=False)
    stranger = _hooks(tinyloop_decoders=[])
    with pytest.raises(tl.PluginError, match="not registered"):
        pm.unregister(stranger)
    with pytest.raises(tl.PluginError, match="'tp-nobody' is not registered"):
        pm.unregister(name="tp-nobody")
    # registered() tolerates a block that unregistered its plugin itself
    with pm.registered(stranger, name="tp-stranger"):
        pm.unregister(stranger)
    assert not pm.pm.has_plugin("tp-stranger")


def test_unregister_and_register_again(tiny_model, prompt, tp_module):
    pm = get_plugin_manager()
    cfg = tl.GenerateConfig(max_tokens=4, decoder="tp_shift", options={"shift": 1})
    pm.register(tp_module, name="tp-again")
    try:
        first = tl.generate(tiny_model, prompt, cfg)
        with pytest.raises(tl.PluginError, match="cannot be registered"):
            pm.register(tp_module, name="tp-again-twice")          # one module, one registration
    finally:
        pm.unregister(name="tp-again")
    with pytest.raises(tl.PluginError, match="decoder='tp_shift' is not registered"):
        tl.generate(tiny_model, prompt, cfg)
    with pm.registered(tp_module, name="tp-again"):
        assert tl.generate(tiny_model, prompt, cfg) == first
    # a built-in taken out and put back, by its pluggy name
    greedy = pm.pm.get_plugin("tinyloop.plugins.decoders.greedy")
    pm.unregister(name="tinyloop.plugins.decoders.greedy")
    try:
        with pytest.raises(tl.PluginError, match="0 decoders match"):
            tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=2))
    finally:
        pm.register(greedy, name="tinyloop.plugins.decoders.greedy")
    _usable(tiny_model, prompt)


class _Named:
    """Classes of every kind named like a built-in."""

    @staticmethod
    def all():
        class D(tl.Decoder):
            name = "greedy"

            def decode(self, session):
                yield 0

        class C(tl.CacheMode):
            name = "fp16"
            codec = "fp32"

        class K(tl.KVCodec):
            name = "int8"

        class P(tl.LogitProcessor):
            name = "repetition_penalty"

        class S(tl.Stopper):
            name = "eos"

        class E(ExitCriterion):
            name = "kl"
            compat = EXIT_ROW
            stat = "kl"

        class W(tl.SlotMapMode):
            name = "window"

        class B(tl.BackendEntry):
            name = "cpu"
            impl = "tinyloop.cpu.backend:CPUBackend"
        return {"tinyloop_decoders": D, "tinyloop_cache_modes": C, "tinyloop_kv_codecs": K,
                "tinyloop_processors": P, "tinyloop_stoppers": S, "tinyloop_exit_criteria": E,
                "tinyloop_slot_maps": W, "tinyloop_backends": B}


@pytest.mark.parametrize("hook", sorted(_Named.all()))
def test_a_name_colliding_with_a_built_in_is_a_plugin_error(tiny_model, prompt, allocs, hook):
    """Never a silent override: every request fails with a PluginError naming both plugins, before
    any work, until the plugin is unregistered."""
    cls = _Named.all()[hook]
    with get_plugin_manager().registered(_hooks(**{hook: [cls]}), name="tp-collide"):
        with pytest.raises(tl.PluginError, match=rf"two plugins register the \w+ name '{cls.name}': "
                                                 rf"(?=.*plugin 'tinyloop\.plugins\.)(?=.*plugin 'tp-collide')"):
            if hook == "tinyloop_backends":
                tl.load_model(str(tiny_model.path), max_seq_len=32, backend="cpu")
            else:
                tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=2))
    assert allocs.n == 0
    _usable(tiny_model, prompt)


# =========================================================================== entry points
def test_the_package_through_its_entry_point(tp_site, monkeypatch, tiny_model, prompt):
    """Installed, the package is found by a fresh manager (as in a new process) and serves every
    path; the process-wide manager rebuilt with it on sys.path does the same."""
    monkeypatch.syspath_prepend(str(tp_site))
    before = {n for n in sys.modules if n.startswith("tp_plugins")}
    try:
        pm = PluginManager()
        assert "tp_shift" in pm.decoders() and "tp_bf16" in pm.cache_modes() and "tp_bf16" in pm.kv_codecs()
        assert "tp_cosine" in pm.exit_criteria() and "tp_zero" in pm.stoppers()
        monkeypatch.setattr(plugins_mod, "_manager", pm)
        cfg = tl.GenerateConfig(max_tokens=5, decoder="tp_shift", options={"shift": 2}, cache_mode="tp_bf16")
        plain = tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=5, decoder="tp_shift",
                                                                  cache_mode="tp_bf16"))
        out = tl.generate(tiny_model, prompt, cfg)
        assert out != plain and len(out) == len(prompt) + 5
        assert list(tl.generate_iter(tiny_model, prompt, cfg)) == out[len(prompt):]
        assert tl.generate_stream(tiny_model, prompt, cfg, on_token=lambda t, p: True) == out
        assert tl.generate_batch(tiny_model, [prompt, prompt], cfg) == [out, out]
    finally:
        for name in [n for n in sys.modules if n.startswith("tp_plugins") and n not in before]:
            del sys.modules[name]


def test_two_packages_with_one_entry_point_name_are_a_plugin_error(tmp_path, monkeypatch):
    """Two installed packages declaring the same entry-point name: the second must not be dropped
    silently (its plugins would just be missing)."""
    for i in (1, 2):
        src = {"plugin.py": f'''
            import tinyloop as tl

            class C(tl.CacheMode):
                name = "tp_dup{i}"
                codec = "fp16"

            @tl.hookimpl
            def tinyloop_cache_modes():
                return [C]
        '''}
        _write_dist(tmp_path / f"site{i}", f"tp_dup{i}", src, f"tp-same = tp_dup{i}.plugin")
        monkeypatch.syspath_prepend(str(tmp_path / f"site{i}"))
    with pytest.raises(tl.PluginError, match=r"entry point 'tp-same'.*tp_dup\d\.plugin.*tp_dup\d\.plugin"):
        PluginManager()


def test_an_entry_point_named_like_a_built_in_module_is_a_plugin_error(tmp_path, monkeypatch):
    src = {"plugin.py": "import tinyloop as tl\n"}
    _write_dist(tmp_path, "tp_shadow", src, "tinyloop.plugins.decoders.greedy = tp_shadow.plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(tl.PluginError, match=r"entry point 'tinyloop.plugins.decoders.greedy'.*built-in"):
        PluginManager()


def test_run_config_in_a_new_process_through_the_entry_point(tp_site, byte_model, tmp_path, tp_module):
    """`python -m tinyloop run cfg.yaml` with the package installed: the decoder with its option, the
    codec, the cache mode, the exit criterion and the stopper all come from the entry point; the
    tokens are those of the same plugins registered by hand in this process."""
    m, path = byte_model
    gen = {"max_tokens": 6, "decoder": "tp_shift", "options": {"shift": 3}, "cache_mode": "tp_bf16",
           "early_exit_patience": 1, "early_exit_min_L": 1, "early_exit_criterion": "tp_cosine",
           "early_exit_threshold": 0.05}
    cfg = {"model": str(path), "backend": "cpu", "max_seq_len": 96, "prompts": ["ab", "xyz"], "stream": False,
           "output_jsonl": str(tmp_path / "o.jsonl"), "generate": gen}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tp_site), str(ROOT)])}
    r = subprocess.run([sys.executable, "-m", "tinyloop", "run", str(tmp_path / "c.yaml")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    with get_plugin_manager().registered(tp_module, name="tp-hand"):
        for rec in recs:
            st = tl.GenerateStats()
            out = tl.generate(m, rec["prompt_ids"], tl.GenerateConfig(**gen), stats=st)
            assert rec["output_ids"] == out[len(rec["prompt_ids"]):]
            assert rec["stats"]["decoder"] == "tp_shift" and rec["stats"]["token_loops"] == st.token_loops


# =========================================================================== decoders
def test_decoder_options_on_every_path(tp, byte_model, tmp_path):
    """The decoder's option changes the tokens identically on every path (none ignores it)."""
    m, path = byte_model
    ids = [97, 98, 99]
    cfg = tl.GenerateConfig(max_tokens=5, decoder="tp_shift", options={"shift": 7})
    base = tl.generate(m, ids, tl.GenerateConfig(max_tokens=5, decoder="tp_shift"))
    assert base == tl.generate(m, ids, tl.GenerateConfig(max_tokens=5))             # shift 0 is greedy
    out = tl.generate(m, ids, cfg)
    assert out != base
    assert list(tl.generate_iter(m, ids, cfg)) == out[3:]
    assert tl.generate_stream(m, ids, cfg, on_token=lambda t, p: True) == out
    assert tl.generate(m, ids, cfg.replace(options=tp.ShiftOptions(shift=7))) == out
    assert tl.generate_text(m, ids, cfg) == m.tokenizer.decode(out[3:])
    stats = []
    assert tl.generate_batch(m, [ids, ids[:2]], cfg, stats=stats)[0] == out
    assert stats[0].batch_lanes == 2 and stats[0].decoder == "tp_shift"
    pc = tl.build_prefix_cache(m, ids[:2])
    try:
        assert tl.generate_from_prefix_cache(m, pc, ids[2:], cfg) == out
    finally:
        tl.free_prefix_cache(pc)
    # YAML, in this process (the registered module)
    from tinyloop.cli.main import main
    run = {"model": str(path), "backend": "cpu", "max_seq_len": 96, "prompts": ["abc"], "stream": False,
           "output_jsonl": str(tmp_path / "o.jsonl"), "generate": {"max_tokens": 5, "decoder": "tp_shift",
                                                                   "options": {"shift": 7}}}
    for mode in ("generate", "batch"):
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({**run, "mode": mode}))
        assert main(["run", str(tmp_path / "c.yaml")]) == 0
        rec = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])
        assert rec["output_ids"] == tl.generate(m, m.tokenizer.encode("abc"), cfg)[3:]
    with pytest.raises(tl.ConfigError, match=r"shift=-1 is outside"):
        tl.generate(m, ids, cfg.replace(options={"shift": -1}))
    with pytest.raises(tl.ConfigError, match="unknown key 'shfit'"):
        tl.generate(m, ids, cfg.replace(options={"shfit": 1}))
    with pytest.raises(tl.IncompatibleModesError, match="temperature"):
        tl.generate(m, ids, cfg.replace(temperature=0.7))


def test_server_request_options_reach_the_plugins(tp, byte_model):
    """The server's extra body fields `decoder`, `options` and `cache_mode` select the plugins; a bad
    option is a 400 naming it, before anything is queued."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient
    from tinyloop.serve import ServeConfig, create_app
    m, path = byte_model
    app = create_app(ServeConfig(backend="cpu", max_seq_len=96), model=m)
    body = {"model": Path(path).stem, "prompt": [97, 98], "max_tokens": 4, "temperature": 0}
    try:
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={**body, "decoder": "tp_shift", "options": {"shift": 5},
                                                     "cache_mode": "tp_bf16"})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            want = tl.generate(m, [97, 98], tl.GenerateConfig(max_tokens=4, decoder="tp_shift",
                                                              options={"shift": 5}, cache_mode="tp_bf16"))
            assert choice["tinyloop"]["decoder"] == "tp_shift" and choice["text"] == m.tokenizer.decode(want[2:])
            r = client.post("/v1/completions", json={**body, "decoder": "tp_shift", "options": {"shift": 5000}})
            assert r.status_code == 400 and "shift=5000" in r.text
    finally:
        app.state.served.close()


class _BoomDecoder(tl.Decoder):
    name = "tp_boomdec"
    lockstep = True

    def decode(self, session):
        session.start()
        tok = session.greedy()
        yield tok
        session.advance(tok)
        raise ValueError("dec boom")

    def pick(self, lane):
        raise ValueError("pick boom")


@pytest.mark.parametrize("entry", ["generate", "iter", "batch"])
def test_a_decoder_raising_mid_decode_is_a_plugin_error_naming_it(tiny_model, prompt, entry):
    cfg = tl.GenerateConfig(max_tokens=5, decoder="tp_boomdec")
    with get_plugin_manager().registered(_hooks(tinyloop_decoders=[_BoomDecoder]), name="tp-boomdec"):
        with pytest.raises(tl.PluginError, match=r"decoder 'tp_boomdec'.*ValueError: (dec|pick) boom") as info:
            if entry == "generate":
                tl.generate(tiny_model, prompt, cfg)
            elif entry == "iter":
                list(tl.generate_iter(tiny_model, prompt, cfg))
            else:
                tl.generate_batch(tiny_model, [prompt, prompt], cfg)
        assert isinstance(info.value.__cause__, ValueError)
    _usable(tiny_model, prompt)


# =========================================================================== logit processors
class _Recorder(tl.LogitProcessor):
    """The identity, recording how its hooks are called."""
    name = "tp_identity"
    stage = tl.Stage.MASK
    log: list = []

    @classmethod
    def from_config(cls, config):
        return cls()

    def prepare(self, model):
        self.log.append(("prepare", model))

    def reset(self, prompt):
        self.log.append(("reset", list(prompt)))

    def apply(self, logits):
        self.log.append(("apply", logits.dtype, logits.shape))

    def accept(self, token):
        self.log.append(("accept", token))

    def clone(self):
        return _Recorder()


def test_processor_hooks_are_called_as_documented(tiny_model, prompt):
    _Recorder.log = log = []
    with get_plugin_manager().registered(_hooks(tinyloop_processors=[_Recorder]), name="tp-rec"):
        out = tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=4))[len(prompt):]
        assert [e for e in log if e[0] == "prepare"] == [("prepare", tiny_model)] * 2      # validation + request
        assert [e for e in log if e[0] == "reset"] == [("reset", prompt)]
        assert [e[1] for e in log if e[0] == "accept"] == out
        assert {e[1:] for e in log if e[0] == "apply"} == {(np.dtype(np.float32), (tiny_model.vocab_size,))}
        log.clear()
        pc = tl.build_prefix_cache(tiny_model, prompt[:6])
        try:
            got = tl.generate_from_prefix_cache(tiny_model, pc, prompt[6:], tl.GenerateConfig(max_tokens=4))
        finally:
            tl.free_prefix_cache(pc)
        assert got[len(prompt):] == out and [e for e in log if e[0] == "reset"] == [("reset", prompt)]


class _BoomProc(tl.LogitProcessor):
    name = "tp_boomproc"

    @classmethod
    def from_config(cls, config):
        return cls()

    def __init__(self):
        self.n = 0

    def apply(self, logits):
        self.n += 1
        if self.n == 3:
            raise ZeroDivisionError("proc boom")


class _CopyProc(tl.LogitProcessor):
    """Returns a modified copy instead of changing the row in place (a common mistake)."""
    name = "tp_copyproc"

    @classmethod
    def from_config(cls, config):
        return cls()

    def apply(self, logits):
        out = np.full_like(logits, -np.inf)
        out[5] = 0.0
        return out


class _MaskWords(tl.LogitProcessor):
    """A mask whose allowed_words() is not the documented int32 words."""
    name = "tp_badmask"
    stage = tl.Stage.MASK
    mask_only = True

    @classmethod
    def from_config(cls, config):
        return cls()

    def apply(self, logits):
        logits[50:] = -np.inf

    def allowed_words(self):
        return np.arange(97) < 50


@pytest.mark.parametrize("cls, why, entry", [
    (_BoomProc, r"processor 'tp_boomproc'.*ZeroDivisionError: proc boom", "generate"),
    (_BoomProc, r"processor 'tp_boomproc'.*ZeroDivisionError: proc boom", "batch"),
    (_CopyProc, r"processor 'tp_copyproc'.*apply.*returned.*in place", "generate"),
    (_CopyProc, r"processor 'tp_copyproc'.*apply.*returned.*in place", "batch"),
    # greedy steps on a backend with token masks read allowed_words() (lockstep lanes read the row)
    (_MaskWords, r"processor 'tp_badmask'.*allowed_words.*int32", "generate"),
], ids=["raises", "raises-batch", "returns-a-copy", "returns-a-copy-batch", "mask-words"])
def test_a_processor_misbehaving_mid_decode_is_a_plugin_error_naming_it(tiny_model, prompt, cls, why, entry):
    cfg = tl.GenerateConfig(max_tokens=5)
    with get_plugin_manager().registered(_hooks(tinyloop_processors=[cls]), name="tp-proc"):
        with pytest.raises(tl.PluginError, match=why):
            if entry == "generate":
                tl.generate(tiny_model, prompt, cfg)
            else:
                tl.generate_batch(tiny_model, [prompt, prompt[:4]], cfg)
    _usable(tiny_model, prompt)


# =========================================================================== stoppers
class _BoomStop(tl.Stopper):
    name = "tp_boomstop"

    @classmethod
    def from_config(cls, config, model_config):
        return cls()

    def check(self, output_tokens):
        if len(output_tokens) == 2:
            raise KeyError("stop boom")


def test_a_stopper_with_its_own_reason_on_every_path(tp, tiny_model, prompt):
    """The package's stopper ends sequences at token 0 with TP_ZERO: generate, streams, lockstep
    lanes and beams (clones of it) agree."""
    p = [5, 9, 33]
    cfg = tl.GenerateConfig(max_tokens=12, decoder="tp_shift", options={"shift": 0})
    # shift the argmax so that some step lands on 0: the first k whose output holds a 0
    for k in range(tiny_model.vocab_size):
        st = tl.GenerateStats()
        out = tl.generate(tiny_model, p, cfg.replace(options={"shift": k}), stats=st)
        if st.stop_reason == "TP_ZERO":
            break
    else:                                       # pragma: no cover
        pytest.fail("no shift reaches token 0")
    cfg = cfg.replace(options={"shift": k})
    assert out[-1] == 0 and 0 not in out[len(p):-1]
    assert list(tl.generate_iter(tiny_model, p, cfg)) == out[len(p):]
    stats = []
    assert tl.generate_batch(tiny_model, [p, p], cfg, stats=stats) == [out, out]
    assert [s.stop_reason for s in stats] == ["TP_ZERO", "TP_ZERO"]
    st = tl.GenerateStats()
    beam = tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=6, beam_size=3), stats=st)
    assert 0 not in beam[len(prompt):-1]


def test_a_stopper_raising_mid_decode_is_a_plugin_error_naming_it(tiny_model, prompt):
    with get_plugin_manager().registered(_hooks(tinyloop_stoppers=[_BoomStop]), name="tp-boomstop"):
        for call in (lambda: tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=5)),
                     lambda: tl.generate_batch(tiny_model, [prompt, prompt], tl.GenerateConfig(max_tokens=5)),
                     lambda: tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=5, beam_size=2))):
            with pytest.raises(tl.PluginError, match=r"stopper 'tp_boomstop'.*KeyError"):
                call()
            assert tiny_model._live_cache_bytes == 0 and not tiny_model._lock.locked()
        # a consumer's own callback is not a plugin: its error is its own
        def on_token(tok, pos):
            raise OSError("consumer")
        with pytest.raises(OSError, match="consumer"):
            tl.generate_stream(tiny_model, prompt, tl.GenerateConfig(max_tokens=1), on_token=on_token)
    _usable(tiny_model, prompt)


# =========================================================================== exit criteria
class _HostL2(ExitCriterion):
    name = "tp_host_l2"
    compat = EXIT_ROW
    default_threshold = 0.1

    def statistic(self, cur, prev):
        return rel_l2(cur, prev)


class _HostKL(ExitCriterion):
    name = "tp_host_kl"
    compat = EXIT_ROW
    reads = "logits"
    default_threshold = 0.01

    def statistic(self, cur, prev):
        return kl(cur, prev)


class _HostMargin(ExitCriterion):
    name = "tp_host_margin"
    compat = EXIT_ROW
    reads = "logits"
    needs_previous = False
    default_threshold = 3.0

    def statistic(self, cur, prev):
        return top2_margin(cur)

    def stable(self, value):
        return value >= self.threshold


HOST = _hooks(tinyloop_exit_criteria=[_HostL2, _HostKL, _HostMargin])


@pytest.mark.parametrize("mine, theirs", [("tp_host_l2", "hidden_l2"), ("tp_host_kl", "kl"),
                                          ("tp_host_margin", "logit_margin")])
@pytest.mark.parametrize("kv", ["copy_last", "recompute"])
def test_a_host_criterion_equals_the_built_in_it_reimplements(tiny_model, prompt, mine, theirs, kv):
    """A criterion with its own statistic (probed on the host) and the built-in computing the same
    statistic where the state lives exit at the same depths with the same tokens."""
    def run(name):
        thr = {"hidden_l2": 0.3, "tp_host_l2": 0.3, "kl": 0.05, "tp_host_kl": 0.05, "tp_host_margin": 2.0}
        kw = dict(early_exit_logit_margin=2.0) if name == "logit_margin" else dict(early_exit_threshold=thr[name])
        st = tl.GenerateStats()
        out = tl.generate(tiny_model, prompt, tl.GenerateConfig(
            max_tokens=8, loops=7, early_exit_patience=1, early_exit_min_L=1, early_exit_criterion=name,
            early_exit_kv=kv, **kw), stats=st)
        return out, st.token_loops, st.exit_probes
    with get_plugin_manager().registered(HOST, name="tp-host"):
        got = run(mine)
        assert got == run(theirs)
    assert min(got[1]) < 7                       # it did exit early somewhere


def test_the_docs_cosine_criterion_on_every_path(tp, tiny_model, prompt):
    cfg = tl.GenerateConfig(max_tokens=6, loops=6, early_exit_patience=1, early_exit_min_L=1,
                            early_exit_criterion="tp_cosine", early_exit_threshold=0.05)
    st = tl.GenerateStats()
    out = tl.generate(tiny_model, prompt, cfg, stats=st)
    st2 = tl.GenerateStats()
    assert list(tl.generate_iter(tiny_model, prompt, cfg, stats=st2)) == out[len(prompt):]
    assert st2.token_loops == st.token_loops and len(st.token_loops) == 6
    pc = tl.build_prefix_cache(tiny_model, prompt[:7], loops=6)
    try:
        st3 = tl.GenerateStats()
        assert tl.generate_from_prefix_cache(tiny_model, pc, prompt[7:], cfg, stats=st3) == out
        assert st3.token_loops == st.token_loops
    finally:
        tl.free_prefix_cache(pc)
    with pytest.raises(tl.IncompatibleModesError, match="early_exit .* rejected in batched"):
        tl.generate_batch(tiny_model, [prompt], cfg)
    handle = tl.build_resume_handle(tiny_model, prompt, 2)
    try:
        with pytest.raises(tl.IncompatibleModesError, match="early_exit .* rejected in warm_start"):
            tl.resume_generate(handle, 6, cfg.replace(loops=None))
    finally:
        tl.free_resume_handle(handle)
    _usable(tiny_model, prompt)


class _NoThreshold(ExitCriterion):
    """Takes no threshold (default_threshold None) and has its own statistic, but no stable()."""
    name = "tp_nothreshold"
    compat = EXIT_ROW

    def statistic(self, cur, prev):
        return 0.0


def test_a_criterion_without_threshold_nor_stable_is_refused_before_work(tiny_model, prompt, allocs):
    cfg = tl.GenerateConfig(max_tokens=3, early_exit_patience=1, early_exit_criterion="tp_nothreshold")
    with get_plugin_manager().registered(_hooks(tinyloop_exit_criteria=[_NoThreshold]), name="tp-nothr"):
        with pytest.raises(tl.PluginError, match=r"plugin 'tp-nothr'.*tp_nothreshold.*stable"):
            tl.generate(tiny_model, prompt, cfg)
    assert allocs.n == 0


def test_bind_begin_token_and_statistic_arguments(tiny_model, prompt):
    """bind(model, config) once per request; begin_token() before each decoded token's probes;
    statistic(cur, prev) with float64 rows, prev None where needs_previous is False."""
    calls = []

    class Spy(ExitCriterion):
        name = "tp_spy"
        compat = EXIT_ROW
        needs_previous = False
        default_threshold = 0.5

        def bind(self, model, config):
            calls.append(("bind", model, config.early_exit_criterion))

        def begin_token(self):
            calls.append(("begin",))

        def statistic(self, cur, prev):
            calls.append(("stat", cur.dtype, cur.shape, prev))
            return 1.0                                      # never stable: every probe is taken
    cfg = tl.GenerateConfig(max_tokens=3, loops=5, early_exit_patience=1, early_exit_min_L=2,
                            early_exit_criterion="tp_spy")
    with get_plugin_manager().registered(_hooks(tinyloop_exit_criteria=[Spy]), name="tp-spy"):
        tl.generate(tiny_model, prompt, cfg)
    assert [c for c in calls if c[0] == "bind"] == [("bind", tiny_model, "tp_spy")]
    assert sum(c[0] == "begin" for c in calls) == 2         # the first token comes from the prefill
    stats = [c for c in calls if c[0] == "stat"]
    assert len(stats) == 2 * 3                              # probes at depths 2, 3, 4 of loops 5
    assert all(c[1] == np.float64 and c[2] == (tiny_model.cfg.d_model,) for c in stats)
    assert [c[3] for c in stats] == [None] * 6             # needs_previous False: no previous probe


class _StatNone(ExitCriterion):
    name = "tp_statnone"
    compat = EXIT_ROW
    default_threshold = 0.1

    def statistic(self, cur, prev):
        return None


class _StableNone(_HostL2):
    name = "tp_stablenone"

    def stable(self, value):
        return None


class _StatBoom(_HostL2):
    name = "tp_statboom"

    def statistic(self, cur, prev):
        raise RuntimeError("exit boom")


@pytest.mark.parametrize("cls, why", [
    (_StatNone, r"statistic\(\) returned None"),
    (_StableNone, r"stable\(\) returned None"),
    (_StatBoom, r"RuntimeError: exit boom"),
], ids=["statistic-none", "stable-none", "raises"])
def test_an_exit_criterion_misbehaving_mid_decode_is_a_plugin_error_naming_it(tiny_model, prompt, cls, why):
    cfg = tl.GenerateConfig(max_tokens=3, early_exit_patience=1, early_exit_min_L=1, early_exit_criterion=cls.name)
    with get_plugin_manager().registered(_hooks(tinyloop_exit_criteria=[cls]), name="tp-exit"):
        with pytest.raises(tl.PluginError, match=rf"exit criterion '{cls.name}'.*{why}"):
            tl.generate(tiny_model, prompt, cfg)
    _usable(tiny_model, prompt)


# =========================================================================== cache modes and compat.yaml
class _MyFP16(tl.CacheMode):
    """An alias of the built-in fp16 storage: every path must give fp16's tokens."""
    name = "tp_fp16"
    codec = "fp16"


class _Mixed(tl.CacheMode):
    """The docs' group_codec: bf16 for the loop layers, fp32 for the others."""
    name = "tp_mixed"
    codec = "fp32"

    @classmethod
    def group_codec(cls, group):
        return "tp_bf16" if group == "loop" else "fp32"


def test_a_cache_mode_on_every_path(tp, tiny_model, prompt):
    with get_plugin_manager().registered(_hooks(tinyloop_cache_modes=[_MyFP16, _Mixed]), name="tp-modes"):
        for mine, ref in (("tp_fp16", "fp16"), ("tp_mixed", None)):
            cfg = tl.GenerateConfig(max_tokens=6, loops=3, cache_mode=mine)
            out = tl.generate(tiny_model, prompt, cfg)
            if ref is not None:
                assert out == tl.generate(tiny_model, prompt, cfg.replace(cache_mode=ref))
            assert tl.generate_batch(tiny_model, [prompt, prompt[:5]], cfg)[0] == out
            assert list(tl.generate_iter(tiny_model, prompt, cfg)) == out[len(prompt):]
            spec = tl.SpeculativeConfig(max_tokens=6, draft_loops=1, verify_loops=3, cache_mode=mine)
            assert tl.generate_speculative(tiny_model, prompt, spec) == out
            tree = tl.TreeSpeculativeConfig(max_tokens=6, draft_loops=1, verify_loops=3, cache_mode=mine)
            assert tl.generate_tree_speculative(tiny_model, prompt, tree) == out
            pc = tl.build_prefix_cache(tiny_model, prompt[:6], loops=3, cache_mode=mine)
            try:
                assert tl.generate_from_prefix_cache(tiny_model, pc, prompt[6:], cfg) == out
            finally:
                tl.free_prefix_cache(pc)
            assert tl.score(tiny_model, prompt, loops=3, cache_mode=mine).shape == (len(prompt), 97)
    _usable(tiny_model, prompt)


ROW = """
  tp_fp16_cache:
    status: implemented
    when: [cache_mode, "==", tp_fp16]
    cells: {single: ok, batched: rejected, speculative: rejected, tree_speculative: partial, prefix_reuse: rejected, warm_start: ok}
"""
PAIR = """
  - modes: [tp_fp16_cache, sampling]
    reason: "tp_fp16 is for greedy decoding only"
"""


class _RowFP16(_MyFP16):
    mode = "tp_fp16_cache"
    compat = {"single": "ok", "batched": "rejected", "speculative": "rejected", "tree_speculative": "partial",
              "prefix_reuse": "rejected", "warm_start": "ok"}


@pytest.fixture
def own_matrix(tmp_path, monkeypatch):
    """compat.yaml with a row (and a pair) for the new mode, as TINYLOOP_COMPAT."""
    text = (ROOT / "configs" / "compat.yaml").read_text(encoding="utf-8")
    text = text.replace("\npairs:\n", "\n" + ROW + "\npairs:\n" + PAIR)
    path = tmp_path / "compat.yaml"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setenv("TINYLOOP_COMPAT", str(path))
    return path


def test_a_new_mode_row_is_enforced_everywhere(own_matrix, tiny_model, prompt, allocs):
    cfg = tl.GenerateConfig(max_tokens=4, loops=3, cache_mode="tp_fp16")
    with get_plugin_manager().registered(_hooks(tinyloop_cache_modes=[_RowFP16]), name="tp-row"):
        out = tl.generate(tiny_model, prompt, cfg)
        assert out == tl.generate(tiny_model, prompt, cfg.replace(cache_mode="fp16"))
        n = allocs.n
        refusals = [
            (lambda: tl.generate_batch(tiny_model, [prompt], cfg), r"tp_fp16_cache .* rejected in batched"),
            (lambda: tl.generate_speculative(tiny_model, prompt, tl.SpeculativeConfig(
                max_tokens=4, draft_loops=1, verify_loops=3, cache_mode="tp_fp16")), "rejected in speculative"),
            (lambda: tl.build_prefix_cache(tiny_model, prompt[:4], loops=3, cache_mode="tp_fp16"),
             "rejected in prefix_reuse"),
            (lambda: tl.generate(tiny_model, prompt, cfg.replace(temperature=0.5)),
             "tp_fp16 is for greedy decoding only"),
        ]
        for call, why in refusals:
            with pytest.raises(tl.IncompatibleModesError, match=why):
                call()
        assert allocs.n == n                      # refused before any work
        with pytest.warns(CompatWarning, match="tp_fp16_cache in tree_speculative decoding is partial"):
            tree = tl.generate_tree_speculative(tiny_model, prompt, tl.TreeSpeculativeConfig(
                max_tokens=4, draft_loops=1, verify_loops=3, cache_mode="tp_fp16"))
        assert tree == out
        handle = tl.build_resume_handle(tiny_model, prompt, 2, tl.GenerateConfig(cache_mode="tp_fp16"))
        try:
            assert tl.resume_generate(handle, 3, tl.GenerateConfig(max_tokens=4, cache_mode="tp_fp16")) == out
        finally:
            tl.free_resume_handle(handle)
    _usable(tiny_model, prompt)


def test_a_mode_row_the_matrix_lacks_is_a_plugin_error(tiny_model, prompt, allocs):
    with get_plugin_manager().registered(_hooks(tinyloop_cache_modes=[_RowFP16]), name="tp-row"):
        with pytest.raises(tl.PluginError, match=r"plugin 'tp-row'.*'tp_fp16_cache', which is not a row"):
            tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=2, cache_mode="tp_fp16"))
    assert allocs.n == 0


# =========================================================================== composition, as a property
class _Argmax(tl.Decoder):
    """A greedy-equivalent third-party decoder (argmax of the processed logits, lockstep)."""
    name = "tp_argmax"
    adaptive_depth = True
    lockstep = True

    def decode(self, session):
        session.start()
        while True:
            tok = int(np.argmax(session.logits()))
            yield tok
            session.advance(tok)

    def pick(self, lane):
        return int(np.argmax(lane.logits()))


class _Identity(tl.LogitProcessor):
    name = "tp_id"

    @classmethod
    def from_config(cls, config):
        return cls()

    def apply(self, logits):
        logits += 0.0

    def clone(self):
        return _Identity()


KNOBS = st.fixed_dictionaries({
    "entry": st.sampled_from(["generate", "iter", "stream", "batch"]),
    "decoder": st.sampled_from([None, "tp_argmax"]),
    "cache_mode": st.sampled_from(["fp16", "tp_fp16", "int8"]),
    "identity": st.booleans(),
    "temperature": st.sampled_from([0.0, 0.8]),
    "repetition_penalty": st.sampled_from([1.0, 1.0, 1.3]),
    "beam_size": st.sampled_from([0, 0, 0, 2]),
    "cache_window": st.sampled_from([0, 0, 0, 6]),
    "exit": st.sampled_from(["", "", "tp_host_l2", "hidden_l2"]),
})


def _run_entry(model, entry, prompt, cfg):
    if entry == "generate":
        return tl.generate(model, prompt, cfg)
    if entry == "iter":
        it = tl.generate_iter(model, prompt, cfg)
        return prompt + list(it)
    if entry == "stream":
        return tl.generate_stream(model, prompt, cfg, on_token=lambda t, p: True)
    return tl.generate_batch(model, [prompt, prompt[:4]], cfg)[0]


def _attempt(model, entry, prompt, cfg, allocs):
    """(tokens, None) or (None, error); an error must be typed and come before any allocation."""
    before = allocs.n
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompatWarning)
            return _run_entry(model, entry, prompt, cfg), None
    except tl.TinyLoopError as exc:
        assert allocs.n == before, f"{type(exc).__name__} after work: {exc}"
        assert model._live_cache_bytes == 0 and not model._lock.locked()
        return None, exc


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=KNOBS)
def test_third_party_plugins_compose_like_their_built_in_twins(tiny_model, prompt, allocs, k):
    """Random combinations with third-party plugins (an argmax decoder, a cache mode aliasing fp16,
    an identity processor, a host exit criterion re-implementing hidden_l2): each request is a
    typed error before any work, or gives the tokens of the same request with the built-in twins
    (no processor, greedy, fp16, hidden_l2); a request the twins refuse is refused too."""
    fields = dict(max_tokens=4, loops=4, cache_mode=k["cache_mode"], temperature=k["temperature"],
                  repetition_penalty=k["repetition_penalty"], beam_size=k["beam_size"],
                  cache_window=k["cache_window"], decoder=k["decoder"])
    if k["temperature"]:
        fields["sample_seed"] = 11
    if k["exit"]:
        fields.update(early_exit_patience=1, early_exit_min_L=1, early_exit_criterion=k["exit"],
                      early_exit_threshold=0.3)
    twin = dict(fields, decoder=None, cache_mode={"tp_fp16": "fp16"}.get(k["cache_mode"], k["cache_mode"]))
    if k["exit"]:
        twin["early_exit_criterion"] = "hidden_l2"
    try:
        cfg, ref_cfg = tl.GenerateConfig(**fields), tl.GenerateConfig(**twin)
    except tl.ConfigError:
        return
    pm = get_plugin_manager()
    ref, ref_err = _attempt(tiny_model, k["entry"], prompt, ref_cfg, allocs)
    extra = _hooks(tinyloop_decoders=[_Argmax], tinyloop_cache_modes=[_MyFP16],
                   tinyloop_exit_criteria=[_HostL2], tinyloop_processors=[_Identity] if k["identity"] else [])
    with pm.registered(extra, name="tp-compose"):
        got, err = _attempt(tiny_model, k["entry"], prompt, cfg, allocs)
    if ref_err is not None:
        assert err is not None, f"the twins are refused ({ref_err}) but the plugins ran"
    if err is None:
        assert got == ref
