"""configs/compat.yaml: plugin declarations agree with it; random mode combinations either run or
raise the typed error before any work."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop as tl
from tinyloop.runtime.compat import CompatMatrix, CompatWarning, load_matrix
from tinyloop.runtime.plugins import PluginManager


def test_plugin_declarations_match_yaml():
    m = load_matrix()
    pm = PluginManager(load_entrypoints=False)
    provided = {}
    for cls in pm.all_plugin_classes():
        if cls.mode is None:
            continue
        assert cls.mode in m.modes, f"{cls.__name__} provides unknown mode {cls.mode}"
        row = m.modes[cls.mode]
        assert row.status == "implemented", f"{cls.mode} is planned in the YAML but {cls.__name__} provides it"
        assert dict(cls.compat) == dict(row.cells), f"{cls.__name__}.compat disagrees with compat.yaml"
        provided[cls.mode] = cls
    for name, row in m.modes.items():
        if row.status == "implemented":
            assert name in provided, f"compat.yaml says {name} is implemented but no plugin provides it"


def test_matrix_mirrors_the_spec_table():
    m = load_matrix()
    assert m.modes["beam_search"].cells["batched"] == "rejected"
    assert m.modes["cache_window"].cells["batched"] == "rejected"
    assert m.modes["grammar"].cells["speculative"] == "rejected"
    assert m.modes["int4_cache"].cells["speculative"] == "partial"
    assert m.modes["int8_cache"].cells["warm_start"] == "ok"
    assert m.modes["cache_window"].cells["warm_start"] == "rejected"


MODE_KNOBS = st.fixed_dictionaries({
    "cache_mode": st.sampled_from(["fp16", "fp32", "int8", "int4"]),
    "temperature": st.sampled_from([0.0, 0.8]),
    "repetition_penalty": st.sampled_from([1.0, 1.3]),
    "beam_size": st.sampled_from([0, 2]),
    "cache_window": st.sampled_from([0, 16]),
    "early_exit_patience": st.sampled_from([0, 1]),
    "grammar": st.sampled_from([None, {"regex": "[a-z]+"}]),
})


def expected_outcome(matrix, context, cfg):
    if matrix.contexts[context] == "planned":
        return "not_implemented"
    active = matrix.active_modes(cfg)
    if any(r.status == "planned" for r in active):
        return "not_implemented"
    if any(r.cells[context] == "rejected" for r in active):
        return "rejected"
    names = {r.name for r in active}
    if any(p <= names for p, _ in matrix.pairs):
        return "rejected"
    return "ok"


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A tiny model with 300 ids, so the raw-byte tokenizer serves it (grammars need a tokenizer)."""
    from conftest import write_tiny
    path = tmp_path_factory.mktemp("compat") / "bytes.tinyloop"
    write_tiny(path, vocab_size=300)
    m = tl.load_model(str(path), max_seq_len=128, backend="cpu")
    yield m
    tl.free_model(m)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(knobs=MODE_KNOBS, context=st.sampled_from(["single", "batched", "speculative", "tree_speculative",
                                                  "prefix_reuse", "warm_start"]))
def test_random_mode_combinations(byte_model, prompt, monkeypatch, knobs, context):
    matrix = load_matrix()
    # the seed only where it is used: a seed on a greedy or beam request is a field the decoder ignores
    cfg = tl.GenerateConfig(max_tokens=3, sample_seed=1 if knobs["temperature"] > 0.01 else 0, **knobs)
    if context in ("speculative", "tree_speculative"):
        # the speculative entry points take temperature and cache_mode; the other knobs do not exist there
        cfg = tl.GenerateConfig(max_tokens=3, temperature=knobs["temperature"], cache_mode=knobs["cache_mode"])
    want = expected_outcome(matrix, context, cfg)
    pool = None
    if context == "prefix_reuse":       # the pool's entry is built before the request is watched
        pool = tl.create_prefix_pool(2)
        tl.register_prefix(pool, byte_model, prompt[:4], cache_mode=cfg.cache_mode)
    allocations = []
    real_alloc = byte_model.backend.alloc_cache
    monkeypatch.setattr(byte_model.backend, "alloc_cache", lambda *a: allocations.append(a) or real_alloc(*a))

    def call():
        if context == "single":
            return [(prompt, tl.generate(byte_model, prompt, cfg))]
        if context == "prefix_reuse":
            return [(prompt, tl.generate_with_pool(byte_model, pool, prompt, cfg))]
        if context == "warm_start":
            # the handle is built under the request's settings (checked against the same column)
            h = tl.build_resume_handle(byte_model, prompt, 2, dataclasses.replace(cfg, max_tokens=0))
            try:
                return [(prompt, tl.resume_generate(h, 3, cfg))]
            finally:
                tl.free_resume_handle(h)
        if context == "batched":
            return list(zip([prompt, prompt[:4]], tl.generate_batch(byte_model, [prompt, prompt[:4]], cfg)))
        spec = dict(max_tokens=3, draft_loops=1, verify_loops=3, temperature=knobs["temperature"],
                    cache_mode=knobs["cache_mode"])
        if context == "speculative":
            return [(prompt, tl.generate_speculative(byte_model, prompt, tl.SpeculativeConfig(**spec)))]
        return [(prompt, tl.generate_tree_speculative(byte_model, prompt, tl.TreeSpeculativeConfig(**spec)))]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompatWarning)
        if want == "ok":
            outs = call()
            for p, out in outs:
                assert out[:len(p)] == p and len(out) == len(p) + 3   # no EOS in this model
                assert all(0 <= t < byte_model.vocab_size for t in out)
            assert allocations
        else:
            exc = tl.NotImplementedModeError if want == "not_implemented" else tl.IncompatibleModesError
            with pytest.raises(exc) as info:
                call()
            assert "compat.yaml" in str(info.value) or "not implemented" in str(info.value)
            assert allocations == []
    monkeypatch.undo()
    if pool is not None:
        tl.free_prefix_pool(pool)


def test_rejection_names_the_rule(tiny_model, prompt):
    m = load_matrix()
    rows = dict(m.modes, early_exit=dataclasses.replace(m.modes["early_exit"], status="planned"))
    with pytest.raises(tl.NotImplementedModeError,
                       match=r"early_exit \(early_exit_patience=2\) is not implemented yet"):
        CompatMatrix(m.contexts, rows, m.pairs, m.source).check("single", tl.GenerateConfig(early_exit_patience=2))
    with pytest.raises(tl.IncompatibleModesError, match=r"early_exit \(early_exit_patience=2\) is rejected in batched"):
        tl.generate_batch(tiny_model, [prompt], tl.GenerateConfig(early_exit_patience=2))
    with pytest.raises(tl.IncompatibleModesError, match=r"early_exit.*rejected in warm_start"):
        m.check("warm_start", tl.GenerateConfig(early_exit_patience=1))
    with pytest.raises(tl.IncompatibleModesError, match=r"beam_search \(beam_size=4\) is rejected in batched"):
        tl.generate_batch(tiny_model, [prompt], tl.GenerateConfig(beam_size=4))
    with pytest.raises(tl.IncompatibleModesError, match=r"repetition_penalty.*rejected in speculative"):
        load_matrix().check("speculative", tl.GenerateConfig(repetition_penalty=1.2))
    with pytest.raises(tl.IncompatibleModesError, match=r"cache_window.*rejected in prefix_reuse"):
        load_matrix().check("prefix_reuse", tl.GenerateConfig(cache_window=8))
    with pytest.raises(tl.IncompatibleModesError, match=r"beam_search.*rejected in warm_start"):
        load_matrix().check("warm_start", tl.GenerateConfig(beam_size=2))
    with pytest.raises(tl.IncompatibleModesError, match=r"repetition_penalty.*rejected in tree_speculative"):
        load_matrix().check("tree_speculative", tl.GenerateConfig(repetition_penalty=1.2))


def test_partial_cell_warns():
    """A partial cell (cache_window x speculative, with the row switched on) runs with a warning."""
    m = load_matrix()
    rows = dict(m.modes, cache_window=dataclasses.replace(m.modes["cache_window"], status="implemented"))
    with pytest.warns(CompatWarning, match="cache_window in speculative decoding is partial"):
        CompatMatrix(m.contexts, rows, m.pairs, m.source).check("speculative", tl.GenerateConfig(cache_window=8))


def test_malformed_matrix_is_config_error(tmp_path):
    from tinyloop.runtime.compat import load_matrix as lm
    p = tmp_path / "compat.yaml"
    p.write_text("version: 1\ncontexts: {single: {status: implemented}}\nmodes:\n  x: {status: done, when: [a, '==', 1], cells: {single: ok}}\n")
    with pytest.raises(tl.ConfigError, match="modes.x.status"):
        lm(str(p))


def test_every_rejected_cell_names_its_rationale(tiny_model, prompt):
    """Each rejected cell of the shipped matrix carries a `why`, and the refusal names it: the
    batched rejections with the spec's own rationale (its Batching and Integration page)."""
    m = load_matrix()
    missing = [f"{r.name}.{c}" for r in m.modes.values() for c, v in r.cells.items()
               if v == "rejected" and not (r.why or {}).get(c)]
    assert not missing, missing
    with pytest.raises(tl.IncompatibleModesError, match=r"rejected in batched decoding: ring-buffer semantics"):
        tl.generate_batch(tiny_model, [prompt], tl.GenerateConfig(cache_window=8))
    with pytest.raises(tl.IncompatibleModesError, match=r"rejected in batched decoding: beams times lanes would "
                                                         r"multiply cache memory"):
        tl.generate_batch(tiny_model, [prompt], tl.GenerateConfig(beam_size=2))
    with pytest.raises(tl.IncompatibleModesError, match=r"rejected in speculative decoding: the grammar's matcher"):
        m.check("speculative", tl.GenerateConfig(grammar=tl.Grammar.regex("a+")))


@pytest.mark.parametrize("why, what", [
    ("{single: 'x'}", "single is ok, not rejected"),
    ("{batched: ''}", "an empty rationale"),
    ("[batched]", "not a mapping"),
    ("{nowhere: 'x'}", "an unknown context"),
])
def test_a_why_must_explain_a_rejected_cell(tmp_path, why, what):
    from tinyloop.runtime.compat import load_matrix as lm
    p = tmp_path / "compat.yaml"
    p.write_text("version: 1\ncontexts: {single: {status: implemented}, batched: {status: implemented}}\n"
                 "modes:\n  x: {status: implemented, when: [beam_size, '>=', 2], "
                 f"cells: {{single: ok, batched: rejected}}, why: {why}}}\n")
    with pytest.raises(tl.ConfigError, match=r"modes.x.why must map rejected contexts"):
        lm(str(p))
