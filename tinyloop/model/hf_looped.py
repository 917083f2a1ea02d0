"""Hugging Face import of the two public looped layouts: Huginn-0125 (``RavenForCausalLM``) and
Ouro (``OuroForCausalLM``), onto the model family's optional features (tinyloop.model.arch).

Huginn-0125 (raven): embedding x sqrt(n_embd); a prelude of sandwich blocks; a recurrent core of
sandwich blocks entered through a linear adapter over [state; prelude output] at every step;
``ln_f`` after the recurrence and again before the head; a coda of sandwich blocks. Mapping:

=================================  =================================================
checkpoint                          TinyLoop
=================================  =================================================
transformer.wte                     embed (embed_scale = init_values.embed_scale or sqrt(n_embd))
transformer.prelude.{i}             pre.{i}        block_norm "sandwich"
transformer.core_block.{j}          loop.{j}       (default_loops = mean_recurrence, max 4x)
transformer.coda.{i}                post.{i}
  norm_1 / norm_2 / norm_3 / norm_4   attn_norm / attn_out_norm / mlp_norm / mlp_out_norm
  attn.Wqkv  (q | k | v rows)         wq, wk, wv    (q, k rows permuted: see below)
  attn.qk_bias (2, 1, H, D)           bq, bk (permuted); bv = 0 (qkv_bias)
  attn.proj                           wo
  mlp.fc  (gate | up rows)            w_gate, w_up
  mlp.proj                            w_down
transformer.adapter (d, 2d)         loop_adapter_x (columns :d), loop_adapter_e (d:) (loop_inject "adapter")
transformer.ln_f                    loop_norm ("after") and final_norm
lm_head                             head (absent when tie_embeddings)
=================================  =================================================

Huginn rotates RoPE pairs (x[2i], x[2i+1]) (the complex-number form); the kernels rotate
(x[i], x[i + D/2]). Permuting each head's q and k rows (and biases) to [0, 2, 4, ..., 1, 3, 5, ...]
turns one into the other exactly; q . k is unchanged because both get the same permutation, and
v is not permuted. By default the loop starts from zeros (loop_init "zeros": the reference
code's ``init_scale=0``, deterministic). With ``init_scale`` s > 0 (``convert --init-scale``) it
starts from the seeded random state (loop_init "random", tinyloop/model/init_state.py) of standard
deviation ``init_values.std * s * embed_scale``, the spread of the reference code's draw
(``init_values.std`` defaults to sqrt(2 / (5 n_embd))): a fixed draw per (seed, position) with
bounded Irwin-Hall tails where the reference draws a fresh truncated normal per call.

Ouro: every decoder layer is looped ``total_ut_steps`` times (n_pre = n_post = 0, n_loop =
num_hidden_layers, default_loops = total_ut_steps); each layer norms each sublayer's output before
the residual add (``input_layernorm_2``, ``post_attention_layernorm_2``: block_norm "sublayer");
each step ends in ``model.norm`` and the next step starts from the normed state (loop_norm
"every"); the head reads the state without another norm (head_norm false). The per-step exit gate
``model.early_exit_gate`` (a linear map to one logit) is kept as exit_gate / exit_gate_bias.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..errors import ConfigError, ModelFormatError
from .arch import ModelConfig, block_tensors, required_tensors

#: logical name -> (checkpoint tensor name or None, a function of its float32 array (or None)
#: giving the logical tensor)
Derived = Dict[str, Tuple[Optional[str], Callable]]


def interleaved_to_half(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that maps an interleaved-RoPE projection's rows (pairs 2i, 2i+1 per head) onto
    the half-split layout (pairs i, i + D/2): new row r of a head is old row perm[r]."""
    one = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(n_heads)[:, None] * head_dim + one[None, :]).reshape(-1)


def _rows(r0: int, r1: int, perm: Optional[np.ndarray] = None) -> Callable:
    def f(a: np.ndarray) -> np.ndarray:
        out = a[r0:r1]
        return np.ascontiguousarray(out[perm] if perm is not None else out)
    return f


def _cols(c0: int, c1: int) -> Callable:
    return lambda a: np.ascontiguousarray(a[:, c0:c1])


def _same(a: np.ndarray) -> np.ndarray:
    return a


def _flat(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.reshape(-1))


def _zeros(shape) -> Callable:
    return lambda _a: np.zeros(shape, np.float32)


def _bool(c: dict, key: str, default: bool, problems: List[str]) -> bool:
    v = c.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        problems.append(f"{key}={v!r} must be true or false")
        return default
    return v


def _int(c: dict, key: str, problems: List[str], default=None, lo: int = 1) -> Optional[int]:
    v = c.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        problems.append(f"{key}={v!r} must be an integer >= {lo}" if key in c or default is not None
                        else f"config.json lacks {key}")
        return None
    return v


def _refuse(arch: str, model_dir: str, problems: List[str]) -> None:
    if problems:
        raise ModelFormatError(f"{arch} checkpoint {model_dir!r} does not fit the model family: "
                               + "; ".join(problems))


def _check_sources(cfg: ModelConfig, index: Mapping[str, object], sources: Dict[str, Tuple[int, ...]],
                   used_extra: List[str], ignored: Tuple[str, ...], problems: List[str]) -> None:
    """Every source tensor present with its expected shape; no checkpoint tensor left unused."""
    missing = sorted(n for n in sources if n not in index)
    if missing:
        problems.append(f"missing tensor(s): {_short(missing)}")
    for n, shape in sources.items():
        info = index.get(n)
        if info is not None and tuple(info.shape) != tuple(shape):
            problems.append(f"{n}: shape {tuple(info.shape)}, the config implies {tuple(shape)}")
    used = set(sources) | set(used_extra)
    unexpected = sorted(n for n in index if n not in used and not n.endswith(ignored))
    if unexpected:
        problems.append(f"unexpected tensor(s): {_short(unexpected)}")


def _short(names: List[str], limit: int = 12) -> str:
    s = ", ".join(names[:limit])
    return s + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _loops(default: int, loops: Optional[int], max_loops: Optional[int], reach: int = 1) -> Tuple[int, int]:
    """(default_loops, max_loops): the requested depth or the checkpoint's; the deepest a request
    may go is max_loops when given, else `reach` times the default depth."""
    L = default if loops is None else loops
    if max_loops is not None and max_loops < L:
        raise ConfigError(f"max_loops={max_loops} is below the checkpoint's depth loops={L}: give "
                          f"loops <= max_loops as well")
    return L, max_loops or reach * L


# =============================================================================== Huginn (raven)
def plan_raven(model_dir: str, c: dict, index: Mapping[str, object], special: dict,
               loops: Optional[int], max_loops: Optional[int], problems: List[str], notes: List[str],
               init_scale: float = 0.0, init_seed: int = 0):
    """(ModelConfig, Derived) of a Huginn-0125 checkpoint (problems appended; raises at the end);
    init_scale > 0 selects the random initial state (module doc), drawn from init_seed."""
    arch = "RavenForCausalLM"
    d = _int(c, "n_embd", problems)
    H = _int(c, "n_heads", problems, c.get("num_attention_heads"))
    Hkv = _int(c, "num_key_value_heads", problems, H if H else 1)
    ff = _int(c, "intermediate_size", problems)
    n_pre = _int(c, "n_layers_in_prelude", problems, lo=0)
    n_core = _int(c, "n_layers_in_recurrent_block", problems)
    n_coda = _int(c, "n_layers_in_coda", problems, lo=0)
    rec = _int(c, "mean_recurrence", problems)
    vocab = _int(c, "padded_vocab_size", problems, c.get("vocab_size"))
    tied = _bool(c, "tie_embeddings", False, problems)
    qk_bias = _bool(c, "qk_bias", False, problems)
    if _bool(c, "bias", False, problems):
        problems.append("bias=true: linear-layer biases are not built (the family has q/k/v biases only)")
    for key, want in (("block_class_name", "SandwichBlock"), ("mlp_class_name", "GatedMLP"),
                      ("nonlin_name", "SiLU"), ("injection_type", "linear")):
        if key in c and c[key] != want:
            problems.append(f"{key}={c[key]!r}: only {want!r} is built")
    if "norm_class_name" in c and not str(c["norm_class_name"]).startswith("RMSNorm"):
        problems.append(f"norm_class_name={c['norm_class_name']!r}: only RMSNorm is built")
    noise = c.get("test_time_noise", 0)
    if noise not in (0, 0.0, None):
        problems.append(f"test_time_noise={noise!r}: noise injected into the recurrence is not built")
    if c.get("rope_scaling") not in (None, {}):
        problems.append(f"rope_scaling={c['rope_scaling']!r}: only plain RoPE is built")
    if d and H and d % H:
        problems.append(f"n_embd={d} is not divisible by n_heads={H}")
    if H and Hkv and qk_bias and Hkv != H:
        problems.append(f"qk_bias with num_key_value_heads={Hkv} != n_heads={H}: the bias has one row per query head")
    iv = c.get("init_values") if isinstance(c.get("init_values"), dict) else {}
    scale = iv.get("embed_scale", math.sqrt(d) if d else 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not abs(scale) < 1e6:
        # (an integer past float's range would overflow float() below; ModelConfig checks the sign)
        problems.append(f"init_values.embed_scale={scale!r} is not a number below 1e6")
        scale = 1.0
    std = iv.get("std", math.sqrt(2.0 / (5 * d)) if d else 0.0)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not 0 < std < 1e6:
        if init_scale:
            problems.append(f"init_values.std={std!r} is not a positive number (the random "
                            f"initial state's spread)")
        std = 1.0
    init = (dict(loop_init="random", loop_init_scale=float(std) * init_scale * float(scale),
                 loop_init_seed=init_seed) if init_scale else dict(loop_init="zeros"))
    _refuse(arch, model_dir, problems)
    L, Lmax = _loops(rec, loops, max_loops, reach=4)   # Huginn extrapolates past its mean depth
    try:
        cfg = ModelConfig(vocab_size=vocab, d_model=d, n_heads=H, n_kv_heads=Hkv, d_ff=ff, n_pre=n_pre,
                          n_loop=n_core, n_post=n_coda, default_loops=L, max_loops=Lmax,
                          rope_theta=c.get("rope_base", c.get("rope_theta", 10000.0)),
                          norm_eps=c.get("norm_eps", 1e-6), tied_embeddings=tied, qkv_bias=qk_bias,
                          embed_scale=float(scale), block_norm="sandwich", loop_inject="adapter",
                          loop_norm="after", **init, **special)
    except ConfigError as e:
        raise ModelFormatError(f"{arch} checkpoint {model_dir!r}: {e}") from None
    D, q, kv = cfg.head_dim, cfg.q_dim, cfg.kv_dim
    pq, pk = interleaved_to_half(H, D), interleaved_to_half(Hkv, D)
    derived: Derived = {"embed": ("transformer.wte.weight", _same)}
    sources: Dict[str, Tuple[int, ...]] = {"transformer.wte.weight": (vocab, d),
                                           "transformer.adapter.weight": (d, 2 * d),
                                           "transformer.ln_f.weight": (d,)}
    parts = [("pre", "prelude", n_pre), ("loop", "core_block", n_core), ("post", "coda", n_coda)]
    for part, src, n in parts:
        for i in range(n):
            p, s = f"{part}.{i}.", f"transformer.{src}.{i}."
            for ours, theirs in (("attn_norm", "norm_1"), ("attn_out_norm", "norm_2"),
                                 ("mlp_norm", "norm_3"), ("mlp_out_norm", "norm_4")):
                derived[p + ours] = (s + theirs + ".weight", _same)
                sources[s + theirs + ".weight"] = (d,)
            wqkv = s + "attn.Wqkv.weight"
            sources[wqkv] = (q + 2 * kv, d)
            derived[p + "wq"] = (wqkv, _rows(0, q, pq))
            derived[p + "wk"] = (wqkv, _rows(q, q + kv, pk))
            derived[p + "wv"] = (wqkv, _rows(q + kv, q + 2 * kv))
            if qk_bias:
                qb = s + "attn.qk_bias"
                sources[qb] = (2, 1, H, D)
                derived[p + "bq"] = (qb, lambda a, pq=pq: np.ascontiguousarray(a[0].reshape(-1)[pq]))
                derived[p + "bk"] = (qb, lambda a, pk=pk: np.ascontiguousarray(a[1].reshape(-1)[pk]))
                derived[p + "bv"] = (None, _zeros((kv,)))
            derived[p + "wo"] = (s + "attn.proj.weight", _same)
            sources[s + "attn.proj.weight"] = (d, q)
            fc = s + "mlp.fc.weight"
            sources[fc] = (2 * ff, d)
            derived[p + "w_gate"] = (fc, _rows(0, ff))
            derived[p + "w_up"] = (fc, _rows(ff, 2 * ff))
            derived[p + "w_down"] = (s + "mlp.proj.weight", _same)
            sources[s + "mlp.proj.weight"] = (d, ff)
    derived["loop_adapter_x"] = ("transformer.adapter.weight", _cols(0, d))
    derived["loop_adapter_e"] = ("transformer.adapter.weight", _cols(d, 2 * d))
    derived["loop_norm"] = ("transformer.ln_f.weight", _same)
    derived["final_norm"] = ("transformer.ln_f.weight", _same)
    extra = []
    if not tied:
        derived["head"] = ("lm_head.weight", _same)
        sources["lm_head.weight"] = (vocab, d)
    elif "lm_head.weight" in index:
        extra.append("lm_head.weight")
        notes.append("lm_head.weight is stored but tie_embeddings=true: the embedding is the head")
    _check_sources(cfg, index, sources, extra, ("freqs_cis",), problems)
    _refuse(arch, model_dir, problems)
    notes.append("q/k rows permuted from interleaved to half-split RoPE; " + (
        f"the loop starts from the seeded random state (init_scale={init_scale:g}: std "
        f"{cfg.loop_init_scale:.6g}, seed {init_seed})" if init_scale else
        "the loop starts from zeros (Huginn's init_scale=0; --init-scale for its random start)"))
    _check_complete(cfg, derived)
    return cfg, derived


# =============================================================================== Ouro
_OURO_LAYER = {"attn_norm": "input_layernorm.weight", "attn_out_norm": "input_layernorm_2.weight",
               "mlp_norm": "post_attention_layernorm.weight",
               "mlp_out_norm": "post_attention_layernorm_2.weight",
               "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
               "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
               "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
               "w_down": "mlp.down_proj.weight"}


def plan_ouro(model_dir: str, c: dict, index: Mapping[str, object], fields: dict,
              loops: Optional[int], max_loops: Optional[int], problems: List[str], notes: List[str]):
    """(ModelConfig, Derived) of an Ouro checkpoint; `fields` are the Llama-style config fields
    (tinyloop.model.hf_import) already read."""
    arch = "OuroForCausalLM"
    N = _int(c, "num_hidden_layers", problems)
    steps = _int(c, "total_ut_steps", problems, 4)
    if fields.get("qkv_bias"):
        problems.append("q/k/v biases: Ouro's attention has none")
    _refuse(arch, model_dir, problems)
    L, Lmax = _loops(steps, loops, max_loops)
    try:
        cfg = ModelConfig(n_pre=0, n_loop=N, n_post=0, default_loops=L, max_loops=Lmax,
                          block_norm="sublayer", loop_norm="every", head_norm=False, exit_gate=True,
                          **{**fields, "qkv_bias": False})
    except ConfigError as e:
        raise ModelFormatError(f"{arch} checkpoint {model_dir!r}: {e}") from None
    shapes = required_tensors(cfg)
    derived: Derived = {"embed": ("model.embed_tokens.weight", _same),
                        "loop_norm": ("model.norm.weight", _same),
                        "exit_gate": ("model.early_exit_gate.weight", _flat),
                        "exit_gate_bias": ("model.early_exit_gate.bias", _flat)}
    sources: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": shapes["embed"],
                                           "model.norm.weight": (cfg.d_model,),
                                           "model.early_exit_gate.weight": (1, cfg.d_model),
                                           "model.early_exit_gate.bias": (1,)}
    for j in range(N):
        for t in block_tensors(cfg):
            src = f"model.layers.{j}." + _OURO_LAYER[t]
            derived[f"loop.{j}.{t}"] = (src, _same)
            sources[src] = shapes[f"loop.{j}.{t}"]
    extra = []
    if not cfg.tied_embeddings:
        derived["head"] = ("lm_head.weight", _same)
        sources["lm_head.weight"] = shapes["head"]
    elif "lm_head.weight" in index:
        extra.append("lm_head.weight")
        notes.append("lm_head.weight is stored but tie_word_embeddings=true: the embedding is the head")
    _check_sources(cfg, index, sources, extra, (".rotary_emb.inv_freq",), problems)
    _refuse(arch, model_dir, problems)
    notes.append(f"all {N} layers are the loop, run total_ut_steps={steps} times by default; the exit "
                 f"gate is kept (early_exit_criterion 'gate')")
    _check_complete(cfg, derived)
    return cfg, derived


def _check_complete(cfg: ModelConfig, derived: Derived) -> None:
    want = set(required_tensors(cfg))
    if set(derived) != want:   # a mapping bug, not a checkpoint problem
        raise AssertionError(f"mapping mismatch: {sorted(want ^ set(derived))}")
