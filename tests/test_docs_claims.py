"""Claims of the user-facing docs (README.md, docs/SERVING.md, ...) that a new user relies on and that
no other test pins, checked against what the code does (CPU only, each test a few seconds)."""

from __future__ import annotations

import pathlib
import re

import pytest

import tinyloop as tl

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def demo():
    m = tl.load_model("demo", max_seq_len=128, backend="cpu")
    yield m
    tl.free_model(m)


def _bullet(text: str, start: str) -> str:
    """The README bullet that starts with `start` (up to the next bullet or blank line)."""
    i = text.index(start)
    m = re.search(r"\n(\* |\n)", text[i:])
    return " ".join(text[i:i + (m.start() if m else len(text) - i)].split())


# ------------------------------------------------------------------------------- README: plugins
def test_readme_plugin_hook_list_names_every_hook():
    """README "Plugins": "implement any of the hooks in tinyloop/runtime/hookspecs.py -- <list>":
    the list is every hook a plugin can implement (tinyloop_exit_criteria included)."""
    from tinyloop.runtime import hookspecs
    hooks = {n for n in vars(hookspecs) if n.startswith("tinyloop_") and callable(getattr(hookspecs, n))}
    section = README[README.index("## Plugins"):README.index("Built-ins register through the same hooks")]
    listed = set(re.findall(r"`(tinyloop_\w+)`", section))
    assert listed == hooks, f"README lists {sorted(listed)}, hookspecs.py has {sorted(hooks)}"


# ------------------------------------------------------------------------------- README: auto decoder
def test_readme_auto_decoder_same_tokens_claim_holds_for_what_it_says(demo):
    """README: the auto decoder "uses the faster; same tokens ..." -- exactly the tokens of plain
    decoding when greedy; a sampling request handed to speculative sampling keeps plain sampling's
    distribution but not its draws, and the README must not promise the same tokens there."""
    from tinyloop.plugins.decoders.autotune import DecoderChoice
    ids = demo.tokenizer.encode("def fibonacci(n):")
    before = dict(demo.decoder_choices)
    # the calibration's verdict for depth 4, as if speculative had won (calibrating takes seconds)
    demo.decoder_choices[4] = DecoderChoice(4, "speculative", tl.SpeculativeConfig(draft_loops=2, verify_loops=4,
                                                                                   draft_ahead=3), 2.0)
    try:
        g = tl.GenerateConfig(max_tokens=12, loops=4)
        st = tl.GenerateStats()
        assert tl.generate(demo, ids, g.replace(decoder="auto"), stats=st) == tl.generate(demo, ids, g)
        assert st.decoder == "speculative"
        s = g.replace(temperature=0.8, sample_seed=7)
        sampled_same = tl.generate(demo, ids, s.replace(decoder="auto")) == tl.generate(demo, ids, s)
    finally:
        demo.decoder_choices.clear()
        demo.decoder_choices.update(before)
    bullet = _bullet(README, "* **The auto decoder**")
    if not sampled_same:
        # the README's promise of the same tokens must be limited to greedy decoding
        assert "same tokens either way" not in bullet or re.search(r"same tokens[^.]*greedy", bullet), bullet
        assert "distribution" in bullet, bullet


# ------------------------------------------------------------------------------- README: environment
def _env_row(name: str) -> str:
    m = re.search(rf"^\| `{name}[^|]*\|([^\n]*)\|$", README, re.M)
    assert m, name
    return m.group(1)


def test_tokenizer_dir_env_takes_a_tokenizer_json_as_the_readme_says(tmp_path, monkeypatch):
    """README's environment table: TINYLOOP_TOKENIZER_DIR names a tokenizer directory; the code
    takes a tokenizer.json there too (as the README's "Tokenizer precedence" says), and from
    load_model as from a run config. The table row says so."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    lib = tokenizers.Tokenizer(models.BPE())
    lib.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    lib.decoder = decoders.ByteLevel()
    lib.train_from_iterator(["def f(x):\n    return x + 1\n"] * 10,
                            trainer=trainers.BpeTrainer(vocab_size=270, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "tokenizer.json").write_text(lib.to_str(), encoding="utf-8")
    monkeypatch.setenv("TINYLOOP_TOKENIZER_DIR", str(tmp_path))
    m = tl.load_model("demo", max_seq_len=32, backend="cpu")
    try:
        text = "def f(x): return x"
        assert m.tokenizer.encode(text) == lib.encode(text).ids
    finally:
        tl.free_model(m)
    row = _env_row("TINYLOOP_TOKENIZER_DIR")
    assert "tokenizer.json" in row, row
    assert "load_model" in row, row


# ------------------------------------------------------------------------------- docs/SERVING.md
@pytest.mark.parametrize("scaffold, field", [({"text": "import os\n", "cache_mode": "no_such_mode"}, "cache_mode"),
                                             ({"text": "import os\n", "loops": 99}, "loops")])
def test_serve_config_bad_scaffold_is_refused_before_the_model_loads(monkeypatch, scaffold, field):
    """SERVING.md: "every key of the file is a ServeConfig field and an unknown key or a bad value
    is an error naming it, before the model is loaded": a scaffold's cache mode that is not
    registered, or its depth beyond the model's max_loops, is refused naming the scaffold's field
    without loading the model."""
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    import tinyloop.runtime.engine as engine
    from tinyloop.serve import ServeConfig, create_app
    loaded = []
    real = engine.load_model

    def spy(*args, **kwargs):
        loaded.append(real(*args, **kwargs))
        return loaded[-1]
    monkeypatch.setattr(engine, "load_model", spy)
    cfg = ServeConfig(backend="cpu", max_seq_len=64, scaffolds=[scaffold])
    with pytest.raises(tl.TinyLoopError) as exc:
        create_app(cfg)
    assert not loaded, "the model was loaded before the bad scaffold was refused"
    assert f"scaffolds[0].{field}" in str(exc.value), str(exc.value)
    assert str(scaffold[field]) in str(exc.value)
