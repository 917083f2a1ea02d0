"""Hugging Face import (``tinyloop convert --hf``) against transformers itself: tiny random
Llama / Mistral / Qwen2 checkpoints written by ``save_pretrained``, converted at f32, must give
transformers' logits and greedy tokens. Needs torch and transformers (the torch extra; CI installs
the CPU build); skipped without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tinyloop as tl  # noqa: E402
from tinyloop.cli.convert import convert_hf  # noqa: E402
from tinyloop.errors import ConfigError, IncompatibleModesError, ModelFormatError  # noqa: E402

from conftest import check_decode_modes  # noqa: E402

V = 320
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, initializer_range=0.08, tie_word_embeddings=False, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
PROMPT = [5, 17, 99, 3, 250, 42, 7, 64, 128, 11, 200, 31, 77, 9]


def _make(kind: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    cfg = cls[0](**{**BASE, **over})
    if kind != "mistral":
        cfg.sliding_window = over.get("sliding_window")
    m = cls[1](cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))     # Qwen2's q/k/v biases: nonzero
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn_like(p))
    return m


def _save(m, path, **kw) -> str:
    m.save_pretrained(str(path), **kw)
    return str(path)


def _hf_logits(m, ids) -> np.ndarray:
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].double().numpy()


def _hf_greedy(m, ids, n) -> list:
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0].tolist()


def _convert(src, tmp_path, name="m.tinyloop", **kw) -> str:
    out = str(tmp_path / name)
    convert_hf(src, out, quant=kw.pop("quant", "f32"), **kw)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind, over in (("llama", {}), ("llama_tied", dict(tie_word_embeddings=True)),
                       ("qwen2", {}), ("mistral", dict(sliding_window=6))):
        m = _make(kind.split("_")[0], seed=len(out), **over)
        out[kind] = (m, _save(m, root / kind))
    return out


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2"])
def test_logits_and_greedy_tokens_equal_transformers(checkpoints, kind, tmp_path):
    m, src = checkpoints[kind]
    path = _convert(src, tmp_path)
    model = tl.load_model(path, backend="cpu", max_seq_len=64)
    cfg = model.cfg
    assert (cfg.n_pre, cfg.n_loop, cfg.n_post, cfg.default_loops) == (2, 1, 0, 1)
    assert cfg.qkv_bias == (kind == "qwen2") and cfg.tied_embeddings == (kind == "llama_tied")
    ref = _hf_logits(m, PROMPT)
    got = tl.score(model, PROMPT, cache_mode="fp32")
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    want = _hf_greedy(m, PROMPT, 12)
    res = tl.generate(model, PROMPT, tl.GenerateConfig(max_tokens=12, cache_mode="fp32"))
    assert list(res) == want


@pytest.mark.parametrize("where", ["generation_config", "config", "both"])
def test_eos_lists_stop_where_transformers_stops(checkpoints, tmp_path, where):
    """A chat checkpoint lists several end ids (Llama 3: end of text, end of message, end of turn):
    every id either file lists ends generation, where transformers' generate stops with the
    generation config's list; the first id is eos_id, the others extra_eos_ids; text drops them."""
    import shutil
    m, src0 = checkpoints["llama"]
    free = _hf_greedy(m, PROMPT, 16)[len(PROMPT):]
    # three end ids: one never emitted, then the 6th and the 4th generated tokens: the earliest wins
    firsts = [t for i, t in enumerate(free) if t not in free[:i]]
    ends = [next(t for t in range(V) if t not in free), firsts[5], firsts[3]]
    stop_at = free.index(firsts[3])
    src = str(tmp_path / "chat")
    shutil.copytree(src0, src)
    lists = {"generation_config": ("generation_config.json",), "config": ("config.json",),
             "both": ("config.json", "generation_config.json")}[where]
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(src, name)
        d = json.load(open(path)) if os.path.exists(path) else {}
        d["eos_token_id"] = ends if name in lists else None
        json.dump(d, open(path, "w"))
    with torch.no_grad():
        want = m.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                          eos_token_id=ends)[0].tolist()
    assert want == PROMPT + free[:stop_at + 1]
    model = tl.load_model(_convert(src, tmp_path), backend="cpu", max_seq_len=64)
    try:
        assert model.cfg.eos_id == ends[0] and model.cfg.extra_eos_ids == tuple(ends[1:])
        st = tl.GenerateStats()
        assert tl.generate(model, PROMPT, tl.GenerateConfig(max_tokens=16, cache_mode="fp32"), stats=st) == want
        assert st.stop_reason == tl.StopReason.EOS
        pieces = list(tl.stream_text(model, PROMPT, tl.GenerateConfig(max_tokens=16, cache_mode="fp32")))
        assert "".join(pieces) == model.tokenizer.decode(free[:stop_at], continuation=True)
    finally:
        tl.free_model(model)


@pytest.mark.parametrize("scaling", [
    dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=3.0, original_max_position_embeddings=20),
    dict(rope_type="linear", factor=2.5)])
def test_scaled_rope_equals_transformers(tmp_path, scaling):
    """Llama 3.1 / 3.2 checkpoints scale their RoPE frequencies ("llama3"; "linear" too): logits and
    greedy tokens equal transformers' with the same scaling, the parameters land in the header, and
    the scaled model runs every decode mode (the CPU backend)."""
    m = _make("llama", seed=11, rope_theta=500000.0, rope_scaling=dict(scaling))
    src = _save(m, tmp_path / "scaled")
    model = tl.load_model(_convert(src, tmp_path), backend="cpu", max_seq_len=64)
    try:
        cfg = model.cfg
        assert cfg.rope_scaling == scaling["rope_type"] and cfg.rope_factor == scaling["factor"]
        assert cfg.rope_theta == 500000.0
        if scaling["rope_type"] == "llama3":
            assert cfg.rope_original_max_positions == scaling["original_max_position_embeddings"]
        ref = _hf_logits(m, PROMPT)
        got = tl.score(model, PROMPT, cache_mode="fp32")
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
        want = _hf_greedy(m, PROMPT, 12)
        assert list(tl.generate(model, PROMPT, tl.GenerateConfig(max_tokens=12, cache_mode="fp32"))) == want
    finally:
        tl.free_model(model)
    plain = _make("llama", seed=11, rope_theta=500000.0)
    assert np.abs(_hf_logits(plain, PROMPT) - ref).max() > 1e-3 * np.abs(ref).max()   # the scaling matters here


def test_mistral_sliding_window_equals_transformers(checkpoints, tmp_path):
    m, src = checkpoints["mistral"]
    path = _convert(src, tmp_path)
    model = tl.load_model(path, backend="cpu", max_seq_len=64)
    assert model.cfg.sliding_window == 6
    ref = _hf_logits(m, PROMPT)          # 14 positions: the window cuts in from position 6 on
    with pytest.raises(IncompatibleModesError, match="sliding_window=6"):
        tl.score(model, PROMPT, cache_mode="fp32")
    got = tl.score_decoded(model, PROMPT, tl.GenerateConfig(cache_mode="fp32", cache_window=6))
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    full = _hf_logits(_make("mistral", seed=3, sliding_window=None), PROMPT)
    assert np.abs(full - ref).max() > 1e-3       # the window matters for this prompt
    want = _hf_greedy(m, PROMPT, 8)
    res = tl.generate(model, PROMPT, tl.GenerateConfig(max_tokens=8, cache_mode="fp32", cache_window=6))
    assert list(res) == want


def test_bf16_sharded_checkpoint_with_index(tmp_path):
    m = _make("qwen2", seed=7).to(torch.bfloat16)
    src = _save(m, tmp_path / "q", max_shard_size="100KB")
    assert any(f.endswith(".index.json") for f in os.listdir(src))
    path = _convert(src, tmp_path)
    model = tl.load_model(path, backend="cpu", max_seq_len=64)
    ref = _hf_logits(m.float(), PROMPT)        # bf16 weights widen to float32 exactly
    got = tl.score(model, PROMPT, cache_mode="fp32")
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    # a shard that went missing is named
    shards = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    os.unlink(os.path.join(src, shards[-1]))
    with pytest.raises(ModelFormatError, match="no shard holds"):
        _convert(src, tmp_path, "again.tinyloop")


def test_weight_tied_loop_layers(tmp_path):
    """Layers 1, 2 stored twice (1..2 = 3..4) become a two-layer loop run twice, and the model
    can then run it at other depths."""
    m = _make("llama", seed=4, num_hidden_layers=6)
    with torch.no_grad():
        for j in (1, 2):
            m.model.layers[j + 2].load_state_dict(m.model.layers[j].state_dict())
    src = _save(m, tmp_path / "tied")
    path = _convert(src, tmp_path, loop_layers="1:3", loops=2, max_loops=6)
    model = tl.load_model(path, backend="cpu", max_seq_len=64)
    c = model.cfg
    assert (c.n_pre, c.n_loop, c.n_post, c.default_loops, c.max_loops) == (1, 2, 1, 2, 6)
    ref = _hf_logits(m, PROMPT)
    got = tl.score(model, PROMPT, cache_mode="fp32")
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    deeper = tl.score(model, PROMPT, loops=3, cache_mode="fp32")
    assert np.abs(deeper - ref).max() > 1e-3
    with pytest.raises(ModelFormatError, match="not weight-tied copies"):
        _convert(src, tmp_path, "bad.tinyloop", loop_layers="0:2", loops=2)


def test_tokenizer_json_is_embedded(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the loop runs again and again, then it exits early"] * 20, tr)
    m = _make("llama", seed=5, eos_token_id=tok.token_to_id("<|end|>"))
    src = _save(m, tmp_path / "t")
    tok.save(os.path.join(src, "tokenizer.json"))
    path = _convert(src, tmp_path)
    model = tl.load_model(path, backend="cpu", max_seq_len=64)
    assert model.cfg.eos_id == tok.token_to_id("<|end|>")
    text = "the loop exits"
    assert model.tokenizer.encode(text) == tok.encode(text).ids
    assert model.tokenizer.decode(tok.encode(text).ids) == text
    info = tl.inspect(path)["tokenizer"]
    assert (info["type"], info["model"], info["tokens"]) == ("hf", "BPE", tok.get_vocab_size())
    del tokenizers


CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_chat_template_equals_transformers(tmp_path):
    """The checkpoint's chat template is embedded, and apply_chat_template renders and tokenizes a
    conversation as transformers' apply_chat_template does (text and ids; tools through tojson,
    non-ASCII text, the template's own raise_exception as a TokenizerError)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|tools|>"]
    tr = trainers.BpeTrainer(vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the loop runs again and again, then it exits early"] * 20, tr)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>")
    hf_tok.chat_template = CHAT_TEMPLATE
    m = _make("llama", seed=5, bos_token_id=tok.token_to_id("<|begin|>"), eos_token_id=tok.token_to_id("<|end|>"))
    src = _save(m, tmp_path / "chat")
    hf_tok.save_pretrained(src)
    model = tl.load_model(_convert(src, tmp_path), backend="cpu", max_seq_len=64)
    try:
        assert model.tokenizer.chat_template == CHAT_TEMPLATE
        convo = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "the loop — ça runs?"},
                 {"role": "assistant", "content": "again"}, {"role": "user", "content": "then?"}]
        tools = [{"name": "exit", "description": "ends the loop", "parameters": {"type": "object"}}]
        for kw in (dict(), dict(add_generation_prompt=False), dict(tools=tools)):
            want_text = hf_tok.apply_chat_template(convo, tokenize=False, **{"add_generation_prompt": True, **kw})
            assert tl.apply_chat_template(model, convo, tokenize=False, **kw) == want_text
            want = hf_tok.apply_chat_template(convo, tokenize=True, **{"add_generation_prompt": True, **kw})
            want = list(want["input_ids"] if hasattr(want, "keys") else want)
            got = tl.apply_chat_template(model, convo, **kw)
            assert got == want and got[0] == model.cfg.bos_id and got.count(model.cfg.bos_id) == 1
        out = tl.generate(model, tl.apply_chat_template(model, convo), tl.GenerateConfig(max_tokens=4))
        assert len(out) == len(tl.apply_chat_template(model, convo)) + 4 or out[-1] == model.cfg.eos_id
        with pytest.raises(tl.TokenizerError, match="system message must come first"):
            tl.apply_chat_template(model, convo[1:] + convo[:1])
        for bad in ("hi", [], [{"role": "user"}], [{"role": 3, "content": "x"}], [{"role": "user", "content": 5}],
                    [("user", "x")]):
            with pytest.raises(tl.InvalidInputError):
                tl.apply_chat_template(model, bad)
        with pytest.raises(tl.InvalidInputError, match="set by the renderer"):
            tl.apply_chat_template(model, convo, bos_token="x")
        with pytest.raises(tl.InvalidInputError, match="tokenize"):
            tl.apply_chat_template(model, convo, tokenize="yes")
    finally:
        tl.free_model(model)
    plain = tl.load_model(_convert(checkpoints_dir := _save(_make("llama", seed=2), tmp_path / "plain"), tmp_path,
                                   name="plain.tinyloop"), backend="cpu")
    try:
        with pytest.raises(tl.TokenizerError, match="no chat template"):
            tl.apply_chat_template(plain, convo)
    finally:
        tl.free_model(plain)
    del checkpoints_dir


def _edit_config(src, **changes):
    p = os.path.join(src, "config.json")
    with open(p) as f:
        d = json.load(f)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    with open(p, "w") as f:
        json.dump(d, f)


@pytest.mark.parametrize("changes, match", [
    (dict(architectures=["GPT2LMHeadModel"]), "not supported"),
    (dict(architectures=["RavenForCausalLM"]), "RavenForCausalLM checkpoint"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks \\['low_freq_factor'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "only plain, linear and llama3 RoPE"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "no YaRN / dynamic"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "attention_factor": 0.5}), "attention scaling"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                        "original_max_position_embeddings": 8}), "rope_low_freq_factor=4.0 must be below"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
          rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4}), "disagree"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_local_experts=8), "mixture-of-experts"),
    (dict(num_hidden_layers=4), "missing tensor"),
    (dict(hidden_size=None), "lacks"),
    (dict(layer_types=["full_attention", "sliding_attention", "full_attention"]), "has no sliding window"),
])
def test_refusals_name_the_reason(tmp_path, changes, match):
    src = _save(_make("llama", seed=6), tmp_path / "r")
    _edit_config(src, **changes)
    with pytest.raises(ModelFormatError, match=match):
        _convert(src, tmp_path)
    assert not os.path.exists(tmp_path / "m.tinyloop")


def test_every_problem_is_listed_and_unexpected_tensors_named(tmp_path):
    from safetensors.numpy import load_file, save_file
    src = _save(_make("llama", seed=8), tmp_path / "u")
    f = os.path.join(src, "model.safetensors")
    t = load_file(f)
    t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, f)
    with pytest.raises(ModelFormatError) as e:
        _convert(src, tmp_path)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value)
    assert "model.layers.0.self_attn.o_proj.bias" in str(e.value)


@pytest.mark.parametrize("kw, match", [
    (dict(loop_layers="x"), "A:B"), (dict(loop_layers="2:1"), "0 <= A < B"),
    (dict(loop_layers=(0, 9)), "0 <= A < B"), (dict(loops=0), "loops"),
    (dict(loops=True), "loops"), (dict(max_loops="4"), "max_loops"),
    (dict(loop_layers="1:3", loops=2), "need layers up to"),
])
def test_bad_arguments_are_config_errors(checkpoints, tmp_path, kw, match):
    _, src = checkpoints["llama"]
    with pytest.raises(ConfigError, match=match):
        _convert(src, tmp_path, **kw)


def test_cli(checkpoints, tmp_path):
    _, src = checkpoints["qwen2"]
    out = str(tmp_path / "cli.tinyloop")
    run = [sys.executable, "-m", "tinyloop", "convert"]
    r = subprocess.run(run + ["--hf", src, "-o", out, "--quant", "q8", "--group-size", "32"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "Qwen2ForCausalLM" in r.stdout and os.path.exists(out)
    r = subprocess.run(run + ["--hf", src, "--config", "c.json", "-o", out], capture_output=True, text=True)
    assert r.returncode == 2 and "either --hf DIR or --checkpoint" in r.stderr
    r = subprocess.run(run + ["--hf", str(tmp_path / "nope"), "-o", out], capture_output=True, text=True)
    assert r.returncode == 2 and "error:" in r.stderr


def test_modes_run_on_a_converted_looped_model(tmp_path):
    """A Qwen2 checkpoint whose layers 1, 2 are stored twice, converted at q4 to a two-layer loop:
    every cache mode, chain and tree speculation, warm start, prefix reuse and early exit run on
    it, and the exact ones give plain greedy decoding's tokens."""
    m = _make("qwen2", seed=9, num_hidden_layers=5)
    with torch.no_grad():
        for j in (1, 2):
            m.model.layers[j + 2].load_state_dict(m.model.layers[j].state_dict())
    src = _save(m, tmp_path / "looped")
    path = _convert(src, tmp_path, quant="q4", group_size=32, loop_layers="1:3", loops=2, max_loops=4)
    model = tl.load_model(path, backend="cpu", max_seq_len=96)
    try:
        assert (model.cfg.n_pre, model.cfg.n_loop, model.cfg.n_post, model.cfg.qkv_bias) == (1, 2, 0, True)
        check_decode_modes(model, PROMPT)
    finally:
        tl.free_model(model)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["llama", "qwen2", "mistral"]), heads=st.sampled_from([(2, 1), (4, 2), (4, 4), (8, 2)]),
       head_dim=st.sampled_from([8, 16]), layers=st.integers(1, 3), tied=st.booleans(),
       ff=st.sampled_from([32, 48]), seed=st.integers(0, 2 ** 16))
def test_random_shapes_match_transformers(tmp_path, kind, heads, head_dim, layers, tied, ff, seed):
    """Any head layout (GQA ratios, head_dim apart from hidden / heads), depth and tying: the
    converted model's logits are transformers'."""
    h, kvh = heads
    m = _make(kind, seed=seed, hidden_size=32, num_attention_heads=h, num_key_value_heads=kvh,
              head_dim=head_dim, num_hidden_layers=layers, tie_word_embeddings=tied, intermediate_size=ff)
    src = _save(m, tmp_path / f"h{seed}_{kind}_{h}_{kvh}_{head_dim}_{layers}_{tied}_{ff}")
    path = _convert(src, tmp_path, f"h{seed}_{kind}_{h}_{kvh}_{head_dim}_{layers}_{tied}_{ff}.tinyloop")
    model = tl.load_model(path, backend="cpu", max_seq_len=32)
    try:
        ids = PROMPT[:10]
        ref = _hf_logits(m, ids)
        got = tl.score(model, ids, cache_mode="fp32")
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    finally:
        tl.free_model(model)
