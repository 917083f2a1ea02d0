"""Edges of ``tinyloop convert --hf``: cases tests/test_hf_import.py does not cover (config keys
transformers ignores or reads differently, non-float tensors, output paths that are inputs or
directories, a stray non-HF shard beside an index, conflicting loop options). Tiny shapes, CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

import tinyloop as tl  # noqa: E402
from tinyloop.cli.convert import convert_hf  # noqa: E402
from tinyloop.errors import ConfigError, ModelFormatError  # noqa: E402

from test_hf_import import _edit_config  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 42, 7, 64, 128, 11, 200, 31, 77, 9]
BASE = dict(vocab_size=301, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
_CLS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM")}


def _make(kind="llama", seed=0, **over):
    torch.manual_seed(seed)
    c, m = (getattr(transformers, n) for n in _CLS[kind])
    model = m(c(**{**BASE, **over})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn_like(p))
    return model


def _save(model, path, **kw) -> str:
    model.save_pretrained(str(path), **kw)
    return str(path)


def _hf(kind, src):
    return getattr(transformers, _CLS[kind][1]).from_pretrained(src).eval()


def _ref(m, ids=PROMPT):
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].double().numpy()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tinyloop", "convert", *args], capture_output=True,
                          text=True)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.uint8])
def test_non_float_tensor_is_refused_up_front(tmp_path, dtype):
    """A tensor of an integer / bool dtype under a weight's name is not a weight: refused by name
    with its dtype, as `convert --checkpoint` does (it was silently cast to float32)."""
    src = _save(_make(), tmp_path / "m")
    f = os.path.join(src, "model.safetensors")
    t = safetensors_numpy.load_file(f)
    t["model.layers.1.self_attn.k_proj.weight"] = np.zeros((16, 32), dtype)
    safetensors_numpy.save_file(t, f)
    out = str(tmp_path / "o.tinyloop")
    with pytest.raises(ModelFormatError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight: dtype"):
        convert_hf(src, out, quant="f32")
    assert not os.path.exists(out)


def test_llama_ignores_sliding_window_like_transformers(tmp_path):
    """LlamaForCausalLM has no sliding window (transformers ignores the key); a Llama config that
    carries one must not get a window here either."""
    src = _save(_make(seed=1), tmp_path / "m")
    _edit_config(src, sliding_window=4)
    m = _hf("llama", src)
    model = tl.load_model(convert_hf(src, str(tmp_path / "o.tinyloop"), quant="f32")["output"],
                          backend="cpu", max_seq_len=32)
    try:
        assert model.cfg.sliding_window == 0
        ref = _ref(m)
        assert np.abs(tl.score(model, PROMPT, cache_mode="fp32") - ref).max() <= 1e-4 * np.abs(ref).max()
    finally:
        tl.free_model(model)


@pytest.mark.parametrize("max_window_layers, windowed", [(28, False), (3, False), (0, True)])
def test_qwen2_max_window_layers_as_transformers(tmp_path, max_window_layers, windowed):
    """Qwen2 (a transformers 4 config: no layer_types): with use_sliding_window, layers from
    max_window_layers on use the window; max_window_layers >= the layer count means none does
    (the window was applied to every layer), 0 means every layer does (it was refused)."""
    src = _save(_make("qwen2", seed=2), tmp_path / "m")
    _edit_config(src, layer_types=None, use_sliding_window=True, sliding_window=4,
                 max_window_layers=max_window_layers)
    m = _hf("qwen2", src)
    assert ("sliding_attention" in m.config.layer_types) == windowed
    model = tl.load_model(convert_hf(src, str(tmp_path / "o.tinyloop"), quant="f32")["output"],
                          backend="cpu", max_seq_len=32)
    try:
        assert model.cfg.sliding_window == (4 if windowed else 0)
        ref = _ref(m)
        if windowed:
            got = tl.score_decoded(model, PROMPT, tl.GenerateConfig(cache_mode="fp32", cache_window=4))
        else:
            got = tl.score(model, PROMPT, cache_mode="fp32")
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    finally:
        tl.free_model(model)


@pytest.mark.parametrize("kind, changes, window", [
    # transformers 5 reads Qwen2's layer_types over max_window_layers
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=28,
                   layer_types=["sliding_attention"] * 3), 4),
    ("qwen2", dict(use_sliding_window=False, sliding_window=4, layer_types=["full_attention"] * 3), 0),
    # Mistral windows every layer whatever layer_types says; Llama never windows
    ("mistral", dict(sliding_window=4, layer_types=["full_attention"] * 3), 4),
    ("llama", dict(sliding_window=4, layer_types=["full_attention"] * 3), 0),
])
def test_layer_types_read_as_transformers(tmp_path, kind, changes, window):
    src = _save(_make(kind, seed=7), tmp_path / "m")
    _edit_config(src, **changes)
    m = _hf(kind, src)
    model = tl.load_model(convert_hf(src, str(tmp_path / "o.tinyloop"), quant="f32")["output"],
                          backend="cpu", max_seq_len=32)
    try:
        assert model.cfg.sliding_window == window
        ref = _ref(m)
        got = tl.score_decoded(model, PROMPT, tl.GenerateConfig(cache_mode="fp32", cache_window=window)) \
            if window else tl.score(model, PROMPT, cache_mode="fp32")
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    finally:
        tl.free_model(model)


@pytest.mark.parametrize("changes", [
    dict(layer_types=None, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    dict(use_sliding_window=True, sliding_window=4,
         layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
])
def test_qwen2_mixed_windows_still_refused(tmp_path, changes):
    src = _save(_make("qwen2", seed=2), tmp_path / "m")
    _edit_config(src, **changes)
    with pytest.raises(ModelFormatError, match="per-layer windows"):
        convert_hf(src, str(tmp_path / "o.tinyloop"), quant="f32")


@pytest.mark.parametrize("target", ["model.safetensors", "config.json"])
def test_output_over_an_input_file_is_refused(tmp_path, target):
    """-o naming one of the checkpoint's own files replaced it (the source shard was lost)."""
    src = _save(_make(seed=3), tmp_path / "m")
    p = os.path.join(src, target)
    before = open(p, "rb").read()
    with pytest.raises(ConfigError, match="input"):
        convert_hf(src, p, quant="f32")
    assert open(p, "rb").read() == before
    r = _cli("--hf", src, "-o", p, "--quant", "f32")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr
    assert open(p, "rb").read() == before


def test_output_that_is_a_directory_is_refused_up_front(tmp_path):
    src = _save(_make(seed=3), tmp_path / "m")
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        convert_hf(src, str(outdir), quant="f32")
    assert sorted(os.listdir(tmp_path)) == ["m", "outdir"] and not os.listdir(outdir)
    r = _cli("--hf", src, "-o", str(outdir), "--quant", "f32")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "is a directory" in r.stderr


def test_index_json_selects_the_shards(tmp_path):
    """A hub snapshot (Mistral's) holds the original-format consolidated.safetensors beside the
    HF shards and their index: transformers reads the shards the index names, so must convert."""
    m = _make(seed=4)
    src = _save(m, tmp_path / "m", max_shard_size="20KB")
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json"))
    safetensors_numpy.save_file({"layers.0.attention.wq.weight": np.ones((32, 32), np.float32)},
                                os.path.join(src, "consolidated.safetensors"))
    model = tl.load_model(convert_hf(src, str(tmp_path / "o.tinyloop"), quant="f32")["output"],
                          backend="cpu", max_seq_len=32)
    try:
        ref = _ref(m)
        assert np.abs(tl.score(model, PROMPT, cache_mode="fp32") - ref).max() <= 1e-4 * np.abs(ref).max()
    finally:
        tl.free_model(model)


def test_max_loops_below_loops_is_refused(tmp_path):
    """--max-loops below --loops conflicts (it was silently raised to --loops)."""
    m = _make(seed=5, num_hidden_layers=4)
    with torch.no_grad():
        m.model.layers[2].load_state_dict(m.model.layers[1].state_dict())
    src = _save(m, tmp_path / "m")
    with pytest.raises(ConfigError, match="max_loops=1"):
        convert_hf(src, str(tmp_path / "o.tinyloop"), quant="f32", loop_layers="1:2", loops=2, max_loops=1)
    r = _cli("--hf", src, "-o", str(tmp_path / "o.tinyloop"), "--loop-layers", "1:2", "--loops", "2",
             "--max-loops", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "max_loops" in r.stderr
    assert not os.path.exists(tmp_path / "o.tinyloop")


def test_converted_model_runs_text_and_loop_layers_keep_logits(tmp_path):
    """bos/eos from config.json are embedded; load_model + generate_text work; any --loop-layers
    A:B at L = 1 is the original stack."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=290, special_tokens=["<s>", "</s>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the loop runs again and again, then it exits"] * 10, tr)
    m = _make(seed=6, bos_token_id=0, eos_token_id=1)
    src = _save(m, tmp_path / "m")
    tok.save(os.path.join(src, "tokenizer.json"))
    ref = _ref(m)
    for ll in (None, "0:1", "1:3", "0:3"):
        out = str(tmp_path / f"o{ll}.tinyloop".replace(":", "_"))
        convert_hf(src, out, quant="f32", loop_layers=ll)
        model = tl.load_model(out, backend="cpu", max_seq_len=64)
        try:
            assert (model.cfg.bos_id, model.cfg.eos_id) == (0, 1)
            got = tl.score(model, PROMPT, cache_mode="fp32")
            assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
            text = tl.generate_text(model, "the loop", tl.GenerateConfig(max_tokens=4, cache_mode="fp32"))
            assert isinstance(text, str)
        finally:
            tl.free_model(model)
