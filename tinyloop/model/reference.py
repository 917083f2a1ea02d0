"""Float64 numpy reference forward: the oracle every backend is checked against.

Deliberately naive: full-sequence causal attention recomputed from scratch, no cache, no fusion.
Follows the family definition in tinyloop.model.arch exactly.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from .arch import ModelConfig, rope_inv_freq
from .init_state import random_state


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, n_heads: int, D: int, inv: np.ndarray) -> np.ndarray:
    # x (T, n_heads*D); half-split convention: (x[i], x[i + D/2]) rotates by pos * inv[i]
    # (inv: arch.rope_inv_freq, theta^(-2i/D) unless the model rescales it)
    T = x.shape[0]
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    xh = x.reshape(T, n_heads, D)
    a, b = xh[..., : D // 2], xh[..., D // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1).reshape(T, n_heads * D)


def _kv_model(kv_round, kv_codec):
    """The cache's effect on K/V rows (T, Hkv, D): None (exact), a float dtype to round through
    (kv_round, e.g. np.float16), or a KVCodec class whose roundtrip models the stored rows."""
    if kv_codec is not None:
        return kv_codec.roundtrip
    if kv_round is not None:
        return lambda r: r.astype(kv_round).astype(np.float64)
    return None


def _qkv(cfg: ModelConfig, W: Mapping[str, np.ndarray], p: str, x: np.ndarray, kv):
    """q, k, v rows of block `p` for residual rows x (RoPE'd; k, v as the cache stores them)."""
    T, D = x.shape[0], cfg.head_dim
    h = _rmsnorm(x, W[p + "attn_norm"], cfg.norm_eps)
    q, k, v = h @ W[p + "wq"].T, h @ W[p + "wk"].T, h @ W[p + "wv"].T
    if cfg.qkv_bias:
        q, k, v = q + W[p + "bq"], k + W[p + "bk"], v + W[p + "bv"]
    inv = rope_inv_freq(cfg)
    q = _rope(q, cfg.n_heads, D, inv)
    k = _rope(k, cfg.n_kv_heads, D, inv)
    if kv is not None:   # model what the KV cache stores, per (position, kv head) row
        k = kv(k.reshape(T, cfg.n_kv_heads, D)).reshape(T, cfg.n_kv_heads * D)
        v = kv(v.reshape(T, cfg.n_kv_heads, D)).reshape(T, cfg.n_kv_heads * D)
    return q, k, v


def _block(cfg: ModelConfig, W: Mapping[str, np.ndarray], p: str, x: np.ndarray,
           kv, window: int = 0) -> np.ndarray:
    return _block_with(cfg, W, p, x, *_qkv(cfg, W, p, x, kv), window)


def _window(cfg: ModelConfig, window: int) -> int:
    """The attention span: the request's cache window, within the model's own sliding window."""
    spans = [w for w in (window, cfg.sliding_window) if w > 0]
    return min(spans) if spans else 0


def _embed(cfg: ModelConfig, W: Mapping[str, np.ndarray], ids) -> np.ndarray:
    x = W["embed"][np.asarray(ids, dtype=np.int64)]
    return x * cfg.embed_scale if cfg.embed_scale != 1.0 else x


def _block_with(cfg: ModelConfig, W: Mapping[str, np.ndarray], p: str, x: np.ndarray, q, k, v,
                window: int = 0) -> np.ndarray:
    """Block `p` on residual rows x given every row's q and its cached k, v."""
    T, D = x.shape[0], cfg.head_dim
    group = cfg.n_heads // cfg.n_kv_heads
    qh = q.reshape(T, cfg.n_heads, D).transpose(1, 0, 2)                        # (H, T, D)
    kh = np.repeat(k.reshape(T, cfg.n_kv_heads, D).transpose(1, 0, 2), group, 0)
    vh = np.repeat(v.reshape(T, cfg.n_kv_heads, D).transpose(1, 0, 2), group, 0)
    s = qh @ kh.transpose(0, 2, 1) / np.sqrt(D)                                 # (H, T, T)
    mask = np.tril(np.ones((T, T), bool))
    if window > 0:   # a sliding window: position i sees positions i - window + 1 .. i
        mask &= ~np.tril(np.ones((T, T), bool), -window)
    s = np.where(mask, s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    att = (s @ vh).transpose(1, 0, 2).reshape(T, cfg.q_dim)
    x = _residual(cfg, W, p + "attn_out_norm", x, att @ W[p + "wo"].T)
    h = _rmsnorm(x, W[p + "mlp_norm"], cfg.norm_eps)
    g, u = h @ W[p + "w_gate"].T, h @ W[p + "w_up"].T
    return _residual(cfg, W, p + "mlp_out_norm", x, (g / (1.0 + np.exp(-g)) * u) @ W[p + "w_down"].T)


def _residual(cfg: ModelConfig, W: Mapping[str, np.ndarray], norm: str, x: np.ndarray,
              y: np.ndarray) -> np.ndarray:
    """The residual after adding sublayer output y to x, by the model's block_norm."""
    if cfg.block_norm == "sandwich":
        return _rmsnorm(x + y, W[norm], cfg.norm_eps)
    if cfg.block_norm == "sublayer":
        return x + _rmsnorm(y, W[norm], cfg.norm_eps)
    return x + y


def _loop_start(cfg: ModelConfig, x: np.ndarray) -> np.ndarray:
    """The loop's initial state from the pre blocks' output x (rows at positions 0 .. T-1)."""
    if cfg.loop_init == "zeros":
        return np.zeros_like(x)
    if cfg.loop_init == "random":
        return random_state(cfg.loop_init_seed, cfg.loop_init_scale, np.arange(x.shape[0]),
                            cfg.d_model).astype(np.float64)
    return x


def _inject(cfg: ModelConfig, W: Mapping[str, np.ndarray], x: np.ndarray, e: np.ndarray, it: int) -> np.ndarray:
    """The state entering loop iteration `it` from the previous state x and the loop input e."""
    if cfg.loop_inject == "add" and it > 0:
        return x + e
    if cfg.loop_inject == "adapter":
        return x @ W["loop_adapter_x"].T + e @ W["loop_adapter_e"].T
    return x


def _iter_end(cfg: ModelConfig, W: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    return _rmsnorm(x, W["loop_norm"], cfg.norm_eps) if cfg.loop_norm == "every" else x


def _loop_end(cfg: ModelConfig, W: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    return _rmsnorm(x, W["loop_norm"], cfg.norm_eps) if cfg.loop_norm == "after" else x


def _head(cfg: ModelConfig, W: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    head = W["embed"] if cfg.tied_embeddings else W["head"]
    if cfg.head_norm:
        x = _rmsnorm(x, np.asarray(W["final_norm"], np.float64), cfg.norm_eps)
    return x @ np.asarray(head, np.float64).T


def reference_hidden(cfg: ModelConfig, weights: Mapping[str, np.ndarray], ids: Sequence[int],
                     loops: int, kv_round: Optional[type] = None, kv_codec=None,
                     window: int = 0) -> np.ndarray:
    """Final residual (T, d_model) in float64 before the final norm."""
    W = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    kv_round = _kv_model(kv_round, kv_codec)
    window = _window(cfg, window)
    x = _embed(cfg, W, ids)
    for i in range(cfg.n_pre):
        x = _block(cfg, W, f"pre.{i}.", x, kv_round, window)
    e, x = x, _loop_start(cfg, x)
    for it in range(loops):
        x = _inject(cfg, W, x, e, it)
        for j in range(cfg.n_loop):
            x = _block(cfg, W, f"loop.{j}.", x, kv_round, window)
        x = _iter_end(cfg, W, x)
    x = _loop_end(cfg, W, x)
    for i in range(cfg.n_post):
        x = _block(cfg, W, f"post.{i}.", x, kv_round, window)
    return x


def reference_logits(cfg: ModelConfig, weights: Mapping[str, np.ndarray], ids: Sequence[int],
                     loops: int, kv_round: Optional[type] = None, kv_codec=None,
                     window: int = 0) -> np.ndarray:
    """Logits (T, vocab_size) in float64 for every position of `ids` at `loops` iterations.

    kv_round=np.float16 rounds K and V through half precision, modelling an fp16 KV cache;
    kv_codec (a KVCodec class) models any cache codec (its encode + decode per row); window > 0
    masks attention to the last `window` positions (a sliding-window cache)."""
    x = reference_hidden(cfg, weights, ids, loops, kv_round, kv_codec, window)
    return _head(cfg, weights, x)


def reference_loop_residuals(cfg: ModelConfig, weights: Mapping[str, np.ndarray], ids: Sequence[int],
                             loops: int, kv_round: Optional[type] = None) -> np.ndarray:
    """Residuals (loops + 1, T, d_model) in float64: [0] is the loop's initial state (the pre
    blocks' output, zeros or the seeded draw, by loop_init), [k] the state after loop iteration
    k (with its per-iteration norm, before the next iteration's input injection and any
    after-loop norm)."""
    W = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    kv_round = _kv_model(kv_round, None)
    window = _window(cfg, 0)
    x = _embed(cfg, W, ids)
    for i in range(cfg.n_pre):
        x = _block(cfg, W, f"pre.{i}.", x, kv_round, window)
    e, x = x, _loop_start(cfg, x)
    out = [x]
    for it in range(loops):
        x = _inject(cfg, W, x, e, it)
        for j in range(cfg.n_loop):
            x = _block(cfg, W, f"loop.{j}.", x, kv_round, window)
        x = _iter_end(cfg, W, x)
        out.append(x)
    return np.stack(out)


def reference_logits_exit(cfg: ModelConfig, weights: Mapping[str, np.ndarray], ids: Sequence[int],
                          depths: Sequence[int], loops: int, kv_policy: str = "copy_last",
                          kv_round: Optional[type] = None, kv_codec=None, window: int = 0,
                          states: Optional[list] = None) -> np.ndarray:
    """Logits (T, vocab_size) in float64 when position t leaves the loop after depths[t]
    iterations (early exit, tinyloop.runtime.early_exit): its residual stays at that depth, and
    in the iterations it skipped its cached K/V are, by `kv_policy`, those of its last iteration
    for the same loop layer (copy_last) or layer j's projections of its exited state plus the
    loop input where the model injects it (recompute). `states`, when given, receives the
    state (T, d_model) after each iteration (an exited row keeps its exit state). Other
    arguments as reference_logits."""
    depths = np.asarray(depths, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    if depths.shape != ids.shape or depths.min() < 1 or depths.max() > loops:
        raise ValueError(f"depths must give every position a depth in [1, {loops}]")
    W = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    kv = _kv_model(kv_round, kv_codec)
    window = _window(cfg, window)
    x = _embed(cfg, W, ids)
    for i in range(cfg.n_pre):
        x = _block(cfg, W, f"pre.{i}.", x, kv, window)
    e, x = x, _loop_start(cfg, x)
    last_kv = [None] * cfg.n_loop            # per loop layer: the k, v of each row's last iteration
    for it in range(loops):
        live = depths > it                   # rows still in the loop at this iteration
        done = ~live[:, None]
        entered = _inject(cfg, W, x, e, it)
        exited = entered                     # recompute's input (for an exited row: its state, injected)
        x = np.where(done, x, entered)
        for j in range(cfg.n_loop):
            p = f"loop.{j}."
            q, k, v = _qkv(cfg, W, p, x, kv)
            if not live.all():
                if kv_policy == "copy_last":
                    k0, v0 = last_kv[j]
                else:
                    _, k0, v0 = _qkv(cfg, W, p, exited, kv)
                k, v = np.where(done, k0, k), np.where(done, v0, v)
            last_kv[j] = (k, v)
            x = np.where(done, x, _block_with(cfg, W, p, x, q, k, v, window))
        x = np.where(done, x, _iter_end(cfg, W, x))
        if states is not None:
            states.append(x.copy())
    x = _loop_end(cfg, W, x)
    for i in range(cfg.n_post):
        x = _block(cfg, W, f"post.{i}.", x, kv, window)
    return _head(cfg, W, x)
