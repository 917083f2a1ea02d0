"""Review of the commits after 5b99a73 (plugin snapshot and mid-decode PluginError wrapping): what
a user met before those commits and meets differently now.

* A decoder's ``decode(session)`` / ``pick(lane)`` drives the engine: an error raised below it by
  tinyloop itself (a MemoryError of a forward, a backend failure) is not the decoder's and must
  come out as it did before (the server answers it as its own 500, not as the client's 400);
  only what the decoder's own code raises is a PluginError naming it.
* A request keeps the plugins it was validated with (docs/PLUGINS.md): a KV codec unregistered
  between validation (generate_iter's call) and decoding (its read) must not fail the request
  with a bare KeyError when its cache is allocated.
"""

from __future__ import annotations

import pytest

import tinyloop as tl
from tinyloop.runtime import lockstep
from tinyloop.runtime.plugins import get_plugin_manager

from test_plugin_authoring_edges import tp_module, tp_site  # noqa: F401  (fixtures)


def _oom(*args, **kwargs):
    raise MemoryError("out of host memory (simulated)")


# =========================================================================== engine errors are not plugin errors
@pytest.mark.parametrize("entry", ["generate", "iter", "stream", "sampling"])
def test_an_engine_error_under_a_built_in_decoder_is_not_a_plugin_error(tiny_model, prompt, monkeypatch, entry):
    """Before 5b99a73..HEAD a MemoryError in a forward came out as MemoryError; the wrapping of
    decode(session) turned it into PluginError("decoder 'greedy': ...") (a 400 on the server)."""
    monkeypatch.setattr(tiny_model.fwd, "prefix", _oom)
    cfg = tl.GenerateConfig(max_tokens=3)
    with pytest.raises(MemoryError, match="simulated"):
        if entry == "generate":
            tl.generate(tiny_model, prompt, cfg)
        elif entry == "iter":
            list(tl.generate_iter(tiny_model, prompt, cfg))
        elif entry == "stream":
            tl.generate_stream(tiny_model, prompt, cfg, on_token=lambda t, p: True)
        else:
            tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=3, temperature=1.0, sample_seed=3))
    monkeypatch.undo()
    assert tiny_model._live_cache_bytes == 0 and not tiny_model._lock.locked()
    assert len(tl.generate(tiny_model, prompt, cfg)) == len(prompt) + 3


def test_an_engine_error_under_a_lockstep_pick_is_not_a_plugin_error(tiny_model, prompt, monkeypatch):
    """The same for generate_batch: a sampling lane's pick reads the logits through the engine."""
    monkeypatch.setattr(lockstep.LockstepBatch, "host_logits", _oom)
    with pytest.raises(MemoryError, match="simulated"):
        tl.generate_batch(tiny_model, [prompt, prompt[:5]],
                          tl.GenerateConfig(max_tokens=3, temperature=1.0, sample_seed=3))
    monkeypatch.undo()
    assert tiny_model._live_cache_bytes == 0 and not tiny_model._lock.locked()


def test_the_servers_answer_to_an_engine_error_is_a_500_not_a_400(tiny_model, prompt, monkeypatch):
    from tinyloop.serve.app import _failed
    monkeypatch.setattr(tiny_model.fwd, "prefix", _oom)
    with pytest.raises(MemoryError) as info:
        tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=2))
    assert _failed(info.value, 1).status_code == 500


def test_a_third_party_decoders_own_error_is_still_a_plugin_error(tiny_model, prompt):
    class Boom(tl.Decoder):
        name = "rv11_boom"
        lockstep = True

        def decode(self, session):
            session.start()
            raise ValueError("boom")
            yield 0

        def pick(self, lane):
            return {}["missing"]

    class Hooks:
        @tl.hookimpl
        def tinyloop_decoders(self):
            return [Boom]

    cfg = tl.GenerateConfig(max_tokens=3, decoder="rv11_boom")
    with get_plugin_manager().registered(Hooks(), name="rv11-boom"):
        with pytest.raises(tl.PluginError, match=r"decoder 'rv11_boom'.*ValueError: boom"):
            tl.generate(tiny_model, prompt, cfg)
        with pytest.raises(tl.PluginError, match=r"decoder 'rv11_boom'.*KeyError"):
            tl.generate_batch(tiny_model, [prompt, prompt], cfg)
    assert tiny_model._live_cache_bytes == 0 and not tiny_model._lock.locked()


# =========================================================================== the snapshot covers KV codecs
def test_a_codec_unregistered_after_validation_still_serves_the_request(tiny_model, prompt, tp_module):  # noqa: F811
    cfg = tl.GenerateConfig(max_tokens=3, cache_mode="tp_bf16")
    pm = get_plugin_manager()
    with pm.registered(tp_module, name="rv11-tp"):
        want = tl.generate(tiny_model, prompt, cfg)[len(prompt):]
        it = tl.generate_iter(tiny_model, prompt, cfg)
        batch = tl.generate_iter(tiny_model, prompt, cfg)
    assert list(it) == want
    assert list(batch) == want
    # a request validated after the unregister is refused before any work
    with pytest.raises(tl.PluginError, match="tp_bf16"):
        tl.generate(tiny_model, prompt, cfg)
    assert tiny_model._live_cache_bytes == 0 and not tiny_model._lock.locked()


# =========================================================================== guards (passed before the fixes)
def test_a_hook_calling_back_into_the_manager_during_a_build_does_not_deadlock(tiny_model, prompt):
    """The registry lock is held while hooks run: a hook that reads another registry (same thread)
    must not block on it, also when a request takes its snapshot."""
    import threading
    pm = get_plugin_manager()

    class Hooks:
        @tl.hookimpl
        def tinyloop_stoppers(self):
            assert "greedy" in get_plugin_manager().decoders()
            return []

    out = []
    with pm.registered(Hooks(), name="rv11-reentrant"):
        t = threading.Thread(target=lambda: out.append(tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=2))),
                             daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "deadlock: the hook's call back into the plugin manager never returned"
    assert len(out[0]) == len(prompt) + 2


def test_one_package_listed_twice_with_the_same_entry_point_loads(monkeypatch):
    """An environment that lists the same entry point twice (an editable install and a copy) is
    not a conflict: the values are equal."""
    import importlib.metadata as md
    from tinyloop.runtime.plugins import ENTRY_POINT_GROUP, PluginManager
    ep = md.EntryPoint(name="rv11_dup", value="tinyloop.plugins.decoders.greedy", group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(md, "entry_points", lambda **kw: [ep, ep])
    PluginManager()
