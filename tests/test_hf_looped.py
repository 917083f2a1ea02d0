"""Hugging Face import of the looped layouts, Huginn-0125 (raven) and Ouro, against PyTorch
references written here from the published architectures (the papers' descriptions and the
config fields; transformers has neither model): tiny random checkpoints in each layout's tensor
names, converted at f32, must give the reference's logits at several depths and its greedy tokens.
Needs torch (the torch extra); skipped without it."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import tinyloop as tl  # noqa: E402
from tinyloop.cli.convert import convert_hf  # noqa: E402
from tinyloop.errors import ConfigError, ModelFormatError  # noqa: E402
from tinyloop.model.format import open_model  # noqa: E402
from tinyloop.model.hf_looped import interleaved_to_half  # noqa: E402

from conftest import check_decode_modes  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 42, 7, 64, 128, 11, 200, 31]
V = 300


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _attend(q, k, v, H, Hkv, D):
    T = q.shape[0]
    q = q.view(T, H, D).transpose(0, 1)
    k = k.view(T, Hkv, D).transpose(0, 1).repeat_interleave(H // Hkv, 0)
    v = v.view(T, Hkv, D).transpose(0, 1).repeat_interleave(H // Hkv, 0)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, H * D)


def _rope_interleaved(x, H, D, theta):
    """RoPE on consecutive pairs (x[2i], x[2i+1]) as complex numbers (Huginn's form)."""
    T = x.shape[0]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    rot = torch.polar(torch.ones_like(ang), ang).to(torch.complex64)      # (T, D/2)
    xc = torch.view_as_complex(x.view(T, H, D // 2, 2).contiguous())
    return torch.view_as_real(xc * rot[:, None, :]).reshape(T, H * D)


def _rope_half(x, H, D, theta):
    T = x.shape[0]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    c, s = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    xh = x.view(T, H, D)
    a, b = xh[..., : D // 2], xh[..., D // 2:]
    return torch.cat([a * c - b * s, a * s + b * c], -1).reshape(T, H * D)


# =============================================================================== Huginn (raven)
HUGINN = dict(architectures=["RavenForCausalLM"], model_type="huginn_raven", n_embd=48, n_heads=4,
              num_key_value_heads=4, intermediate_size=80, n_layers_in_prelude=1,
              n_layers_in_recurrent_block=2, n_layers_in_coda=1, mean_recurrence=3, vocab_size=V,
              padded_vocab_size=V, norm_eps=1e-6, rope_base=50000.0, tie_embeddings=False,
              qk_bias=True, bias=False, block_class_name="SandwichBlock", mlp_class_name="GatedMLP",
              nonlin_name="SiLU", norm_class_name="RMSNorm_llama", injection_type="linear",
              state_init="like-init", test_time_noise=0, block_size=256)


def huginn_tensors(c: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    d, H, ff = c["n_embd"], c["n_heads"], c["intermediate_size"]
    D = d // H
    kv = c["num_key_value_heads"] * D

    def r(*shape, std=0.12):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return 1.0 + 0.1 * torch.randn(d, generator=g)

    t = {"transformer.wte.weight": r(c["padded_vocab_size"], d, std=0.15),
         "transformer.adapter.weight": r(d, 2 * d, std=0.15), "transformer.ln_f.weight": norm()}
    for src, n in (("prelude", c["n_layers_in_prelude"]), ("core_block", c["n_layers_in_recurrent_block"]),
                   ("coda", c["n_layers_in_coda"])):
        for i in range(n):
            p = f"transformer.{src}.{i}."
            for k in range(1, 5):
                t[p + f"norm_{k}.weight"] = norm()
            t[p + "attn.Wqkv.weight"] = r(d + 2 * kv, d)
            if c["qk_bias"]:
                t[p + "attn.qk_bias"] = r(2, 1, H, D, std=0.3)
            t[p + "attn.proj.weight"] = r(d, d)
            t[p + "mlp.fc.weight"] = r(2 * ff, d)
            t[p + "mlp.proj.weight"] = r(d, ff)
    if not c["tie_embeddings"]:
        t["lm_head.weight"] = r(c["padded_vocab_size"], d, std=1.0)
    return t


def huginn_reference(c: dict, t: dict, ids, steps: int, s0=None) -> torch.Tensor:
    """Huginn-0125's forward: scaled embedding, sandwich prelude, `steps` recurrences of
    adapter([state; e]) + sandwich core from a zero state (or the given initial state s0), ln_f,
    sandwich coda, ln_f, head."""
    d, H, eps = c["n_embd"], c["n_heads"], c["norm_eps"]
    Hkv = c["num_key_value_heads"]
    D = d // H

    def block(p, x):
        h = _rms(x, t[p + "norm_1.weight"], eps)
        q, k, v = (h @ t[p + "attn.Wqkv.weight"].T).split([d, Hkv * D, Hkv * D], -1)
        if c["qk_bias"]:
            q = q + t[p + "attn.qk_bias"][0].reshape(-1)
            k = k + t[p + "attn.qk_bias"][1].reshape(-1)
        q, k = _rope_interleaved(q, H, D, c["rope_base"]), _rope_interleaved(k, Hkv, D, c["rope_base"])
        x = _rms(_attend(q, k, v, H, Hkv, D) @ t[p + "attn.proj.weight"].T + x, t[p + "norm_2.weight"], eps)
        a, b = (_rms(x, t[p + "norm_3.weight"], eps) @ t[p + "mlp.fc.weight"].T).chunk(2, -1)
        return _rms((F.silu(a) * b) @ t[p + "mlp.proj.weight"].T + x, t[p + "norm_4.weight"], eps)

    with torch.no_grad():
        x = t["transformer.wte.weight"][torch.tensor(ids)] * math.sqrt(d)
        for i in range(c["n_layers_in_prelude"]):
            x = block(f"transformer.prelude.{i}.", x)
        s = torch.zeros_like(x) if s0 is None else torch.as_tensor(s0, dtype=x.dtype)
        for _ in range(steps):
            s = torch.cat([s, x], -1) @ t["transformer.adapter.weight"].T
            for j in range(c["n_layers_in_recurrent_block"]):
                s = block(f"transformer.core_block.{j}.", s)
        s = _rms(s, t["transformer.ln_f.weight"], eps)
        for i in range(c["n_layers_in_coda"]):
            s = block(f"transformer.coda.{i}.", s)
        s = _rms(s, t["transformer.ln_f.weight"], eps)
        head = t["transformer.wte.weight"] if c["tie_embeddings"] else t["lm_head.weight"]
        return s @ head.T


# =============================================================================== Ouro
OURO = dict(architectures=["OuroForCausalLM"], model_type="ouro", vocab_size=V, hidden_size=48,
            intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, total_ut_steps=3,
            hidden_act="silu", max_position_embeddings=256,
            layer_types=["full_attention"] * 3, sliding_window=None, use_sliding_window=False)


def ouro_tensors(c: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    d, H, Hkv, ff = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    D = d // H

    def r(*shape, std=0.12):
        return torch.randn(*shape, generator=g) * std

    t = {"model.embed_tokens.weight": r(V, d, std=1.0), "model.norm.weight": 1.0 + 0.1 * torch.randn(d, generator=g),
         "model.early_exit_gate.weight": r(1, d, std=0.3), "model.early_exit_gate.bias": r(1, std=0.3)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            t[p + n + ".weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
        t[p + "self_attn.q_proj.weight"] = r(H * D, d)
        t[p + "self_attn.k_proj.weight"] = r(Hkv * D, d)
        t[p + "self_attn.v_proj.weight"] = r(Hkv * D, d)
        t[p + "self_attn.o_proj.weight"] = r(d, H * D)
        t[p + "mlp.gate_proj.weight"] = r(ff, d)
        t[p + "mlp.up_proj.weight"] = r(ff, d)
        t[p + "mlp.down_proj.weight"] = r(d, ff)
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = r(V, d, std=1.0)
    return t


def ouro_reference(c: dict, t: dict, ids, steps: int):
    """Ouro's forward: every layer (sublayer outputs normed before the residual add) looped
    `steps` times, each step ending in model.norm; the head on the last state. Also returns
    each step's exit-gate logit."""
    d, H, Hkv, eps = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    D = d // H
    gates = []
    with torch.no_grad():
        x = t["model.embed_tokens.weight"][torch.tensor(ids)]
        for _ in range(steps):
            for i in range(c["num_hidden_layers"]):
                p = f"model.layers.{i}."
                h = _rms(x, t[p + "input_layernorm.weight"], eps)
                q = _rope_half(h @ t[p + "self_attn.q_proj.weight"].T, H, D, c["rope_theta"])
                k = _rope_half(h @ t[p + "self_attn.k_proj.weight"].T, Hkv, D, c["rope_theta"])
                v = h @ t[p + "self_attn.v_proj.weight"].T
                a = _attend(q, k, v, H, Hkv, D) @ t[p + "self_attn.o_proj.weight"].T
                x = x + _rms(a, t[p + "input_layernorm_2.weight"], eps)
                h = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
                m = (F.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)) \
                    @ t[p + "mlp.down_proj.weight"].T
                x = x + _rms(m, t[p + "post_attention_layernorm_2.weight"], eps)
            x = _rms(x, t["model.norm.weight"], eps)
            gates.append((x @ t["model.early_exit_gate.weight"].T + t["model.early_exit_gate.bias"])[:, 0])
        head = t["model.embed_tokens.weight"] if c["tie_word_embeddings"] else t["lm_head.weight"]
        return x @ head.T, gates


# =============================================================================== helpers
LAYOUTS = {"huginn": (HUGINN, huginn_tensors, huginn_reference, "mean_recurrence"),
           "ouro": (OURO, ouro_tensors, lambda c, t, ids, L: ouro_reference(c, t, ids, L)[0], "total_ut_steps")}


def _write(path, config: dict, tensors: dict) -> str:
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def _checkpoint(tmp_path, layout: str, seed: int = 0, **over):
    base, make, ref, _ = LAYOUTS[layout]
    c = {**base, **over}
    t = make(c, seed)
    return c, t, _write(tmp_path / f"{layout}{seed}", c, t)


def _convert(src, tmp_path, name="m.tinyloop", **kw) -> str:
    out = str(tmp_path / name)
    convert_hf(src, out, quant=kw.pop("quant", "f32"), **kw)
    return out


def _greedy(logits_fn, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(torch.argmax(logits_fn(ids)[-1])))
    return ids


# =============================================================================== tests
def test_interleaved_permutation_turns_pair_rope_into_half_split():
    H, D, T = 3, 8, 5
    x = torch.randn(T, H * D)
    perm = torch.tensor(interleaved_to_half(H, D))
    assert sorted(perm.tolist()) == list(range(H * D))
    a = _rope_interleaved(x, H, D, 1e4)[:, perm]
    b = _rope_half(x[:, perm], H, D, 1e4)
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("layout", ["huginn", "ouro"])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_the_reference_at_every_depth(layout, tied, tmp_path):
    key = "tie_embeddings" if layout == "huginn" else "tie_word_embeddings"
    c, t, src = _checkpoint(tmp_path, layout, seed=int(tied), **{key: tied})
    if tied:
        t.pop("lm_head.weight", None)
    path = _convert(src, tmp_path, max_loops=6)
    ref_fn = LAYOUTS[layout][2]
    model = tl.load_model(path, backend="cpu", max_seq_len=64)
    try:
        cfg = model.cfg
        assert cfg.default_loops == 3 and cfg.max_loops == 6 and cfg.tied_embeddings == tied
        for L in (1, 3, 6):
            ref = ref_fn(c, t, PROMPT, L).double().numpy()
            got = tl.score(model, PROMPT, loops=L, cache_mode="fp32")
            assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max(), L
    finally:
        tl.free_model(model)


@pytest.mark.parametrize("layout", ["huginn", "ouro"])
def test_greedy_tokens_equal_the_reference(layout, tmp_path):
    c, t, src = _checkpoint(tmp_path, layout, seed=4)
    path = _convert(src, tmp_path, max_loops=4)
    ref_fn = LAYOUTS[layout][2]
    model = tl.load_model(path, backend="cpu", max_seq_len=64)
    try:
        for L in (2, 4):
            want = _greedy(lambda ids: ref_fn(c, t, ids, L), PROMPT, 10)
            got = tl.generate(model, PROMPT, tl.GenerateConfig(max_tokens=10, loops=L, cache_mode="fp32"))
            assert list(got) == want, L
    finally:
        tl.free_model(model)


def test_huginn_mapping(tmp_path):
    c, t, src = _checkpoint(tmp_path, "huginn", seed=2)
    path = _convert(src, tmp_path)
    with open_model(path) as mf:
        cfg = mf.header.config
        assert (cfg.n_pre, cfg.n_loop, cfg.n_post) == (1, 2, 1)
        assert (cfg.block_norm, cfg.loop_inject, cfg.loop_init, cfg.loop_norm) == ("sandwich", "adapter", "zeros", "after")
        assert cfg.qkv_bias and cfg.embed_scale == pytest.approx(math.sqrt(48))
        A = t["transformer.adapter.weight"].numpy()
        assert np.array_equal(mf.logical("loop_adapter_x"), A[:, :48])
        assert np.array_equal(mf.logical("loop_adapter_e"), A[:, 48:])
        perm = interleaved_to_half(4, 12)
        wqkv = t["transformer.core_block.1.attn.Wqkv.weight"].numpy()
        assert np.array_equal(mf.logical("loop.1.wq"), wqkv[:48][perm])
        assert np.array_equal(mf.logical("loop.1.wv"), wqkv[96:])
        assert not mf.logical("loop.1.bv").any()
        assert mf.header.metadata["source_architecture"] == "RavenForCausalLM"


def test_ouro_mapping_keeps_the_exit_gate(tmp_path):
    c, t, src = _checkpoint(tmp_path, "ouro", seed=3)
    path = _convert(src, tmp_path, loops=2)
    with open_model(path) as mf:
        cfg = mf.header.config
        assert (cfg.n_pre, cfg.n_loop, cfg.n_post, cfg.default_loops) == (0, 3, 0, 2)
        assert (cfg.block_norm, cfg.loop_norm, cfg.head_norm, cfg.exit_gate) == ("sublayer", "every", False, True)
        assert np.array_equal(mf.logical("exit_gate"), t["model.early_exit_gate.weight"].numpy()[0])
        assert np.array_equal(mf.logical("exit_gate_bias"), t["model.early_exit_gate.bias"].numpy())


@pytest.mark.parametrize("layout, changes, match", [
    ("huginn", dict(bias=True), "bias=true"),
    ("huginn", dict(test_time_noise=0.1), "test_time_noise"),
    ("huginn", dict(injection_type="add"), "injection_type"),
    ("huginn", dict(n_layers_in_coda=2), "missing tensor"),
    ("huginn", dict(n_embd=None), "n_embd"),
    ("huginn", dict(qk_bias="yes"), "qk_bias"),
    ("ouro", dict(num_hidden_layers=4), "missing tensor"),
    ("ouro", dict(hidden_act="gelu"), "hidden_act"),
    ("ouro", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "only plain, linear and llama3 RoPE"),
    ("ouro", dict(total_ut_steps=0), "total_ut_steps"),
])
def test_refusals_name_the_reason(layout, changes, match, tmp_path):
    base, make, _, _ = LAYOUTS[layout]
    t = make(base, 5)
    c = {k: v for k, v in {**base, **changes}.items() if v is not None}
    src = _write(tmp_path / "r", c, t)
    with pytest.raises(ModelFormatError, match=match):
        _convert(src, tmp_path)
    assert not os.path.exists(tmp_path / "m.tinyloop")


def test_unexpected_and_misshaped_tensors_are_listed(tmp_path):
    c, t, _ = _checkpoint(tmp_path, "huginn", seed=6)
    t["transformer.extra.weight"] = torch.zeros(3)
    t["transformer.adapter.weight"] = torch.zeros(48, 48)
    src = _write(tmp_path / "u", c, t)
    with pytest.raises(ModelFormatError) as e:
        _convert(src, tmp_path)
    assert "transformer.extra.weight" in str(e.value) and "transformer.adapter.weight: shape" in str(e.value)


def test_huginn_random_initial_state(tmp_path):
    """--init-scale: the loop starts from the seeded random state of std init_values.std *
    init_scale * embed_scale; logits equal the reference started from that state (drawn by
    tinyloop.model.init_state at positions 0..T-1), and cached greedy decoding equals the
    reference's argmax chain."""
    from tinyloop.model.init_state import random_state
    c, t, src = _checkpoint(tmp_path, "huginn", seed=6)
    seed = 2 ** 64 - 3
    path = _convert(src, tmp_path, max_loops=5, init_scale=1.5, init_seed=seed)
    d = c["n_embd"]
    std = math.sqrt(2.0 / (5 * d)) * 1.5 * math.sqrt(d)
    model = tl.load_model(path, backend="cpu", max_seq_len=64)
    try:
        cfg = model.cfg
        assert (cfg.loop_init, cfg.loop_init_seed) == ("random", seed)
        assert cfg.loop_init_scale == pytest.approx(std, rel=1e-12)

        def ref(ids, L):
            s0 = random_state(seed, cfg.loop_init_scale, np.arange(len(ids)), d)
            return huginn_reference(c, t, ids, L, s0=torch.from_numpy(s0))

        for L in (1, 4):
            want = ref(PROMPT, L).double().numpy()
            got = tl.score(model, PROMPT, loops=L, cache_mode="fp32")
            assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), L
            zero = huginn_reference(c, t, PROMPT, L).double().numpy()
            assert np.abs(zero - want).max() > 1e-3, "the random start must change the logits"
        want = _greedy(lambda ids: ref(ids, 3), PROMPT, 8)
        got = tl.generate(model, PROMPT, tl.GenerateConfig(max_tokens=8, loops=3, cache_mode="fp32"))
        assert list(got) == want
    finally:
        tl.free_model(model)
    _, _, src2 = _checkpoint(tmp_path, "huginn", seed=7, init_values={"std": 0.02, "embed_scale": 3.0})
    with open_model(_convert(src2, tmp_path, name="iv.tinyloop", init_scale=0.5)) as mf:
        h = mf.header.config
        assert (h.loop_init, h.loop_init_seed) == ("random", 0)
        assert h.loop_init_scale == pytest.approx(0.02 * 0.5 * 3.0, rel=1e-12)


@pytest.mark.parametrize("kw, match", [
    (dict(init_scale=-1.0), "init_scale"), (dict(init_scale=float("nan")), "init_scale"),
    (dict(init_scale="1"), "init_scale"), (dict(init_scale=True), "init_scale"),
    (dict(init_seed=-1, init_scale=1.0), "init_seed"), (dict(init_seed=2 ** 64, init_scale=1.0), "init_seed"),
    (dict(init_seed=1.5, init_scale=1.0), "init_seed"), (dict(init_seed=3), "needs init_scale"),
])
def test_init_options_bad_input(kw, match, tmp_path):
    _, _, src = _checkpoint(tmp_path, "huginn")
    with pytest.raises(ConfigError, match=match):
        _convert(src, tmp_path, **kw)
    assert not os.path.exists(tmp_path / "m.tinyloop")


def test_init_options_refused_outside_huginn(tmp_path):
    _, _, src = _checkpoint(tmp_path, "ouro")
    with pytest.raises(ConfigError, match="Huginn"):
        _convert(src, tmp_path, init_scale=1.0)


@pytest.mark.parametrize("layout", ["huginn", "ouro"])
def test_loop_layers_does_not_apply(layout, tmp_path):
    _, _, src = _checkpoint(tmp_path, layout)
    with pytest.raises(ConfigError, match="loop-layers"):
        _convert(src, tmp_path, loop_layers="0:1")


@pytest.mark.parametrize("layout", ["huginn", "huginn_random", "ouro"])
def test_modes_run_on_converted_looped_layouts(layout, tmp_path):
    """Every cache mode, chain and tree speculation, warm start, prefix reuse and early exit run
    on the converted layout at q4 (Huginn also from its random initial state), and the exact
    ones give plain greedy decoding's tokens."""
    init = dict(init_scale=1.0, init_seed=99) if layout == "huginn_random" else {}
    _, _, src = _checkpoint(tmp_path, layout.split("_")[0], seed=8)
    path = _convert(src, tmp_path, quant="q4", group_size=16, max_loops=6, **init)
    model = tl.load_model(path, backend="cpu", max_seq_len=96)
    try:
        check_decode_modes(model, PROMPT)
    finally:
        tl.free_model(model)


def _gate_depths(cfg, W, ids, loops, q, kv):
    """Each position's exit depth by Ouro's rule (the first depth whose cumulative exit probability
    reaches q; prompt positions run the full depth), from the float64 oracle's states with the
    earlier positions' exits applied: position by position, as decoding meets them."""
    from tinyloop.model.reference import reference_logits_exit
    g, b = W["exit_gate"].astype(np.float64), float(W["exit_gate_bias"][0])
    depths = []
    for t in range(len(ids)):
        states = []
        reference_logits_exit(cfg, W, ids[:t + 1], depths + [loops], loops, kv, states=states)
        survive, d = 1.0, loops
        if t > 0:
            for i in range(loops - 1):
                survive *= 1.0 - 1.0 / (1.0 + np.exp(-(states[i][t] @ g + b)))
                if 1.0 - survive >= q:
                    d = i + 1
                    break
        depths.append(d)
    return depths


@pytest.mark.parametrize("kv", ["copy_last", "recompute"])
def test_ouro_exit_gate_criterion_follows_the_cumulative_rule(kv, tmp_path, monkeypatch):
    """early_exit_criterion='gate' on a converted Ouro checkpoint: each decoded position leaves
    the loop where the oracle's cumulative gate probability first reaches the threshold, and the
    logits at those depths are the oracle's; the backend's guarded steps (the gate_cdf statistic
    where the state lives) and the host probes give the same depths and logits."""
    from tinyloop.model.reference import reference_logits_exit
    c, t, src = _checkpoint(tmp_path, "ouro", seed=11)
    with torch.no_grad():                 # gates that open around the middle of the loop
        t["model.early_exit_gate.bias"].fill_(-0.5)
    src = _write(tmp_path / "gate", c, t)
    path = _convert(src, tmp_path, max_loops=5)
    model = tl.load_model(path, backend="cpu", max_seq_len=64)
    try:
        W = {n: np.asarray(v, np.float32) for n, v in _logical(path).items()}
        ids = PROMPT[:10]
        for q in (0.3, 0.6):
            st = tl.GenerateStats()
            cfg = tl.GenerateConfig(cache_mode="fp32", loops=5, early_exit_patience=1, early_exit_min_L=1,
                                    early_exit_criterion="gate", early_exit_threshold=q, early_exit_kv=kv)
            got = tl.score_decoded(model, ids, cfg, stats=st)
            want = _gate_depths(model.cfg, W, ids, 5, q, kv)
            assert st.token_loops == want, q
            assert min(want[1:]) < 5
            ref = reference_logits_exit(model.cfg, W, ids, want, 5, kv)
            assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max()
            with monkeypatch.context() as mp:
                caps = model.backend.capabilities
                mp.setattr(type(model.backend), "capabilities", property(lambda self: caps - {"guarded_steps"}))
                host = tl.GenerateStats()
                assert np.array_equal(tl.score_decoded(model, ids, cfg, stats=host), got)
                assert host.token_loops == want and host.exit_probes == st.exit_probes
    finally:
        tl.free_model(model)


def _logical(path):
    from tinyloop.model.arch import required_tensors
    with open_model(path) as mf:
        return {n: np.array(mf.logical(n)) for n in required_tensors(mf.header.config)}


@pytest.mark.parametrize("kw, exc, match", [
    (dict(early_exit_min_L=2), ConfigError, "early_exit_min_L=1"),
    (dict(early_exit_peek_every=2), ConfigError, "early_exit_peek_every=1"),
    (dict(early_exit_threshold=1.5), ConfigError, "probability"),
])
def test_gate_criterion_bad_input(kw, exc, match, tmp_path):
    _, _, src = _checkpoint(tmp_path, "ouro", seed=12)
    model = tl.load_model(_convert(src, tmp_path, max_loops=5), backend="cpu", max_seq_len=64)
    try:
        cfg = dict(max_tokens=4, loops=5, early_exit_patience=1, early_exit_min_L=1, early_exit_criterion="gate")
        with pytest.raises(exc, match=match):
            tl.generate(model, PROMPT, tl.GenerateConfig(**{**cfg, **kw}))
    finally:
        tl.free_model(model)
    _, _, hsrc = _checkpoint(tmp_path, "huginn", seed=12)
    hug = tl.load_model(_convert(hsrc, tmp_path, name="h.tinyloop"), backend="cpu", max_seq_len=64)
    try:
        from tinyloop.errors import IncompatibleModesError
        with pytest.raises(IncompatibleModesError, match="exit gate"):
            tl.generate(hug, PROMPT, tl.GenerateConfig(max_tokens=4, early_exit_patience=1, early_exit_min_L=1,
                                                       early_exit_criterion="gate"))
    finally:
        tl.free_model(hug)


def test_cli_converts_both_layouts(tmp_path):
    import subprocess
    import sys
    for layout in ("huginn", "ouro"):
        _, _, src = _checkpoint(tmp_path, layout, seed=13)
        out = str(tmp_path / f"{layout}.tinyloop")
        r = subprocess.run([sys.executable, "-m", "tinyloop", "convert", "--hf", src, "-o", out, "--quant", "q8",
                            "--group-size", "16", "--loops", "2"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert LAYOUTS[layout][0]["architectures"][0] in r.stdout
        with open_model(out) as mf:
            assert mf.header.config.default_loops == 2
        r = subprocess.run([sys.executable, "-m", "tinyloop", "convert", "--hf", src, "-o", out, "--loop-layers", "0:1"],
                           capture_output=True, text=True)
        assert r.returncode == 2 and "loop-layers" in r.stderr


def test_cli_init_scale(tmp_path):
    import subprocess
    import sys
    _, _, src = _checkpoint(tmp_path, "huginn", seed=14)
    out = str(tmp_path / "r.tinyloop")
    base = [sys.executable, "-m", "tinyloop", "convert", "-o", out, "--quant", "q8", "--group-size", "16"]
    r = subprocess.run(base + ["--hf", src, "--init-scale", "1", "--init-seed", "5"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "seeded random state" in r.stdout
    with open_model(out) as mf:
        assert (mf.header.config.loop_init, mf.header.config.loop_init_seed) == ("random", 5)
    for extra, match in ((["--hf", src, "--init-scale", "nan"], "init_scale=nan"),
                         (["--checkpoint", src, "--config", "c.json", "--init-seed", "2"], "--init-seed apply to --hf")):
        r = subprocess.run(base + extra, capture_output=True, text=True)
        assert r.returncode == 2 and match in r.stderr, r.stderr
