"""Decoders bring their own session and options; a field the chosen decoder would ignore is an error.

GenerateConfig(decoder=..., options={...}) against the public speculative wrappers, options parsing
(unknown keys, another decoder's options, bad values), the honoured-fields rule, and an inline
third-party decoder with options and a session of its own (YAML: tests/test_run_config.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

import tinyloop as tl
from tinyloop.runtime.config import check_int
from tinyloop.runtime.plugins import get_plugin_manager

OPTS = {"draft_loops": 2, "verify_loops": 6, "draft_ahead": 4}


@pytest.fixture(scope="module")
def model(spec_model):
    return spec_model


@pytest.fixture
def no_alloc(model, monkeypatch):
    calls = []
    monkeypatch.setattr(model.backend, "alloc_cache", lambda *a: calls.append(a))
    yield calls
    assert calls == [], "allocated before the error"


# ------------------------------------------------------------------ generate == the public wrappers
@pytest.mark.parametrize("resume", [True, False])
def test_speculative_through_generate_equals_wrapper(model, prompt, resume):
    opts = dict(OPTS, verify_resume=resume)
    st_a, st_b = tl.GenerateStats(), tl.GenerateStats()
    a = tl.generate_stream(model, prompt, tl.GenerateConfig(max_tokens=20, decoder="speculative", options=opts),
                           stats=st_a)
    b = tl.generate_speculative(model, prompt, tl.SpeculativeConfig(max_tokens=20, **opts), stats=st_b)
    assert a == b == tl.generate(model, prompt, tl.GenerateConfig(max_tokens=20, loops=6))
    assert st_a.verify_forwards == st_b.verify_forwards > 0 and st_a.loops_used == 6
    assert dataclasses.asdict(st_a).keys() == dataclasses.asdict(st_b).keys()


def test_tree_through_generate_equals_wrapper(model, prompt):
    opts = dict(OPTS, draft_ahead=2, K_branches=3)
    a = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=20, decoder="tree_speculative", options=opts))
    b = tl.generate_tree_speculative(model, prompt, tl.TreeSpeculativeConfig(max_tokens=20, **opts))
    assert a == b == tl.generate(model, prompt, tl.GenerateConfig(max_tokens=20, loops=6))


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_sampling_through_generate_equals_wrapper(model, prompt, tree):
    opts = dict(OPTS, draft_loops=1, verify_loops=4, draft_ahead=2)
    knobs = dict(temperature=0.8, top_k=20, top_p=0.9)
    if tree:
        opts["K_branches"] = 2
        ref = tl.generate_tree_speculative(model, prompt, tl.TreeSpeculativeConfig(max_tokens=16, seed=7, **knobs,
                                                                                     **opts))
    else:
        ref = tl.generate_speculative(model, prompt, tl.SpeculativeConfig(max_tokens=16, seed=7, **knobs, **opts))
    got = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=16, sample_seed=7, **knobs, options=opts,
                                                       decoder="tree_speculative" if tree else "speculative"))
    assert got == ref


def test_options_object_and_loops_from_the_request(model, prompt):
    ref = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=12, loops=5))
    # verify_loops left out: the verify depth is the request's loops
    assert tl.generate(model, prompt, tl.GenerateConfig(max_tokens=12, loops=5, decoder="speculative",
                                                        options={"draft_loops": 2})) == ref
    opts = tl.SpeculativeOptions(draft_loops=1, draft_ahead=3)
    assert tl.generate(model, prompt, tl.GenerateConfig(max_tokens=12, loops=5, decoder="speculative",
                                                        options=opts)) == ref
    # and the model's default depth when neither is given
    dflt = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=12))
    assert tl.generate(model, prompt, tl.GenerateConfig(max_tokens=12, decoder="speculative",
                                                        options={"draft_loops": 1})) == dflt


def test_options_are_frozen_and_the_config_hashable():
    cfg = tl.GenerateConfig(decoder="speculative", options={"draft_loops": 1})
    with pytest.raises(TypeError, match="read-only"):
        cfg.options["draft_loops"] = 2
    assert hash(cfg) == hash(cfg.replace())
    assert cfg == cfg.replace() and cfg != cfg.replace(options={"draft_loops": 2})
    assert tl.GenerateConfig().options == {}
    with pytest.raises(tl.ConfigError, match="options must be a mapping"):
        tl.GenerateConfig(options=[1, 2])


# ------------------------------------------------------------------ options errors, before any work
@pytest.mark.parametrize("cfg,exc,match", [
    (dict(decoder="speculative", options={"draft_ahed": 3}), tl.ConfigError,
     r"unknown key 'draft_ahed' in options of decoder 'speculative'; allowed keys: draft_loops"),
    (dict(decoder="speculative", options={"K_branches": 2}), tl.IncompatibleModesError,
     r"options key 'K_branches' is an option of decoder 'tree_speculative', not of decoder 'speculative'"),
    (dict(decoder="speculative", options=tl.TreeSpeculativeOptions()), tl.IncompatibleModesError,
     r"the options of decoder 'tree_speculative'\) do not belong to decoder 'speculative'"),
    (dict(decoder="greedy", options={"draft_loops": 2}), tl.IncompatibleModesError,
     r"decoder 'greedy' takes no options"),
    (dict(options={"draft_loops": 2}), tl.IncompatibleModesError, r"decoder 'greedy' takes no options"),
    (dict(decoder="beam", beam_size=2, options=tl.SpeculativeOptions()), tl.IncompatibleModesError,
     r"do not belong to decoder 'beam', which takes none"),
    (dict(decoder="speculative", options={"draft_ahead": 0}), tl.ConfigError,
     r"options of decoder 'speculative': draft_ahead=0 is outside the allowed range \[1, 64\]"),
    (dict(decoder="speculative", options={"draft_loops": 3, "verify_loops": 3}), tl.ConfigError,
     r"draft_loops=3 is outside the allowed range \[1, 2\]"),
    (dict(decoder="speculative", options={"verify_resume": "yes"}), tl.ConfigError, "verify_resume must be true"),
    (dict(decoder="speculative", options={"verify_loops": 9}), tl.ConfigError,
     r"verify_loops=9 is outside the allowed range \[2, 8\] \(model.max_loops\)"),
    (dict(decoder="speculative", loops=4, options={"verify_loops": 6}), tl.ConfigError,
     "options verify_loops=6 and loops=4 disagree"),
    (dict(decoder="speculative", loops=3, options={"draft_loops": 3}), tl.ConfigError,
     r"draft_loops=3 is outside the allowed range \[1, 2\] \(below the verify depth 3\)"),
    (dict(decoder="tree_speculative", options={"K_branches": 4, "draft_ahead": 5}), tl.ConfigError,
     "draft tree of 1365 nodes"),
    (dict(decoder="tree_speculative", options={"K_branches": 17}), tl.ConfigError, r"K_branches=17"),
    (dict(decoder="speculative", repetition_penalty=1.2), tl.IncompatibleModesError,
     r"repetition_penalty.*rejected in speculative"),
    (dict(decoder="tree_speculative", cache_window=8), tl.IncompatibleModesError,
     r"cache_window.*rejected in tree_speculative"),
])
def test_options_errors_before_work(model, prompt, no_alloc, cfg, exc, match):
    with pytest.raises(exc, match=match):
        tl.generate(model, prompt, tl.GenerateConfig(max_tokens=4, **cfg))


def test_speculative_decoders_run_single_requests_only(model, prompt, no_alloc):
    with pytest.raises(tl.PluginError, match="decoder 'speculative' does not run in batched"):
        tl.generate_batch(model, [prompt], tl.GenerateConfig(max_tokens=4, decoder="speculative"))


def test_wrapper_type_errors(model, prompt, no_alloc):
    with pytest.raises(tl.ConfigError, match="takes a SpeculativeConfig, got TreeSpeculativeConfig"):
        tl.generate_speculative(model, prompt, tl.TreeSpeculativeConfig(verify_loops=4))
    with pytest.raises(tl.ConfigError, match="takes a TreeSpeculativeConfig, got GenerateConfig"):
        tl.generate_tree_speculative(model, prompt, tl.GenerateConfig())


# ------------------------------------------------------------------ honoured fields
@pytest.mark.parametrize("cfg,field,decoder", [
    (dict(decoder="greedy", temperature=0.9), "temperature", "greedy"),
    (dict(top_k=5), "top_k", "greedy"),                         # the automatic greedy choice too
    (dict(top_p=0.9), "top_p", "greedy"),
    (dict(sample_seed=3), "sample_seed", "greedy"),
    (dict(length_penalty=0.5), "length_penalty", "greedy"),
    (dict(early_exit_min_L=3), "early_exit_min_L", "greedy"),
    (dict(temperature=0.8, beam_size=1, length_penalty=2.0), "length_penalty", "sampling"),
    (dict(beam_size=2, top_k=3), "top_k", "beam"),
    (dict(beam_size=3, sample_seed=1), "sample_seed", "beam"),
    (dict(decoder="speculative", sample_seed=3), "sample_seed", "speculative"),   # seeds shape sampling only
    (dict(decoder="speculative", beam_size=2, options=OPTS), None, None),          # compat: beam x speculative
])
def test_a_field_the_decoder_ignores_is_an_error(model, prompt, no_alloc, cfg, field, decoder):
    with pytest.raises(tl.IncompatibleModesError) as info:
        tl.generate(model, prompt, tl.GenerateConfig(max_tokens=4, **cfg))
    if field is not None:
        # an exit knob of a decoder that runs early exit is ignored only because patience is 0: the
        # message names that switch (tests/test_exit_docs_claims.py)
        why = ("early exit is off (early_exit_patience=0)" if field.startswith("early_exit") and decoder == "greedy"
               else f"decoder {decoder!r} ignores it")
        assert f"{field}=" in str(info.value) and why in str(info.value)


def test_fields_that_mean_the_default_are_not_requests(model, prompt):
    ref = tl.generate(model, prompt, tl.GenerateConfig(max_tokens=4))
    # temperature <= 0.01 is greedy and beam_size 1 is ordinary decoding (the spec's meanings)
    assert tl.generate(model, prompt, tl.GenerateConfig(max_tokens=4, temperature=0.005, beam_size=1,
                                                        decoder="greedy")) == ref
    assert tl.GenerateConfig(temperature=0.005, beam_size=1).requested_fields() == ()
    assert set(tl.GenerateConfig(temperature=0.5, top_k=3, stop_sequences=[[1]]).requested_fields()) == \
        {"temperature", "top_k", "stop_sequences"}


def test_sampling_decoder_needs_a_temperature(model, prompt, no_alloc):
    with pytest.raises(tl.IncompatibleModesError, match=r"temperature=0.0 asks for greedy decoding"):
        tl.generate(model, prompt, tl.GenerateConfig(decoder="sampling"))


def test_auto_decoder_takes_no_options(model, prompt, no_alloc):
    with pytest.raises(tl.IncompatibleModesError, match="decoder 'auto' takes no options"):
        tl.generate(model, prompt, tl.GenerateConfig(decoder="auto", options={"draft_loops": 1}))


# ------------------------------------------------------------------ a third-party decoder with options
@dataclass(frozen=True)
class StrideOptions:
    """Options of the inline test decoder."""

    rank: int = 1
    """Emit the token of this rank (0: the argmax), in [0, 4]."""

    def __post_init__(self):
        check_int("rank", self.rank, 0, 4)


class CountingSession(tl.Session):
    """A session of the decoder's own: counts advances and takes one extra cache slot."""

    def __init__(self, model, prompt, plan, chain, stats):
        super().__init__(model, prompt, plan, chain, stats, extra_slots=1)
        self.advances = 0

    def advance(self, token, lane=0):
        self.advances += 1
        super().advance(token, lane)


class RankDecoder(tl.Decoder):
    name = "test_rank"
    contexts = frozenset({"single", "batched"})
    options_class = StrideOptions
    session_class = CountingSession
    seen = []

    def decode(self, session):
        import numpy as np
        assert isinstance(session, CountingSession) and session.options is self.options
        session.start()
        while True:
            tok = int(np.argsort(-session.logits(), kind="stable")[self.options.rank])
            yield tok
            RankDecoder.seen.append(session.advances)
            session.advance(tok)


class RankPlugin:
    @tl.hookimpl
    def tinyloop_decoders(self):
        return [RankDecoder]


@pytest.fixture
def rank_plugin():
    RankDecoder.seen = []
    with get_plugin_manager().registered(RankPlugin(), name="test-rank-decoder") as pm:
        yield pm


def test_third_party_decoder_with_options_and_session(rank_plugin, tiny_model, prompt):
    import numpy as np
    out = tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=4, decoder="test_rank", options={"rank": 2}))
    for i in range(len(prompt), len(out)):
        order = np.argsort(-tl.score_last_token(tiny_model, out[:i]), kind="stable")
        assert out[i] == int(order[2])
    assert RankDecoder.seen == [0, 1, 2]      # the fourth token ends the request
    first = tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=2, decoder="test_rank"))   # default rank 1
    assert first[len(prompt)] == int(np.argsort(-tl.score_last_token(tiny_model, prompt), kind="stable")[1])
    with pytest.raises(tl.ConfigError, match=r"options of decoder 'test_rank': rank=7 is outside the allowed"):
        tl.generate(tiny_model, prompt, tl.GenerateConfig(decoder="test_rank", options={"rank": 7}))
    with pytest.raises(tl.ConfigError, match=r"unknown key 'stride' in options of decoder 'test_rank'"):
        tl.generate(tiny_model, prompt, tl.GenerateConfig(decoder="test_rank", options={"stride": 7}))
    with pytest.raises(tl.IncompatibleModesError, match="temperature=0.5 is set, but decoder 'test_rank'"):
        tl.generate(tiny_model, prompt, tl.GenerateConfig(decoder="test_rank", temperature=0.5))
    # processors' fields are honoured by decoders that read logits through the chain
    assert len(tl.generate(tiny_model, prompt, tl.GenerateConfig(max_tokens=2, decoder="test_rank",
                                                                 repetition_penalty=1.5))) == len(prompt) + 2
    assert tl.vram_usage_bytes(tiny_model) == tiny_model.backend.memory_bytes()
