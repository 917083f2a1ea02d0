"""The PyTorch implementation of the family (tinyloop.torch_model) and the demo training script.

Skipped when torch is not installed (torch is an optional extra)."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tinyloop.model.arch import ModelConfig, required_tensors  # noqa: E402
from tinyloop.errors import InvalidInputError, ModelFormatError  # noqa: E402
from tinyloop.torch_model import LoopedLM, apply_rope, rope_tables  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_cfg(**kw):
    base = dict(vocab_size=61, d_model=48, n_heads=6, n_kv_heads=2, d_ff=80, n_pre=1, n_loop=2,
                n_post=1, default_loops=3, max_loops=5, tied_embeddings=True, loop_inject="add")
    base.update(kw)
    return ModelConfig(**base)


def make_model(cfg, seed=0, max_seq_len=32):
    torch.manual_seed(seed)
    m = LoopedLM(cfg, max_seq_len=max_seq_len)
    with torch.no_grad():  # larger-than-init weights so that every part matters numerically
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


# ---------------------------------------------------------------- independent float64 reference
def _ref_logits(cfg, W, ids, loops):
    W = {k: v.detach().double().numpy() for k, v in W.items()}
    D, H, KV = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    T = len(ids)

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * w

    def rope(x, nh):  # explicit pair rotation: (x[i], x[i + D/2]) by pos * theta^(-2i/D)
        x = x.reshape(T, nh, D).copy()
        out = x.copy()
        for t in range(T):
            for i in range(D // 2):
                a = t * cfg.rope_theta ** (-2.0 * i / D)
                c, s = np.cos(a), np.sin(a)
                out[t, :, i] = x[t, :, i] * c - x[t, :, i + D // 2] * s
                out[t, :, i + D // 2] = x[t, :, i] * s + x[t, :, i + D // 2] * c
        return out

    def block(p, x):
        h = norm(x, W[p + "attn_norm"])
        q, k = rope(h @ W[p + "wq"].T, H), rope(h @ W[p + "wk"].T, KV)
        v = (h @ W[p + "wv"].T).reshape(T, KV, D)
        att = np.zeros((T, H, D))
        for hh in range(H):
            kh = hh // (H // KV)
            s = q[:, hh] @ k[:, kh].T / np.sqrt(D)
            s[np.triu(np.ones((T, T), bool), 1)] = -np.inf
            s = np.exp(s - s.max(-1, keepdims=True))
            att[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kh]
        x = x + att.reshape(T, H * D) @ W[p + "wo"].T
        h = norm(x, W[p + "mlp_norm"])
        g = h @ W[p + "w_gate"].T
        return x + ((g / (1 + np.exp(-g))) * (h @ W[p + "w_up"].T)) @ W[p + "w_down"].T

    x = W["embed"][np.asarray(ids)]
    for i in range(cfg.n_pre):
        x = block(f"pre.{i}.", x)
    e = x
    for it in range(loops):
        if it > 0 and cfg.loop_inject == "add":
            x = x + e
        for j in range(cfg.n_loop):
            x = block(f"loop.{j}.", x)
    for i in range(cfg.n_post):
        x = block(f"post.{i}.", x)
    head = W["embed"] if cfg.tied_embeddings else W["head"]
    return norm(x, W["final_norm"]) @ head.T


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("tied", [True, False])
def test_logical_names_and_shapes(tied):
    cfg = make_cfg(tied_embeddings=tied, n_pre=2, n_post=0)
    m = LoopedLM(cfg, max_seq_len=8)
    sd = m.state_dict_logical()
    need = required_tensors(cfg)
    assert list(sd) == list(need)
    assert {k: tuple(v.shape) for k, v in sd.items()} == need
    assert ("head" in sd) == (not tied)
    # parameters are registered under the logical names themselves (nothing else is trainable)
    assert sorted(n for n, _ in m.named_parameters()) == sorted(need)


@pytest.mark.parametrize("inject", ["none", "add"])
@pytest.mark.parametrize("tied", [True, False])
def test_forward_matches_reference(inject, tied):
    cfg = make_cfg(loop_inject=inject, tied_embeddings=tied)
    m = make_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    for L in (1, 2, 5):
        ref = _ref_logits(cfg, m.state_dict_logical(), ids.tolist(), L)
        out = m(ids, L).detach().double().numpy()
        assert out.shape == (11, cfg.vocab_size)
        np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("inject", ["none", "add"])
def test_prefill_decode_equals_forward(inject):
    cfg = make_cfg(loop_inject=inject)
    m = make_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    for L in (1, 2, 3, 5):
        full = m(ids, L)
        m.allocate_cache(batch_size=2)
        pre = m.prefill(ids[:, :6], L)
        torch.testing.assert_close(pre, full[:, :6], atol=1e-5, rtol=0)
        for t in range(6, 17):
            step = m.decode_one(ids[:, t], t, L)
            torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=0)


def test_fused_projections_same_model():
    """fuse_projections (q|k|v and gate|up as one matmul each): forward, prefill and decode equal
    the unfused model's; parameters and logical state are untouched."""
    cfg = make_cfg()
    m = make_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    full = m(ids, 3)
    names = list(m.state_dict_logical())
    assert m.fuse_projections() is m
    assert list(m.state_dict_logical()) == names and m.loop[0].w_qkv.shape[0] == cfg.q_dim + 2 * cfg.kv_dim
    torch.testing.assert_close(m(ids, 3), full, atol=1e-5, rtol=0)
    m.allocate_cache(batch_size=2)
    torch.testing.assert_close(m.prefill(ids[:, :4], 3), full[:, :4], atol=1e-5, rtol=0)
    for t in range(4, 11):
        torch.testing.assert_close(m.decode_one(ids[:, t], t, 3), full[:, t], atol=1e-5, rtol=0)
    # training reads the parameters, never the (now stale) fused copies
    with torch.no_grad():
        m.loop[0].wq.mul_(2.0)
    m.train()
    assert not torch.allclose(m(ids, 3), full, atol=1e-3)


def test_decode_with_device_tensors_and_prefill_of_one_token():
    """decode_one with tensor token/pos (the CUDA-graph style call), starting from a 1-token prefill."""
    cfg = make_cfg()
    m = make_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    full = m(ids, 4)
    m.allocate_cache(batch_size=1, max_seq_len=16)
    torch.testing.assert_close(m.prefill(ids[:1], 4), full[:1], atol=1e-5, rtol=0)
    tok = torch.zeros(1, dtype=torch.long)
    pos = torch.zeros((), dtype=torch.long)
    for t in range(1, 9):
        tok.fill_(int(ids[t]))
        pos.fill_(t)
        torch.testing.assert_close(m.decode_one(tok, pos, 4)[0], full[t], atol=1e-5, rtol=0)


def test_loop_inject_on_off():
    a = make_model(make_cfg(loop_inject="none"), seed=5)
    b = LoopedLM.from_logical(make_cfg(loop_inject="add"), a.state_dict_logical(), max_seq_len=32)
    ids = torch.arange(10) % 61
    with torch.no_grad():
        torch.testing.assert_close(a(ids, 1), b(ids, 1))          # no iteration after the first
        assert (a(ids, 3) - b(ids, 3)).abs().max() > 1e-3         # injection changes deeper loops


def test_cache_layer_numbering():
    cfg = make_cfg(n_pre=1, n_loop=2, n_post=1, max_loops=4)
    m = make_model(cfg)
    m.allocate_cache(batch_size=1)
    assert m.k_cache.shape == (cfg.n_layers(4), 1, cfg.n_kv_heads, 32, cfg.head_dim)
    L = 2
    m.prefill(torch.arange(5), L)
    used = cfg.n_layers(L)                       # pre 0, loop 1..4, post 5
    assert cfg.cache_layer("post", 0, loops=L) == used - 1
    for layer in range(cfg.n_layers(4)):
        nz = bool(m.k_cache[layer].abs().sum() > 0) and bool(m.v_cache[layer].abs().sum() > 0)
        assert nz == (layer < used), layer
    # loop iteration i, layer j sees the residual of iteration i: K of layer (it 0, j 0) and
    # (it 1, j 0) differ since the same weights see different inputs
    l0, l1 = cfg.cache_layer("loop", 0, iteration=0), cfg.cache_layer("loop", 0, iteration=1)
    assert (m.k_cache[l0] - m.k_cache[l1]).abs().max() > 1e-4


def test_from_logical_roundtrip_and_errors():
    cfg = make_cfg(tied_embeddings=False)
    m = make_model(cfg)
    sd = {k: v.clone().numpy() for k, v in m.state_dict_logical().items()}
    m2 = LoopedLM.from_logical(cfg, sd, max_seq_len=32)
    ids = torch.arange(7)
    with torch.no_grad():
        torch.testing.assert_close(m(ids, 2), m2(ids, 2))
    bad = dict(sd)
    del bad["head"]
    with pytest.raises(ModelFormatError):
        LoopedLM.from_logical(cfg, bad)
    bad = dict(sd, **{"loop.0.wq": np.zeros((3, 3), np.float32)})
    with pytest.raises(ModelFormatError):
        LoopedLM.from_logical(cfg, bad)


def test_rope_half_split():
    hd, theta = 8, 100.0
    cos, sin = rope_tables(hd, theta, 5)
    x = torch.randn(1, 1, 5, hd, dtype=torch.float64)
    y = apply_rope(x, cos, sin)
    for t in range(5):
        for i in range(hd // 2):
            a = t * theta ** (-2 * i / hd)
            c, s = np.cos(a), np.sin(a)
            x0, x1 = float(x[0, 0, t, i]), float(x[0, 0, t, i + hd // 2])
            assert abs(float(y[0, 0, t, i]) - (x0 * c - x1 * s)) < 1e-5
            assert abs(float(y[0, 0, t, i + hd // 2]) - (x0 * s + x1 * c)) < 1e-5


def test_invalid_inputs():
    m = make_model(make_cfg())
    with pytest.raises(InvalidInputError):
        m(torch.arange(4), 0)
    with pytest.raises(InvalidInputError):
        m(torch.arange(4), 6)                    # > max_loops
    with pytest.raises(InvalidInputError):
        m(torch.zeros(40, dtype=torch.long), 1)  # > max_seq_len
    with pytest.raises(InvalidInputError):
        m.decode_one(1, 0)                       # no cache yet


# ---------------------------------------------------------------- training script smoke test
def _load_train_demo():
    spec = importlib.util.spec_from_file_location("train_demo", os.path.join(REPO, "tools", "train_demo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_demo_smoke(tmp_path):
    from safetensors.numpy import load_file
    td = _load_train_demo()
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    np.save(data / "train_ids.npy", rng.integers(0, 64, 5000).astype(np.uint16))
    np.save(data / "heldout_ids.npy", rng.integers(0, 64, 600).astype(np.uint16))
    (data / "meta.json").write_text(json.dumps({"vocab_size": 64, "eos_id": 0}))
    out = tmp_path / "out"
    res = td.main(["--data-dir", str(data), "--out", str(out), "--device", "cpu", "--steps", "3",
                   "--d-model", "32", "--n-heads", "2", "--n-kv-heads", "1", "--d-ff", "64",
                   "--default-loops", "2", "--max-loops", "4", "--seq-len", "16",
                   "--batch-size", "4", "--log-every", "1", "--eval-every", "2",
                   "--eval-tokens", "64", "--warmup", "1"])
    assert res["steps"] == 3 and res["stop_reason"] == "steps"
    assert set(res["eval_heldout_loss"]) == {"1", "2", "4"}
    cfg = ModelConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert cfg.eos_id == 0 and cfg.bos_id is None and cfg.vocab_size == 64 and cfg.tied_embeddings
    tensors = load_file(str(out / "model.safetensors"))
    need = required_tensors(cfg)
    assert set(tensors) == set(need)
    assert all(tensors[k].shape == need[k] and tensors[k].dtype == np.float32 for k in need)
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 3 and np.isfinite(log["final_loss"]) and log["periodic_evals"]
    # the saved weights load back into the torch model
    LoopedLM.from_logical(cfg, tensors, max_seq_len=16)


def test_weight_sharding_and_merge(tmp_path):
    """Weights above --max-shard-mib are split into HF-style shards; --merge-shards joins them."""
    from safetensors.numpy import load_file
    td = _load_train_demo()
    cfg = make_cfg(tied_embeddings=False)
    arrays = {k: v.numpy().copy() for k, v in make_model(cfg).state_dict_logical().items()}
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"stale")        # an earlier run's file is removed
    files = td.save_weights(arrays, str(src), {"format": "tinyloop-logical"}, 20_000)
    assert td.SHARD_INDEX in files and len(files) > 3 and not (src / "model.safetensors").exists()
    for fn in files[:-1]:
        assert (src / fn).stat().st_size <= 20_000 + 4096
    (src / "config.json").write_text(json.dumps(cfg.to_dict()))
    dst = tmp_path / "dst"
    res = td.main(["--merge-shards", str(src), "--out", str(dst), "--data-dir", str(tmp_path / "none")])
    merged = load_file(res["merged"])
    assert list(merged) == list(required_tensors(cfg)) or set(merged) == set(required_tensors(cfg))
    for k, a in arrays.items():
        np.testing.assert_array_equal(merged[k], a)
    assert (dst / "config.json").exists()
    # small weights stay one file
    one = tmp_path / "one"
    one.mkdir()
    assert td.save_weights(arrays, str(one), {}, 1 << 30) == ["model.safetensors"]


# ---------------------------------------------------------------- the family's optional features
FEATURES = {
    "bias_scale": dict(qkv_bias=True, embed_scale=1.5),
    "huginn": dict(block_norm="sandwich", loop_inject="adapter", loop_init="zeros", loop_norm="after",
                   embed_scale=2.0, qkv_bias=True),
    "huginn_random": dict(block_norm="sandwich", loop_inject="adapter", loop_init="random", loop_norm="after",
                          loop_init_scale=0.8, loop_init_seed=12345678901234567890, embed_scale=2.0),
    "ouro": dict(block_norm="sublayer", loop_norm="every", head_norm=False, exit_gate=True, n_pre=0,
                 n_post=0, loop_inject="none"),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_optional_features_match_the_oracle(feature):
    """Biases, the scaled embedding, the sandwich / sublayer-output blocks, the loop adapter from a
    zero or a seeded random state and the loop norms: the PyTorch forward equals the float64 oracle, and prefill +
    decode_one (fused projections too) equal the forward."""
    from tinyloop.model.reference import reference_logits
    cfg = make_cfg(**FEATURES[feature])
    m = make_model(cfg, seed=3)
    assert sorted(n for n, _ in m.named_parameters()) == sorted(required_tensors(cfg))
    W = {k: v.detach().numpy() for k, v in m.state_dict_logical().items()}
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    for L in (1, 3):
        ref = reference_logits(cfg, W, ids[0].tolist(), L)
        np.testing.assert_allclose(m(ids[0], L).detach().double().numpy(), ref, atol=3e-5, rtol=0)
        full = m(ids, L)
        for fused in (False, True):
            if fused:
                m.fuse_projections()
            m.allocate_cache(batch_size=2)
            torch.testing.assert_close(m.prefill(ids[:, :5], L), full[:, :5], atol=2e-5, rtol=0)
            for t in range(5, 12):
                torch.testing.assert_close(m.decode_one(ids[:, t], t, L), full[:, t], atol=2e-5, rtol=0)


def test_model_window_is_refused():
    from tinyloop.errors import ConfigError
    with pytest.raises(ConfigError, match="sliding_window"):
        LoopedLM(make_cfg(sliding_window=4))
