"""Never an untyped exception from the public API: each argument of each entry point, given values
of the wrong type, is a TinyLoopError subclass (naming the argument), before any work."""

from __future__ import annotations

import pytest

import tinyloop as tl

BAD = [None, 3, 2.5, True, "text", b"bytes", [1, "a"], {"a": 1}, object()]


@pytest.fixture(scope="module")
def model(tiny_path):
    m = tl.load_model(str(tiny_path), max_seq_len=64, backend="cpu")
    yield m
    tl.free_model(m)


def _typed(fn):
    try:
        fn()
    except tl.TinyLoopError:
        return True
    except Exception as exc:           # pragma: no cover - the failure message names it
        pytest.fail(f"untyped {type(exc).__name__}: {exc}")
    return False


ENTRY = {
    "generate": lambda m, **kw: tl.generate(m, [1, 2], **kw),
    "generate_stream": lambda m, **kw: tl.generate_stream(m, [1, 2], **kw),
    "generate_iter": lambda m, **kw: tl.generate_iter(m, [1, 2], **kw),
    "generate_batch": lambda m, **kw: tl.generate_batch(m, [[1, 2]], **kw),
    "generate_speculative": lambda m, **kw: tl.generate_speculative(m, [1, 2], **kw),
    "generate_tree_speculative": lambda m, **kw: tl.generate_tree_speculative(m, [1, 2], **kw),
    "generate_text": lambda m, **kw: tl.generate_text(m, [1, 2], **kw),
}


@pytest.mark.parametrize("name", sorted(ENTRY))
@pytest.mark.parametrize("bad", range(len(BAD)))
def test_model_config_and_stats_arguments(model, name, bad):
    fn, v = ENTRY[name], BAD[bad]
    if v is not None:
        assert _typed(lambda: fn(v)), f"{name}(model={v!r}) did not raise"
        assert _typed(lambda: fn(model, config=v)), f"{name}(config={v!r}) did not raise"
        assert _typed(lambda: fn(model, stats=v)), f"{name}(stats={v!r}) did not raise"


@pytest.mark.parametrize("bad", range(len(BAD)))
def test_prompt_and_scoring_arguments(model, bad):
    v = BAD[bad]
    if isinstance(v, str):
        return                        # text: the tiny model has no tokenizer -> TokenizerError (typed)
    cfg = tl.GenerateConfig(max_tokens=2)
    assert _typed(lambda: tl.generate(model, v, cfg))
    assert _typed(lambda: tl.score(model, v))
    assert _typed(lambda: tl.score_last_token(model, v))
    if not (isinstance(v, int) and not isinstance(v, bool)):        # 3 is a valid depth
        assert _typed(lambda: tl.score(model, [1, 2], loops=v if v is not None else "x"))
    assert _typed(lambda: tl.score(model, [1, 2], cache_mode=v))
    if v is not None:
        assert _typed(lambda: tl.generate_stream(model, [1, 2], cfg, on_token=v)) or callable(v)


@pytest.mark.parametrize("bad", range(len(BAD)))
def test_load_model_and_inspect_arguments(tiny_path, bad):
    v = BAD[bad]
    if v is not None and v != "text":
        assert _typed(lambda: tl.load_model(v, backend="cpu"))
        assert _typed(lambda: tl.inspect(v))
    count = -1 if v is None or (isinstance(v, int) and not isinstance(v, bool)) else v   # 3 is a valid count
    assert _typed(lambda: tl.load_model(str(tiny_path), max_seq_len=count))
    assert _typed(lambda: tl.load_model(str(tiny_path), backend=v))
    assert _typed(lambda: tl.load_model(str(tiny_path), prefill_chunk=count))
    if v is not None:
        assert _typed(lambda: tl.load_model(str(tiny_path), tokenizer=v))
        assert _typed(lambda: tl.free_model(v))
        assert _typed(lambda: tl.vram_usage_bytes(v))
        assert _typed(lambda: tl.calibrate(v))


@pytest.mark.parametrize("cls", [tl.GenerateConfig, tl.SpeculativeConfig, tl.TreeSpeculativeConfig,
                                 tl.RunConfig, tl.GenerateStats])
def test_unknown_and_positional_config_arguments(cls):
    with pytest.raises(tl.ConfigError, match="unknown field 'no_such_knob'"):
        cls(no_such_knob=1)
    with pytest.raises(tl.ConfigError, match="allowed fields"):
        cls(*range(40))


@pytest.mark.parametrize("field,value", [
    ("beam_size", 10 ** 9), ("max_tokens", 1 << 40), ("cache_window", 1 << 40),
    ("repetition_penalty", 1e308), ("length_penalty", 1e300), ("early_exit_logit_margin", 1e300),
    ("early_exit_patience", 1 << 40), ("temperature", float("inf")), ("top_p", float("nan")),
])
def test_counts_and_floats_are_bounded(field, value):
    with pytest.raises(tl.ConfigError, match=field):
        tl.GenerateConfig(**{field: value})


@pytest.mark.parametrize("field,value", [("draft_ahead", 10 ** 9), ("K_branches", 10 ** 6),
                                         ("max_tokens", 1 << 40)])
def test_speculative_counts_are_bounded(field, value):
    with pytest.raises(tl.ConfigError, match=field):
        tl.TreeSpeculativeConfig(**{field: value})


@pytest.mark.parametrize("bad", range(len(BAD)))
def test_apply_chat_template_arguments(model, bad):
    """apply_chat_template: a wrong model, conversation, add_generation_prompt or tokenize is a
    typed error (a model without a template too)."""
    v = BAD[bad]
    convo = [{"role": "user", "content": "hi"}]
    assert _typed(lambda: tl.apply_chat_template(v, convo))
    assert _typed(lambda: tl.apply_chat_template(model, v))
    assert _typed(lambda: tl.apply_chat_template(model, convo, add_generation_prompt=v))
    assert _typed(lambda: tl.apply_chat_template(model, convo, tokenize=v))
