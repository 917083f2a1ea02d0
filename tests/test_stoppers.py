"""Stoppers: EOS, stop sequences, max_tokens, callback abort and plugins' own rules through one
interface, in every decode path (plain, streamed, batched, beam, speculative, tree); a processor
that ends a request with its own reason; order and typed errors."""

from __future__ import annotations

import pytest

import tinyloop as tl
from tinyloop import GenerateConfig, GenerateStats, StopReason
from tinyloop.runtime.plugins import DEFAULT_PLUGINS, PluginManager, get_plugin_manager

SAW = StopReason("SAW_TOKEN")


def stop_after(token: int, reason: StopReason = SAW, bound: bool = True):
    """An inline stopper plugin: ends the request right after `token` with `reason`."""

    class AfterToken(tl.Stopper):
        name = "test_after_token"
        ending_tokens = 1 if bound else None

        @classmethod
        def from_config(cls, config, model_config):
            return cls()

        def check(self, output_tokens):
            return reason if output_tokens[-1] == token else None

    class Plugin:
        @tl.hookimpl
        def tinyloop_stoppers(self):
            return [AfterToken]
    return Plugin()


@pytest.fixture
def register():
    pm = get_plugin_manager()
    done = []

    def add(plugin):
        pm.register(plugin)
        done.append(plugin)
    yield add
    for p in done:
        pm.unregister(p)


def first_index(seq, tok):
    return seq.index(tok)


# ------------------------------------------------------------------ built-ins are plugins
def test_builtin_stoppers_are_ordinary_plugins():
    pm = PluginManager(load_entrypoints=False)
    assert "tinyloop.plugins.stoppers.standard" in DEFAULT_PLUGINS
    assert {"eos", "stop_sequences", "max_tokens"} <= set(pm.stoppers())
    orders = {n: int(c.order) for n, c in pm.stoppers().items()}
    assert orders["eos"] < orders["stop_sequences"] < orders["max_tokens"]
    assert tl.StopOrder.CONSUMER < tl.StopOrder.EOS < tl.StopOrder.PLUGIN < tl.StopOrder.LENGTH


def test_stop_reason_is_extensible():
    assert StopReason("EOS") is StopReason.EOS and StopReason.EOS == "EOS" and StopReason.EOS.value == "EOS"
    assert StopReason("SAW_TOKEN") is SAW and SAW.name == "SAW_TOKEN"
    with pytest.raises(tl.ConfigError, match="a stop reason is a name"):
        StopReason("not a name")


# ------------------------------------------------------------------ a plugin's own rule everywhere
def test_plugin_stopper_ends_plain_streamed_and_batched(register, tiny_model, prompt):
    ref = tl.generate(tiny_model, prompt, GenerateConfig(max_tokens=12))[len(prompt):]
    x = ref[4]
    register(stop_after(x))
    want = ref[:first_index(ref, x) + 1]
    st = GenerateStats()
    assert tl.generate_stream(tiny_model, prompt, GenerateConfig(max_tokens=12), stats=st)[len(prompt):] == want
    assert st.stop_reason is SAW and st.tokens_emitted == len(want)
    assert list(tl.generate_iter(tiny_model, prompt, GenerateConfig(max_tokens=12))) == want
    stats = []
    out = tl.generate_batch(tiny_model, [prompt, prompt], GenerateConfig(max_tokens=12), stats=stats)
    assert [o[len(prompt):] for o in out] == [want, want] and all(s.stop_reason is SAW for s in stats)
    assert st.to_dict()["stop_reason"] == "SAW_TOKEN"


def test_plugin_stopper_ends_speculative_and_tree(register, spec_model, prompt):
    ref = tl.generate(spec_model, prompt, GenerateConfig(max_tokens=20, loops=4))[len(prompt):]
    x = ref[7]
    register(stop_after(x))
    want = ref[:first_index(ref, x) + 1]
    for run in (lambda st: tl.generate_speculative(spec_model, prompt, tl.SpeculativeConfig(
                    max_tokens=20, draft_loops=1, verify_loops=4, draft_ahead=5), stats=st),
                lambda st: tl.generate_tree_speculative(spec_model, prompt, tl.TreeSpeculativeConfig(
                    max_tokens=20, draft_loops=1, verify_loops=4, draft_ahead=3, K_branches=2), stats=st)):
        st = GenerateStats()
        assert run(st)[len(prompt):] == want
        assert st.stop_reason is SAW


def test_plugin_stopper_ends_beams(register):
    """Under beam search a plugin's rule ends candidate beams like EOS does (a beam ending on X is
    finished and keeps its score); with no bound on its ending tokens, beams rank every token. The
    result equals the brute-force reference with X as the EOS id."""
    from test_beam import PROMPTS, model_logits, reference_beam, write_flat
    import tempfile
    import pathlib
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "flat.tinyloop"
        write_flat(path)
        m = tl.load_model(str(path), max_seq_len=96, backend="cpu")
        try:
            p = PROMPTS[0]
            free = tl.generate(m, p, GenerateConfig(max_tokens=6, beam_size=3, length_penalty=0.5))[len(p):]
            for bound in (True, False):
                x = free[2]
                plugin = stop_after(x, bound=bound)
                get_plugin_manager().register(plugin)
                try:
                    st = GenerateStats()
                    out = tl.generate_stream(m, p, GenerateConfig(max_tokens=6, beam_size=3, length_penalty=0.5),
                                             stats=st)
                finally:
                    get_plugin_manager().unregister(plugin)
                want, _ = reference_beam(model_logits(m, p), m.vocab_size, 3, 6, 0.5, eos=x)
                assert out == p + want
                assert st.stop_reason == (SAW if want[-1] == x else StopReason.MAX_TOKENS)
        finally:
            tl.free_model(m)


def _ends_from(free, vocab_size):
    """Three end ids for a model whose free greedy continuation is `free`: one it never emits (the
    eos_id), then its 5th and 3rd distinct tokens (extra_eos_ids): it must stop at the 3rd."""
    firsts = [t for i, t in enumerate(free) if t not in free[:i]]
    return [next(t for t in range(vocab_size) if t not in free), firsts[4], firsts[2]], free.index(firsts[2])


def test_extra_eos_ids_end_every_decode_path(tmp_path, prompt):
    """A model's extra_eos_ids (end-of-turn ids) end a request as its eos_id does, in plain,
    streamed, speculative, tree, lockstep and sampled decoding; text output leaves them out."""
    from conftest import write_tiny
    base = tmp_path / "base.tinyloop"
    write_tiny(base, seed=3, vocab_size=300)          # >= 256: the byte tokenizer decodes its ids
    m0 = tl.load_model(str(base), max_seq_len=128, backend="cpu")
    free = tl.generate(m0, prompt, GenerateConfig(max_tokens=16))[len(prompt):]
    short = tl.generate(m0, prompt[:4], GenerateConfig(max_tokens=16))[4:]
    tl.free_model(m0)
    ends, stop = _ends_from(free, 300)
    path = tmp_path / "eos.tinyloop"
    write_tiny(path, seed=3, vocab_size=300, eos_id=ends[0], extra_eos_ids=ends[1:])
    m = tl.load_model(str(path), max_seq_len=128, backend="cpu")
    try:
        assert m.cfg.eos_ids == tuple(ends)
        want = prompt + free[:stop + 1]
        st = GenerateStats()
        assert tl.generate(m, prompt, GenerateConfig(max_tokens=16), stats=st) == want
        assert st.stop_reason == StopReason.EOS
        seen = []
        assert tl.generate_stream(m, prompt, GenerateConfig(max_tokens=16),
                                  on_token=lambda t, p: seen.append(t) or True) == want
        assert seen == free[:stop + 1]
        assert tl.generate_speculative(m, prompt, tl.SpeculativeConfig(max_tokens=16, draft_loops=1, verify_loops=3,
                                                                       draft_ahead=3)) == want
        assert tl.generate_tree_speculative(m, prompt, tl.TreeSpeculativeConfig(
            max_tokens=16, draft_loops=1, verify_loops=3)) == want
        cut = next((i for i, t in enumerate(short) if t in ends), len(short) - 1)
        lanes = tl.generate_batch(m, [prompt, prompt[:4]], GenerateConfig(max_tokens=16))
        assert [list(x) for x in lanes] == [want, prompt[:4] + short[:cut + 1]]
        text = tl.generate_text(m, prompt, GenerateConfig(max_tokens=16))
        assert text == m.tokenizer.decode(free[:stop], continuation=True)
        for seed in range(4):
            st = GenerateStats()
            out = tl.generate(m, prompt, GenerateConfig(max_tokens=16, temperature=1.5, sample_seed=seed), stats=st)[len(prompt):]
            assert not set(out[:-1]) & set(ends)
            assert st.stop_reason == (StopReason.EOS if out[-1] in ends else StopReason.MAX_TOKENS)
    finally:
        tl.free_model(m)


def test_extra_eos_ids_end_beams(tmp_path):
    """Beam search finishes a beam on any end id: the result equals the brute-force reference with
    the extra ids as one-token stop sequences."""
    from test_beam import PROMPTS, model_logits, reference_beam, write_flat
    p = PROMPTS[0]
    base = tmp_path / "flat.tinyloop"
    write_flat(base)
    m0 = tl.load_model(str(base), max_seq_len=96, backend="cpu")
    free = tl.generate(m0, p, GenerateConfig(max_tokens=8, beam_size=3, length_penalty=0.5))[len(p):]
    tl.free_model(m0)
    firsts = [t for i, t in enumerate(free) if t not in free[:i]]
    ends = [next(t for t in range(97) if t not in free), firsts[3], firsts[1]]
    path = tmp_path / "flat_eos.tinyloop"
    write_flat(path, eos_id=ends[0], extra_eos_ids=ends[1:])
    m = tl.load_model(str(path), max_seq_len=96, backend="cpu")
    try:
        st = GenerateStats()
        out = tl.generate(m, p, GenerateConfig(max_tokens=8, beam_size=3, length_penalty=0.5), stats=st)
        want, _ = reference_beam(model_logits(m, p), m.vocab_size, 3, 8, 0.5, eos=ends[0],
                                 stops=[(t,) for t in ends[1:]])
        assert out == p + want
        assert st.stop_reason == (StopReason.EOS if want[-1] in ends else StopReason.MAX_TOKENS)
    finally:
        tl.free_model(m)


# ------------------------------------------------------------------ order
def test_order_callback_then_eos_then_sequences_then_plugins_then_length(register, tiny_model, prompt):
    ref = tl.generate(tiny_model, prompt, GenerateConfig(max_tokens=8))[len(prompt):]
    last = ref[3]
    register(stop_after(last))
    cfg = GenerateConfig(max_tokens=4, stop_sequences=[[last]])
    st = GenerateStats()
    tl.generate_stream(tiny_model, prompt, cfg, stats=st)
    assert st.stop_reason == StopReason.STOP_SEQUENCE and st.tokens_emitted == first_index(ref, last) + 1
    st = GenerateStats()
    tl.generate_stream(tiny_model, prompt, cfg, on_token=lambda t, pos: t != last, stats=st)
    assert st.stop_reason == StopReason.CALLBACK_ABORT
    st = GenerateStats()       # the plugin's rule and max_tokens on the same token: the plugin's reason
    tl.generate_stream(tiny_model, prompt, GenerateConfig(max_tokens=first_index(ref, last) + 1), stats=st)
    assert st.stop_reason is SAW


def test_stopper_returning_a_non_reason_is_a_plugin_error(register, tiny_model, prompt):
    class Bad(tl.Stopper):
        name = "test_bad_stopper"

        @classmethod
        def from_config(cls, config, model_config):
            return cls()

        def check(self, output_tokens):
            return "STOP"

    class P:
        @tl.hookimpl
        def tinyloop_stoppers(self):
            return [Bad]
    register(P())
    with pytest.raises(tl.PluginError, match=r"stopper 'test_bad_stopper' returned 'STOP', not a StopReason"):
        tl.generate(tiny_model, prompt, GenerateConfig(max_tokens=3))
    assert tl.vram_usage_bytes(tiny_model) == tiny_model.backend.memory_bytes()


# ------------------------------------------------------------------ a processor that stops a request
class DeadEndAfter(tl.LogitProcessor, tl.Stopper):
    """A mask processor that allows every token until it has seen `token`, then none: it ends the
    request with GRAMMAR_DEAD_END (the way a grammar plugin would) instead of masking everything."""

    name = "test_dead_end"
    stage = tl.Stage.MASK
    argmax_invariant = True         # it masks nothing while the request runs
    token = -1
    resets = 0

    @classmethod
    def from_config(cls, config):
        return cls() if cls.token >= 0 else None

    def reset(self, prompt):
        self.dead = False
        DeadEndAfter.resets += 1

    def accept(self, token):
        self.dead = self.dead or token == self.token

    def check(self, output_tokens):
        return StopReason.GRAMMAR_DEAD_END if self.dead else None


class ProcPlugin:
    @tl.hookimpl
    def tinyloop_processors(self):
        return [DeadEndAfter]


def test_processor_ends_a_request_with_its_own_reason(register, tiny_model, prompt):
    ref = tl.generate(tiny_model, prompt, GenerateConfig(max_tokens=10))[len(prompt):]
    register(ProcPlugin())
    DeadEndAfter.token, DeadEndAfter.resets = ref[5], 0
    try:
        st = GenerateStats()
        out = tl.generate_stream(tiny_model, prompt, GenerateConfig(max_tokens=10), stats=st)[len(prompt):]
        assert out == ref[:first_index(ref, ref[5]) + 1]
        assert st.stop_reason is StopReason.GRAMMAR_DEAD_END
        assert DeadEndAfter.resets == 1          # reset once, as a processor
        # a decoder whose tokens do not come through the processor chain refuses it before work
        with pytest.raises(tl.PluginError, match=r"decoder 'beam' does not run logit processors \(active: "
                                                 r"\['test_dead_end'\]\)"):
            tl.generate(tiny_model, prompt, GenerateConfig(max_tokens=4, beam_size=2))
    finally:
        DeadEndAfter.token = -1


def test_grammar_dead_end_only_from_a_plugin(tiny_model, prompt):
    """No built-in rule returns GRAMMAR_DEAD_END (there is no grammar yet)."""
    from tinyloop.plugins.stoppers import standard
    for cls in PluginManager(load_entrypoints=False).stoppers().values():
        assert cls.__module__ == standard.__name__
    assert "GRAMMAR_DEAD_END" not in open(standard.__file__).read()
