"""PyTorch implementation of the looped-transformer family defined in :mod:`tinyloop.model.arch`.

Used to *train* the demo model (tools/train_demo.py) and as a GPU baseline for benchmarks. torch is
an optional extra (``pip install tinyloop[torch]``); it is imported only by this module.

Semantics follow arch.py exactly::

    x = embed(ids) * embed_scale
    for b in pre:  x = b(x)
    e = x; if loop_init == "zeros": x = 0; if loop_init == "random": x = the seeded draw
    for i in range(L):
        if i > 0 and loop_inject == "add": x = x + e
        if loop_inject == "adapter": x = Ax @ x + Ae @ e
        for b in loop: x = b(x)             (shared weights, reused L times)
        if loop_norm == "every": x = rmsnorm(x, loop_norm)
    if loop_norm == "after": x = rmsnorm(x, loop_norm)
    for b in post: x = b(x)
    logits = rmsnorm(x, final_norm) @ head.T        head = embed when tied_embeddings; no norm
                                                    without head_norm
    block: x = x + wo @ attn(rope(wq @ n1(x) + bq), rope(wk @ n1(x) + bk), wv @ n1(x) + bv)
           x = x + w_down @ (silu(w_gate @ n2(x)) * (w_up @ n2(x)))
    (block_norm "sandwich": x = n1o(x + attn(..)), x = n2o(x + mlp(..)); "sublayer":
    x = x + n1o(attn(..)), x = x + n2o(mlp(..)); biases only with qkv_bias)

The model's own sliding window is not implemented here (refused).

* RMSNorm is computed in float32: ``x * rsqrt(mean(x^2) + eps) * w``, cast back to x's dtype.
* RoPE uses the half-split convention: for i < hd/2 the pair (x[i], x[i + hd/2]) rotates by
  ``pos * rope_theta ** (-2 i / hd)`` (rescaled as the config's rope_scaling says:
  model.arch.rope_inv_freq); angles are computed in float64, applied in float32.
* GQA: query head h reads kv head ``h // (n_heads // n_kv_heads)``; scores scaled by 1/sqrt(hd).
* Parameters are registered under the logical names themselves
  (``embed``, ``pre.0.wq``, ``loop.1.w_down``, ``final_norm``, ``head``), so
  :meth:`LoopedLM.state_dict_logical` is a plain rename-free view and equals
  ``required_tensors(config)`` in names, order and shapes.

Inference paths (batch B, one sequence per row, all rows at the same position):

* :meth:`LoopedLM.prefill` runs ``ids`` (B, T) from position 0 and writes K/V of every layer into a
  static cache preallocated for ``max_seq_len`` positions (:meth:`LoopedLM.allocate_cache`).
* :meth:`LoopedLM.decode_one` runs one token per row at position ``pos``. It attends over the whole
  static cache with a ``arange(S) <= pos`` mask, indexes the RoPE tables with ``pos`` and writes
  the cache with ``index_copy_``: with ``token`` and ``pos`` given as device tensors it performs no
  host synchronisation and no allocation that depends on ``pos``, so it can be captured in a CUDA
  graph (one graph per loop count L) and replayed after updating ``token`` / ``pos`` in place.

Cache layers are numbered as in arch.py (``ModelConfig.cache_layer``):
``0 .. n_pre-1`` pre, ``n_pre + i*n_loop + j`` loop iteration i layer j, and
``n_pre + L*n_loop + j`` post. The cache holds ``config.n_layers(config.max_loops)`` layers; a
sequence must be prefilled and decoded at one L (post layers move with L).
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .model.arch import BLOCK_BIASES, BLOCK_NORMS, BLOCK_OUT_NORMS, ModelConfig, required_tensors, rope_inv_freq
from .model.init_state import random_state
from .errors import ConfigError, InvalidInputError, ModelFormatError

__all__ = ["LoopedLM", "rms_norm", "apply_rope", "rope_tables"]

_HAS_RMS_NORM = hasattr(F, "rms_norm")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * w`` in float32, returned in x's dtype (torch's fused
    F.rms_norm where available: same formula)."""
    xf, wf = x.float(), w.float()
    if _HAS_RMS_NORM:
        y = F.rms_norm(xf, (xf.shape[-1],), wf, eps)
    else:  # pragma: no cover - torch < 2.4
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * wf
    return y.to(x.dtype)


def rope_tables(head_dim: int, theta: float, n_pos: int, device=None, freqs=None):
    """cos, sin tables (n_pos, head_dim // 2), float32; angle = pos * theta ** (-2 i / head_dim),
    or pos * freqs[i] with `freqs` the model's (rescaled) frequencies (model.arch.rope_inv_freq)."""
    half = head_dim // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / head_dim)
    if freqs is not None:
        inv = torch.as_tensor(np.asarray(freqs, np.float64))
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return (torch.cos(ang).to(torch.float32).to(device),
            torch.sin(ang).to(torch.float32).to(device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE on x (..., T, hd) with cos/sin (T, hd/2); computed in float32."""
    half = x.shape[-1] // 2
    xf = x.float()
    a, b = xf[..., :half], xf[..., half:]
    out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.to(x.dtype)


class Block(nn.Module):
    """One pre-norm transformer block; parameters named exactly as the logical tensors."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, q, kv, ff = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.wq = nn.Parameter(torch.empty(q, d))
        self.wk = nn.Parameter(torch.empty(kv, d))
        self.wv = nn.Parameter(torch.empty(kv, d))
        self.wo = nn.Parameter(torch.empty(d, q))
        self.w_gate = nn.Parameter(torch.empty(ff, d))
        self.w_up = nn.Parameter(torch.empty(ff, d))
        self.w_down = nn.Parameter(torch.empty(d, ff))
        if cfg.qkv_bias:
            self.bq = nn.Parameter(torch.zeros(q))
            self.bk = nn.Parameter(torch.zeros(kv))
            self.bv = nn.Parameter(torch.zeros(kv))
        if cfg.block_norm != "pre":
            self.attn_out_norm = nn.Parameter(torch.ones(d))
            self.mlp_out_norm = nn.Parameter(torch.ones(d))
        self.style, self.qkv_bias = cfg.block_norm, cfg.qkv_bias
        self.n_heads, self.n_kv, self.hd, self.eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        self.group = cfg.n_heads // cfg.n_kv_heads
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # inference copies of [wq; wk; wv] and [w_gate; w_up] (LoopedLM.fuse_projections)
        self.w_qkv: Optional[torch.Tensor] = None
        self.w_gate_up: Optional[torch.Tensor] = None
        self.b_qkv: Optional[torch.Tensor] = None

    def fuse_projections(self) -> None:
        """One matrix for q|k|v and one for gate|up (copies, on the parameters' device and dtype):
        two matmuls per block instead of five, used in eval mode only (training always reads the
        parameters). The parameters stay as they are (state dicts); call again after moving or
        changing them."""
        with torch.no_grad():
            self.w_qkv = torch.cat([self.wq, self.wk, self.wv]).detach().contiguous()
            self.w_gate_up = torch.cat([self.w_gate, self.w_up]).detach().contiguous()
            self.b_qkv = torch.cat([self.bq, self.bk, self.bv]).detach().contiguous() if self.qkv_bias else None

    def residual(self, x, y, out_norm):
        """x after adding sublayer output y, by the block's norm placement (block_norm)."""
        if self.style == "sandwich":
            return rms_norm(x + y, out_norm, self.eps)
        if self.style == "sublayer":
            return x + rms_norm(y, out_norm, self.eps)
        return x + y

    def _qkv(self, x, cos, sin):
        B, T, _ = x.shape
        h = rms_norm(x, self.attn_norm, self.eps)
        if self.w_qkv is not None and not self.training:
            q, k, v = F.linear(h, self.w_qkv, self.b_qkv).split([self.n_heads * self.hd, self.n_kv * self.hd,
                                                                 self.n_kv * self.hd], dim=-1)
        elif self.qkv_bias:
            q, k, v = F.linear(h, self.wq, self.bq), F.linear(h, self.wk, self.bk), F.linear(h, self.wv, self.bv)
        else:
            q, k, v = F.linear(h, self.wq), F.linear(h, self.wk), F.linear(h, self.wv)
        q = q.reshape(B, T, self.n_heads, self.hd).transpose(1, 2)
        k = k.reshape(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = v.reshape(B, T, self.n_kv, self.hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _expand(self, t):
        # (B, n_kv, S, hd) -> (B, n_heads, S, hd): query head h reads kv head h // group
        return t if self.group == 1 else t.repeat_interleave(self.group, dim=1)

    def _finish(self, x, att):
        B, _, T, _ = att.shape
        x = self.residual(x, F.linear(att.transpose(1, 2).reshape(B, T, self.n_heads * self.hd), self.wo),
                          getattr(self, "attn_out_norm", None))
        h = rms_norm(x, self.mlp_norm, self.eps)
        if self.w_gate_up is not None and not self.training:
            g, u = F.linear(h, self.w_gate_up).chunk(2, dim=-1)
        else:
            g, u = F.linear(h, self.w_gate), F.linear(h, self.w_up)
        return self.residual(x, F.linear(F.silu(g) * u, self.w_down), getattr(self, "mlp_out_norm", None))

    def forward(self, x, cos, sin, cache_k=None, cache_v=None):
        """Causal block over a full sequence starting at position 0. If cache_k / cache_v
        (B, n_kv, S, hd) are given, K (after RoPE) and V of positions 0..T-1 are written into them."""
        q, k, v = self._qkv(x, cos, sin)
        if cache_k is not None:
            T = x.shape[1]
            cache_k[:, :, :T].copy_(k)
            cache_v[:, :, :T].copy_(v)
        att = F.scaled_dot_product_attention(q, self._expand(k), self._expand(v),
                                             is_causal=True, scale=self.scale)
        return self._finish(x, att)

    def step(self, x, cos, sin, pos_idx, mask, cache_k, cache_v):
        """One new row per sequence (x: (B, 1, d)) at position pos_idx (1-element long tensor):
        write its K/V into the cache, attend over cache positions where mask is true."""
        q, k, v = self._qkv(x, cos, sin)
        cache_k.index_copy_(2, pos_idx, k)
        cache_v.index_copy_(2, pos_idx, v)
        att = F.scaled_dot_product_attention(q, self._expand(cache_k), self._expand(cache_v),
                                             attn_mask=mask, scale=self.scale)
        return self._finish(x, att)


class LoopedLM(nn.Module):
    """The looped LM of one :class:`ModelConfig`. ``max_seq_len`` bounds the RoPE tables and the
    decode cache (training windows may use up to max_seq_len positions)."""

    def __init__(self, config: ModelConfig, max_seq_len: int = 2048, device=None):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"config must be a ModelConfig, got {type(config).__name__}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ConfigError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        unsupported = [f for f, on in (("sliding_window", config.sliding_window > 0),) if on]
        if unsupported:
            raise ConfigError(f"the PyTorch twin does not implement {unsupported} (the model family's "
                              f"optional features); the float64 oracle and both backends do")
        self.config = cfg = config
        self.max_seq_len = max_seq_len
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.pre = nn.ModuleList(Block(cfg) for _ in range(cfg.n_pre))
        self.loop = nn.ModuleList(Block(cfg) for _ in range(cfg.n_loop))
        self.post = nn.ModuleList(Block(cfg) for _ in range(cfg.n_post))
        d = cfg.d_model
        self.final_norm = nn.Parameter(torch.ones(d)) if cfg.head_norm else None
        if cfg.loop_inject == "adapter":
            self.loop_adapter_x = nn.Parameter(torch.empty(d, d))
            self.loop_adapter_e = nn.Parameter(torch.empty(d, d))
        if cfg.loop_norm != "none":
            self.loop_norm = nn.Parameter(torch.ones(d))
        if cfg.exit_gate:
            self.exit_gate = nn.Parameter(torch.zeros(d))
            self.exit_gate_bias = nn.Parameter(torch.zeros(1))
        self.head = None if cfg.tied_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        scaled = rope_inv_freq(cfg) if cfg.rope_scaling != "none" else None     # (none: the plain formula)
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, max_seq_len, freqs=scaled)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("_positions", torch.arange(max_seq_len), persistent=False)
        if cfg.loop_init == "random":
            # the seeded initial state of every position, the exact host draw (model/init_state.py)
            state = random_state(cfg.loop_init_seed, cfg.loop_init_scale, np.arange(max_seq_len), d)
            self.register_buffer("loop_init_state", torch.from_numpy(state), persistent=False)
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None
        self.reset_parameters()
        if device is not None:
            self.to(device)

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator: Optional[torch.Generator] = None) -> None:
        """Norms to 1; matrices ~ N(0, std); output projections (wo, w_down) scaled by
        1/sqrt(2 * effective depth at default_loops) (GPT-2 style residual scaling)."""
        cfg = self.config
        depth = cfg.n_layers(cfg.default_loops)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in BLOCK_NORMS + BLOCK_OUT_NORMS or name in ("final_norm", "loop_norm"):
                p.fill_(1.0)
            elif leaf in BLOCK_BIASES or name.startswith("exit_gate"):
                p.zero_()
            elif leaf in ("wo", "w_down"):
                p.normal_(0.0, std / math.sqrt(2 * depth), generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)

    def fuse_projections(self) -> "LoopedLM":
        """Concatenate every block's q|k|v and gate|up weights for inference (see
        Block.fuse_projections): the same model with fewer, larger matmuls in eval mode. Call after
        moving the model to its device and dtype; returns self."""
        for b in list(self.pre) + list(self.loop) + list(self.post):
            b.fuse_projections()
        return self

    def head_weight(self) -> torch.Tensor:
        return self.embed if self.head is None else self.head

    def state_dict_logical(self) -> Dict[str, torch.Tensor]:
        """{logical name: tensor} in required_tensors(config) order (detached, same device/dtype)."""
        params = dict(self.named_parameters())
        out = {}
        for name, shape in required_tensors(self.config).items():
            t = params[name].detach()
            if tuple(t.shape) != tuple(shape):  # pragma: no cover - construction guarantees it
                raise ModelFormatError(f"{name}: shape {tuple(t.shape)} != {shape}")
            out[name] = t
        return out

    @classmethod
    def from_logical(cls, config: ModelConfig, tensors: Mapping[str, "torch.Tensor"],
                     max_seq_len: int = 2048, device=None) -> "LoopedLM":
        """Build a model from {logical name: tensor or array}; names and shapes must match
        required_tensors(config) exactly. Values are copied (cast to float32)."""
        need = required_tensors(config)
        missing = sorted(set(need) - set(tensors))
        extra = sorted(set(tensors) - set(need))
        if missing or extra:
            raise ModelFormatError(f"logical tensors do not match the config: missing {missing}, "
                                   f"unexpected {extra}")
        model = cls(config, max_seq_len=max_seq_len)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, shape in need.items():
                t = torch.as_tensor(tensors[name])
                if tuple(t.shape) != tuple(shape):
                    raise ModelFormatError(f"{name}: shape {tuple(t.shape)}, the config needs {shape}")
                params[name].copy_(t.to(torch.float32))
        if device is not None:
            model.to(device)
        return model

    # ------------------------------------------------------------------ helpers
    def _check_loops(self, loops: Optional[int]) -> int:
        cfg = self.config
        if loops is None:
            return cfg.default_loops
        if isinstance(loops, bool) or not isinstance(loops, int) or not 1 <= loops <= cfg.max_loops:
            raise InvalidInputError(f"loops={loops!r} must be an integer in [1, {cfg.max_loops}]")
        return loops

    def _check_ids(self, ids: torch.Tensor):
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise InvalidInputError("ids must be an int64/int32 torch tensor")
        squeeze = ids.dim() == 1
        if squeeze:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[1] < 1:
            raise InvalidInputError(f"ids must have shape (T,) or (B, T) with T >= 1, got {tuple(ids.shape)}")
        if ids.shape[1] > self.max_seq_len:
            raise InvalidInputError(f"sequence length {ids.shape[1]} exceeds max_seq_len={self.max_seq_len}")
        return ids, squeeze

    def _logits(self, x: torch.Tensor, head=None) -> torch.Tensor:
        """The head on the final state (through the final norm when the model has one); `head`
        replaces F.linear with the head weight (an INT4 baseline's matmul)."""
        if self.final_norm is not None:
            x = rms_norm(x, self.final_norm, self.config.norm_eps)
        return F.linear(x, self.head_weight()) if head is None else head(x)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.embed)
        s = self.config.embed_scale
        return x * s if s != 1.0 else x

    def _trunk(self, x: torch.Tensor, loops: int, block_fn, linear=None, rows=None, tap=None) -> torch.Tensor:
        """Runs the family's structure; block_fn(block, x, cache_layer) applies one block;
        `linear(x, name)` replaces F.linear with the named model-level matrix (the loop adapter);
        `rows` (a slice or an index tensor of positions) picks the rows of x's positions from
        the random initial state (loop_init "random"; default: positions 0 .. T-1); `tap(d, x)`
        sees the loop state after iteration d = 1 .. loops - 1 (the state a token exiting there
        leaves the loop with)."""
        cfg = self.config
        if linear is None:
            def linear(v, name):
                return F.linear(v, getattr(self, name))
        for i, b in enumerate(self.pre):
            x = block_fn(b, x, cfg.cache_layer("pre", i))
        e = x
        if cfg.loop_inject == "adapter":
            e = linear(x, "loop_adapter_e")
        if cfg.loop_init == "zeros":
            x = torch.zeros_like(x)
        elif cfg.loop_init == "random":
            rows = slice(0, x.shape[-2]) if rows is None else rows
            x = self.loop_init_state[rows].to(x.dtype).expand_as(x)
        for it in range(loops):
            if cfg.loop_inject == "add" and it > 0:
                x = x + e
            elif cfg.loop_inject == "adapter":
                x = linear(x, "loop_adapter_x") + e
            for j, b in enumerate(self.loop):
                x = block_fn(b, x, cfg.cache_layer("loop", j, iteration=it))
            if cfg.loop_norm == "every":
                x = rms_norm(x, self.loop_norm, cfg.norm_eps)
            if tap is not None and it < loops - 1:
                tap(it + 1, x)
        return self._after_loop(x, loops, block_fn)

    def _after_loop(self, x: torch.Tensor, loops: int, block_fn) -> torch.Tensor:
        """The structure after the loop's last iteration: the loop norm "after", the post blocks."""
        cfg = self.config
        if cfg.loop_norm == "after":
            x = rms_norm(x, self.loop_norm, cfg.norm_eps)
        for i, b in enumerate(self.post):
            x = block_fn(b, x, cfg.cache_layer("post", i, loops=loops))
        return x

    # ------------------------------------------------------------------ training forward
    def _start(self, ids: torch.Tensor, loops: Optional[int]):
        """A training forward's start: (loops, embedded ids, block_fn over the ids' RoPE rows)."""
        loops = self._check_loops(loops)
        ids, _ = self._check_ids(ids)
        T = ids.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        return loops, self._embed(ids), lambda b, x, layer: b(x, cos, sin)

    def hidden(self, ids: torch.Tensor, loops: Optional[int] = None) -> torch.Tensor:
        """Final state (B, T, d_model) before the final norm (after the loop norm)."""
        loops, x, block_fn = self._start(ids, loops)
        return self._trunk(x, loops, block_fn)

    def depth_states(self, ids: torch.Tensor, loops: Optional[int] = None):
        """Every exit depth of one forward (deep supervision, exit-gate training):
        ``(exits, top)``; ``exits`` a list over d = 1 .. loops - 1 of ``(state, hidden)``,
        ``state`` (B, T, d_model) the loop state after iteration d (what the exit gate reads) and
        ``hidden`` the final state had every token left the loop there (``hidden(ids, d)``: the
        post blocks run on the depth-d state); ``top`` is ``hidden(ids, loops)``."""
        loops, x, block_fn = self._start(ids, loops)
        states = []
        top = self._trunk(x, loops, block_fn, tap=lambda d, x: states.append(x))
        return [(x, self._after_loop(x, d, block_fn)) for d, x in enumerate(states, 1)], top

    def exit_gate_logit(self, state: torch.Tensor) -> torch.Tensor:
        """The learned exit gate's logit of loop states (..., d_model) -> (...)."""
        if not self.config.exit_gate:
            raise ConfigError("this model has no exit gate (ModelConfig.exit_gate)")
        return state @ self.exit_gate + self.exit_gate_bias

    def forward(self, ids: torch.Tensor, loops: Optional[int] = None) -> torch.Tensor:
        """Logits for every position of ids ((B, T) -> (B, T, V); (T,) -> (T, V)), no cache."""
        _, squeeze = self._check_ids(ids)
        logits = self._logits(self.hidden(ids, loops))
        return logits[0] if squeeze else logits

    # ------------------------------------------------------------------ static-cache inference
    def allocate_cache(self, batch_size: int = 1, max_seq_len: Optional[int] = None, dtype=None) -> None:
        """Preallocate the K/V cache: (n_layers(max_loops), B, n_kv_heads, S, head_dim) each, zeroed,
        on the model's device; dtype defaults to the embedding's dtype."""
        cfg = self.config
        S = self.max_seq_len if max_seq_len is None else max_seq_len
        if not 1 <= S <= self.max_seq_len:
            raise ConfigError(f"cache length {S} must be in [1, max_seq_len={self.max_seq_len}]")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        shape = (cfg.n_layers(cfg.max_loops), batch_size, cfg.n_kv_heads, S, cfg.head_dim)
        dtype = self.embed.dtype if dtype is None else dtype
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.embed.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.embed.device)

    def free_cache(self) -> None:
        self.k_cache = self.v_cache = None

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, loops: Optional[int] = None) -> torch.Tensor:
        """Run ids ((B, T) or (T,)) from position 0, filling the cache (allocated on first use with
        batch B). Returns logits for every position, shaped like forward()."""
        loops = self._check_loops(loops)
        ids, squeeze = self._check_ids(ids)
        B, T = ids.shape
        if self.k_cache is None or self.k_cache.shape[1] != B:
            self.allocate_cache(batch_size=B)
        if T > self.k_cache.shape[3]:
            raise InvalidInputError(f"prompt of {T} tokens exceeds the cache length {self.k_cache.shape[3]}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        kc, vc = self.k_cache, self.v_cache
        x = self._embed(ids)
        x = self._trunk(x, loops, lambda b, x, layer: b(x, cos, sin, kc[layer], vc[layer]))
        logits = self._logits(x)
        return logits[0] if squeeze else logits

    @torch.no_grad()
    def decode_one(self, token: Union[int, torch.Tensor], pos: Union[int, torch.Tensor],
                   loops: Optional[int] = None) -> torch.Tensor:
        """One token per cache row at position pos (all earlier positions must be in the cache).
        token: int, or long tensor (B,) / (B, 1); pos: int or long tensor (0-d or (1,)).
        Returns logits (B, V). Graph-capturable when token and pos are device tensors."""
        loops = self._check_loops(loops)
        if self.k_cache is None:
            raise InvalidInputError("decode_one needs a cache: call prefill() or allocate_cache() first")
        dev = self.embed.device
        B, S = self.k_cache.shape[1], self.k_cache.shape[3]
        if not isinstance(pos, torch.Tensor):
            if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < S:
                raise InvalidInputError(f"pos={pos!r} must be an integer in [0, {S})")
            pos = torch.tensor([pos], dtype=torch.long, device=dev)
        pos_idx = pos.reshape(1).to(torch.long)
        if not isinstance(token, torch.Tensor):
            token = torch.full((B,), int(token), dtype=torch.long, device=dev)
        token = token.reshape(B, 1).to(torch.long)
        cos, sin = self.rope_cos[pos_idx], self.rope_sin[pos_idx]          # (1, hd/2)
        mask = (self._positions[:S] <= pos_idx).view(1, 1, 1, S)          # (1, 1, 1, S) bool
        kc, vc = self.k_cache, self.v_cache
        x = self._embed(token)                                               # (B, 1, d)
        x = self._trunk(x, loops, lambda b, x, layer: b.step(x, cos, sin, pos_idx, mask, kc[layer], vc[layer]),
                        rows=pos_idx)
        return self._logits(x)[:, 0]
