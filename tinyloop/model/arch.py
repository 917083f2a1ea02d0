"""The model family, defined once: dimensions (:class:`ModelConfig`), the tensors a model of those
dimensions needs (:func:`required_tensors`) and how each tensor may be stored (:class:`TensorQuant`).

Family (see docs/ARCHITECTURE.md)::

    x = embed(ids) * embed_scale                    # (T, d_model)
    for b in pre blocks:   x = b(x)                 # n_pre distinct blocks
    e = x                                           # the loop input (kept when loop_inject != none)
    if loop_init == "zeros": x = 0                  # the loop's initial state
    if loop_init == "random": x = draw(loop_init_seed, position) * loop_init_scale  # (model/init_state.py)
    for i in range(L):                              # L = loops, 1..max_loops
        if loop_inject == "add" and i > 0: x = x + e                  # input injection
        if loop_inject == "adapter": x = Ax @ x + Ae @ e              # = A @ [x; e] (Huginn)
        for b in loop blocks: x = b(x)              # n_loop shared layers, reused L times
        if loop_norm == "every": x = rmsnorm(x, loop_norm)            # (Ouro: every step ends normed)
    if loop_norm == "after": x = rmsnorm(x, loop_norm)                # (Huginn: once, after the loop)
    for b in post blocks:  x = b(x)                 # n_post distinct blocks
    logits = head(rmsnorm(x, final_norm))           # head = embed when tied_embeddings;
                                                    # head(x) when head_norm is false
    block(x), block_norm "pre" (Llama):
              x = x + attn(n1(x))
              x = x + mlp(n2(x))
    block_norm "sandwich" (Huginn): a norm after each residual add
              x = n1o(x + attn(n1(x)))
              x = n2o(x + mlp(n2(x)))
    block_norm "sublayer" (Ouro): a norm on each sublayer's output before the add
              x = x + n1o(attn(n1(x)))
              x = x + n2o(mlp(n2(x)))
    attn(h) = Wo @ attention(rope(Wq @ h + bq), rope(Wk @ h + bk), Wv @ h + bv)
    mlp(h)  = Wd @ (silu(Wg @ h) * (Wu @ h))                                       # SwiGLU
    attn: GQA, causal; with sliding_window = W > 0 a position sees only the last W positions.
    bq, bk, bv: projection biases, present only when qkv_bias (zero otherwise).
    n1 = attn_norm, n2 = mlp_norm, n1o = attn_out_norm, n2o = mlp_out_norm.

Tensor names (weights are stored out_features x in_features, as y = W @ x):

    embed                      (vocab_size, d_model)
    {part}.{i}.attn_norm       (d_model,)
    {part}.{i}.wq              (n_heads * head_dim, d_model)
    {part}.{i}.wk / wv         (n_kv_heads * head_dim, d_model)
    {part}.{i}.bq              (n_heads * head_dim,)      only when qkv_bias
    {part}.{i}.bk / bv         (n_kv_heads * head_dim,)   only when qkv_bias
    {part}.{i}.wo              (d_model, n_heads * head_dim)
    {part}.{i}.mlp_norm        (d_model,)
    {part}.{i}.w_gate / w_up   (d_ff, d_model)
    {part}.{i}.w_down          (d_model, d_ff)
    {part}.{i}.attn_out_norm   (d_model,)                 only when block_norm != "pre"
    {part}.{i}.mlp_out_norm    (d_model,)                 only when block_norm != "pre"
    loop_adapter_x / _e        (d_model, d_model)         only when loop_inject == "adapter"
                                                          (A = [Ax | Ae], the state's columns first)
    loop_norm                  (d_model,)                 only when loop_norm != "none"
    exit_gate, exit_gate_bias  (d_model,), (1,)           only when exit_gate
    final_norm                 (d_model,)                 absent when head_norm is false
    head                       (vocab_size, d_model)      absent when tied_embeddings

with part in pre (i < n_pre), loop (i < n_loop), post (i < n_post).

KV-cache layers are numbered 0 .. n_pre + L * n_loop + n_post - 1; loop iteration i owns layers
n_pre + i * n_loop .. n_pre + (i + 1) * n_loop - 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from ..errors import ConfigError

#: Upper bounds that keep size arithmetic sane; a file declaring more is refused.
MAX_DIM = 1 << 20
#: Most extra end-of-sequence ids a model may declare (ModelConfig.extra_eos_ids).
MAX_EOS_IDS = 64
#: RoPE frequency scalings of the family (ModelConfig.rope_scaling).
ROPE_SCALINGS = ("none", "linear", "llama3")
MAX_BLOCKS = 1024
MAX_LOOPS = 4096

BLOCK_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
BLOCK_NORMS = ("attn_norm", "mlp_norm")
BLOCK_BIASES = ("bq", "bk", "bv")
BLOCK_OUT_NORMS = ("attn_out_norm", "mlp_out_norm")
PARTS = ("pre", "loop", "post")
LOOP_INJECT = ("none", "add", "adapter")
LOOP_INIT = ("pre", "zeros", "random")
LOOP_NORM = ("none", "after", "every")
BLOCK_NORM = ("pre", "sandwich", "sublayer")
#: Model-level matrices (quantizable) beside the blocks' own.
MODEL_MATRICES = ("embed", "head", "loop_adapter_x", "loop_adapter_e")


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is outside the allowed range [{lo}, {hi}]")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture dimensions of one looped model. Validated on construction."""

    vocab_size: int
    """Number of token ids; ids are 0 .. vocab_size - 1."""
    d_model: int
    """Residual stream width."""
    n_heads: int
    """Query heads per attention layer."""
    n_kv_heads: int
    """Key/value heads (GQA); must divide n_heads."""
    d_ff: int
    """SwiGLU hidden width."""
    n_pre: int
    """Distinct blocks before the loop (may be 0)."""
    n_loop: int
    """Layers in the shared loop block (at least 1)."""
    n_post: int = 0
    """Distinct blocks after the loop (may be 0)."""
    default_loops: int = 1
    """Loop count L used when a request does not choose one."""
    max_loops: int = 1
    """Largest L a request may ask for."""
    head_dim: int = 0
    """Per-head width; 0 means d_model // n_heads. Must be even (RoPE rotates pairs)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tied_embeddings: bool = False
    """When true there is no `head` tensor: logits use `embed`."""
    loop_inject: str = "none"
    """"add": the residual entering the loop is added back before every loop iteration after the
    first. "adapter": before every iteration (the first too) the state becomes
    A @ [state; loop input] with the learned (d_model, 2 d_model) adapter A, stored as its two
    square halves loop_adapter_x (the state's columns) and loop_adapter_e (Huginn's injection)."""
    bos_id: Optional[int] = None
    """Beginning-of-sequence id, if the model has one."""
    eos_id: Optional[int] = None
    """End-of-sequence id; generation stops when it is emitted."""
    qkv_bias: bool = False
    """When true every block has biases bq, bk, bv added to its q, k, v projections (before
    RoPE), as Qwen2's attention has; a per-head q/k bias (Huginn's) is the same tensors."""
    embed_scale: float = 1.0
    """The embedded rows are multiplied by this (1.0: unscaled; Gemma-style models use
    sqrt(d_model)). Only the input embedding is scaled, not a tied head."""
    sliding_window: int = 0
    """Attention span of the model itself (Mistral's sliding window): a position attends to the
    last `sliding_window` positions only; 0 means full causal attention. A request longer than the
    window runs with a window cache of at most this size (GenerateConfig.cache_window)."""

    block_norm: str = "pre"
    """Where a block's norms sit: "pre" (a norm before each sublayer, Llama), "sandwich" (also a
    norm after each residual add, Huginn's block), "sublayer" (also a norm on each sublayer's
    output before the residual add, Ouro's decoder layer). The two extra norms are the block
    tensors attn_out_norm and mlp_out_norm."""
    loop_init: str = "pre"
    """The loop's initial state: "pre" (the pre blocks' output), "zeros" or "random" (a seeded
    draw of standard deviation loop_init_scale, a fixed function of loop_init_seed and the
    row's position: tinyloop/model/init_state.py). With "zeros" and "random" the pre blocks'
    output only reaches the loop through the adapter, so they need loop_inject "adapter"
    (Huginn: zeros is its init_scale 0, random its default draw)."""
    loop_init_scale: float = 0.0
    """Standard deviation of the "random" initial state (required > 0 there; 0 otherwise)."""
    loop_init_seed: int = 0
    """Seed of the "random" initial state, an integer in [0, 2**64) (0 unless "random")."""
    loop_norm: str = "none"
    """A norm (tensor loop_norm) on the loop's state: "after" the last iteration (Huginn applies
    its final norm there as well as before the head), after "every" iteration (Ouro's steps
    each end in the model norm, and the next step starts from the normed state), or "none"."""
    head_norm: bool = True
    """When false the head reads the final state directly and there is no final_norm tensor
    (Ouro: its loop already ends in the norm)."""
    exit_gate: bool = False
    """When true the file holds a learned per-iteration exit gate, the logit
    exit_gate . state + exit_gate_bias of the state after each loop iteration (Ouro's); the
    early-exit criterion "gate" exits when its cumulative exit probability passes a threshold."""
    rope_scaling: str = "none"
    """How the RoPE frequencies f_i = rope_theta^(-2i/head_dim) are rescaled for contexts past
    the trained one: "none"; "linear" (every f_i divided by rope_factor); "llama3" (Llama 3.1's:
    with wavelengths w_i = 2 pi / f_i and P = rope_original_max_positions, f_i / rope_factor where
    w_i > P / rope_low_freq_factor, f_i where w_i < P / rope_high_freq_factor, and between them
    the blend (1 - s) f_i / rope_factor + s f_i with s = (P / w_i - low) / (high - low)).
    rope_inv_freq() is the one definition every backend uses."""
    rope_factor: float = 1.0
    """The scaling factor of "linear" and "llama3" (> 0; 1.0 for "none")."""
    rope_low_freq_factor: float = 1.0
    """"llama3" only (else 1.0): wavelengths above P / this are scaled fully."""
    rope_high_freq_factor: float = 4.0
    """"llama3" only (else 4.0): wavelengths below P / this are kept; must exceed the low factor."""
    rope_original_max_positions: int = 0
    """"llama3" only (else 0): P, the context the model was first trained at (>= 1)."""
    extra_eos_ids: Tuple[int, ...] = ()
    """Further end-of-sequence ids beside eos_id (end-of-turn tokens: Llama 3's <|eot_id|>,
    Qwen2's <|im_end|>): generation stops on each as on eos_id, and text output leaves them out.
    At most MAX_EOS_IDS distinct ids, none equal to eos_id, which they need."""

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 1, MAX_DIM * 4)
        _check_int("d_model", self.d_model, 1, MAX_DIM)
        _check_int("n_heads", self.n_heads, 1, 4096)
        _check_int("n_kv_heads", self.n_kv_heads, 1, self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        _check_int("d_ff", self.d_ff, 1, MAX_DIM)
        _check_int("n_pre", self.n_pre, 0, MAX_BLOCKS)
        _check_int("n_loop", self.n_loop, 1, MAX_BLOCKS)
        _check_int("n_post", self.n_post, 0, MAX_BLOCKS)
        _check_int("max_loops", self.max_loops, 1, MAX_LOOPS)
        _check_int("default_loops", self.default_loops, 1, self.max_loops)
        _check_int("head_dim", self.head_dim, 0, MAX_DIM)
        for f in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "d_ff", "n_pre", "n_loop", "n_post",
                  "max_loops", "default_loops", "head_dim"):
            object.__setattr__(self, f, int(getattr(self, f)))   # numpy ints -> int (JSON-safe)
        if self.head_dim == 0:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        for name in ("rope_theta", "norm_eps"):
            v = getattr(self, name)
            ok = not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < 1e12
            if not ok:
                raise ConfigError(f"{name}={v!r} must be a finite positive number below 1e12")
            object.__setattr__(self, name, float(v))
        if not isinstance(self.tied_embeddings, bool):
            raise ConfigError(f"tied_embeddings must be true or false, got {self.tied_embeddings!r}")
        if self.loop_inject not in LOOP_INJECT:
            raise ConfigError(f"loop_inject={self.loop_inject!r} is not one of {LOOP_INJECT}")
        for name, allowed in (("block_norm", BLOCK_NORM), ("loop_init", LOOP_INIT), ("loop_norm", LOOP_NORM)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        v = self.loop_init_scale
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e6:
            raise ConfigError(f"loop_init_scale={v!r} must be a finite number in [0, 1e6)")
        object.__setattr__(self, "loop_init_scale", float(v))
        _check_int("loop_init_seed", self.loop_init_seed, 0, 2 ** 64 - 1)
        object.__setattr__(self, "loop_init_seed", int(self.loop_init_seed))
        if self.loop_init == "random" and not self.loop_init_scale > 0:
            raise ConfigError("loop_init='random' needs loop_init_scale > 0 (the initial state's "
                              "standard deviation); for a zero start use loop_init='zeros'")
        if self.loop_init != "random" and (self.loop_init_scale or self.loop_init_seed):
            raise ConfigError(f"loop_init_scale={self.loop_init_scale!r} and loop_init_seed="
                              f"{self.loop_init_seed!r} apply to loop_init='random' only, not "
                              f"{self.loop_init!r}; leave them 0")
        if self.loop_init != "pre" and self.loop_inject != "adapter":
            raise ConfigError(f"loop_init={self.loop_init!r} discards the pre blocks' output unless the loop "
                              f"reads it through an adapter: it needs loop_inject='adapter', not "
                              f"{self.loop_inject!r}")
        for name in ("head_norm", "exit_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.qkv_bias, bool):
            raise ConfigError(f"qkv_bias must be true or false, got {self.qkv_bias!r}")
        v = self.embed_scale
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < 1e6):
            raise ConfigError(f"embed_scale={v!r} must be a finite positive number below 1e6")
        object.__setattr__(self, "embed_scale", float(v))
        _check_int("sliding_window", self.sliding_window, 0, MAX_DIM)
        object.__setattr__(self, "sliding_window", int(self.sliding_window))
        for name in ("bos_id", "eos_id"):
            v = getattr(self, name)
            if v is not None:
                _check_int(name, v, 0, self.vocab_size - 1)
                object.__setattr__(self, name, int(v))
        self._check_rope_scaling()
        v = self.extra_eos_ids
        if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
            raise ConfigError(f"extra_eos_ids={v!r} must be a list of token ids")
        if len(v) > MAX_EOS_IDS:
            raise ConfigError(f"extra_eos_ids lists {len(v)} ids; at most {MAX_EOS_IDS} are allowed")
        for t in v:
            _check_int("extra_eos_ids entry", t, 0, self.vocab_size - 1)
        ids = tuple(int(t) for t in v)
        if ids and self.eos_id is None:
            raise ConfigError(f"extra_eos_ids={list(ids)} needs eos_id (the model's primary end-of-sequence id)")
        if len(set(ids)) != len(ids) or self.eos_id in ids:
            raise ConfigError(f"extra_eos_ids={list(ids)} must be distinct ids other than eos_id={self.eos_id}")
        object.__setattr__(self, "extra_eos_ids", ids)

    def _check_rope_scaling(self) -> None:
        kind = self.rope_scaling
        if kind not in ROPE_SCALINGS:
            raise ConfigError(f"rope_scaling={kind!r} is not one of {ROPE_SCALINGS}")
        for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise ConfigError(f"{name}={v!r} must be a finite positive number below 1e6")
            object.__setattr__(self, name, float(v))
        _check_int("rope_original_max_positions", self.rope_original_max_positions, 0, MAX_DIM * 64)
        object.__setattr__(self, "rope_original_max_positions", int(self.rope_original_max_positions))
        defaults = {"rope_factor": 1.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                    "rope_original_max_positions": 0}
        used = {"none": (), "linear": ("rope_factor",), "llama3": tuple(defaults)}[kind]
        for name, default in defaults.items():
            if name not in used and getattr(self, name) != default:
                raise ConfigError(f"{name}={getattr(self, name)!r} does not apply to rope_scaling={kind!r}; "
                                  f"leave it {default!r}")
        if kind == "llama3":
            if self.rope_original_max_positions < 1:
                raise ConfigError("rope_scaling='llama3' needs rope_original_max_positions >= 1 (the context "
                                  "the model was first trained at)")
            if not self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ConfigError(f"rope_low_freq_factor={self.rope_low_freq_factor} must be below "
                                  f"rope_high_freq_factor={self.rope_high_freq_factor}")

    # ----------------------------------------------------------------- derived sizes
    @property
    def eos_ids(self) -> Tuple[int, ...]:
        """Every id that ends generation: eos_id, then extra_eos_ids (empty without eos_id)."""
        return () if self.eos_id is None else (self.eos_id,) + self.extra_eos_ids

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def keeps_loop_input(self) -> bool:
        """True when the loop reads the pre blocks' output at every iteration (ws.e is live)."""
        return self.loop_inject != "none"

    def n_layers(self, loops: int) -> int:
        """KV-cache layers a forward at `loops` iterations touches."""
        return self.n_pre + loops * self.n_loop + self.n_post

    def cache_layer(self, part: str, index: int, iteration: int = 0, loops: int = 0) -> int:
        """Cache layer of block `index` of `part`; loop layers also need `iteration`, post layers `loops`."""
        if part == "pre":
            return index
        if part == "loop":
            return self.n_pre + iteration * self.n_loop + index
        return self.n_pre + loops * self.n_loop + index

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["extra_eos_ids"] = list(self.extra_eos_ids)      # as JSON holds it
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"model config must be a mapping, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown model config key(s) {unknown}; allowed: {sorted(names)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in d and f.default is dataclasses.MISSING)
        if missing:
            raise ConfigError(f"model config is missing required key(s) {missing}")
        return cls(**d)


def block_tensors(cfg: ModelConfig) -> Tuple[str, ...]:
    """The tensor names of one block of `cfg` (without the part.index. prefix), in file order."""
    return (BLOCK_NORMS + BLOCK_MATRICES + (BLOCK_BIASES if cfg.qkv_bias else ())
            + (BLOCK_OUT_NORMS if cfg.block_norm != "pre" else ()))


def required_tensors(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Logical tensors (name -> shape) a model with these dimensions needs, in canonical file order."""
    d, q, kv, ff = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff
    shapes = {"attn_norm": (d,), "mlp_norm": (d,), "wq": (q, d), "wk": (kv, d), "wv": (kv, d),
              "wo": (d, q), "w_gate": (ff, d), "w_up": (ff, d), "w_down": (d, ff),
              "bq": (q,), "bk": (kv,), "bv": (kv,), "attn_out_norm": (d,), "mlp_out_norm": (d,)}
    out: Dict[str, Tuple[int, ...]] = {"embed": (cfg.vocab_size, d)}
    for part, n in (("pre", cfg.n_pre), ("loop", cfg.n_loop), ("post", cfg.n_post)):
        for i in range(n):
            for name in block_tensors(cfg):
                out[f"{part}.{i}.{name}"] = shapes[name]
    if cfg.loop_inject == "adapter":
        out["loop_adapter_x"] = (d, d)
        out["loop_adapter_e"] = (d, d)
    if cfg.loop_norm != "none":
        out["loop_norm"] = (d,)
    if cfg.exit_gate:
        out["exit_gate"] = (d,)
        out["exit_gate_bias"] = (1,)
    if cfg.head_norm:
        out["final_norm"] = (d,)
    if not cfg.tied_embeddings:
        out["head"] = (cfg.vocab_size, d)
    return out


def is_matrix(name: str) -> bool:
    """True for tensors that may be quantized (2-D weights); norms and biases are vectors kept in
    float."""
    return name in MODEL_MATRICES or name.rsplit(".", 1)[-1] in BLOCK_MATRICES


# --------------------------------------------------------------------------- quantization
QUANT_TYPES = ("f32", "f16", "q8", "q4", "q2")
QUANT_BITS = {"q8": 8, "q4": 4, "q2": 2}


@dataclass(frozen=True)
class TensorQuant:
    """How one logical tensor is stored.

    f32 / f16: one physical tensor of the logical shape. qN (N in 8, 4, 2): group-wise affine
    quantization along the input (last) dimension, w = (q - zero) * scale, stored as three physical
    tensors ``name.q`` (uint8, rows x in*N/8, element 2j in the low nibble for q4, lowest bits
    first for q2), ``name.scales`` (float16, rows x in/group_size) and ``name.zeros`` (uint8,
    rows x in/group_size, 0 <= zero < 2**N).
    """

    type: str = "f32"
    """One of f32, f16, q8, q4, q2."""
    group_size: int = 0
    """Elements per quantization group along the input dimension (qN only); a multiple of 8."""

    def __post_init__(self) -> None:
        if self.type not in QUANT_TYPES:
            raise ConfigError(f"quantization type {self.type!r} is not one of {QUANT_TYPES}")
        if self.type in QUANT_BITS:
            _check_int("group_size", self.group_size, 8, MAX_DIM)
            if self.group_size % 8:
                raise ConfigError(f"group_size={self.group_size} must be a multiple of 8")
        elif self.group_size != 0:
            raise ConfigError(f"group_size={self.group_size} given for unquantized type {self.type}")

    @property
    def bits(self) -> int:
        return QUANT_BITS.get(self.type, 0)

    def physical(self, name: str, shape: Tuple[int, ...]) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        """Physical tensors (name -> (dtype, shape)) storing logical tensor `name` of `shape`.
        dtype is one of "f32", "f16", "u8". Raises ConfigError when shape and quantization disagree."""
        if self.type in ("f32", "f16"):
            return {name: (self.type, tuple(shape))}
        if len(shape) != 2:
            raise ConfigError(f"{name}: only 2-D tensors can be quantized, shape is {shape}")
        rows, cols = shape
        if cols % self.group_size:
            raise ConfigError(
                f"{name}: in_features={cols} is not a multiple of group_size={self.group_size}")
        groups = cols // self.group_size
        return {name + ".q": ("u8", (rows, cols * self.bits // 8)),
                name + ".scales": ("f16", (rows, groups)),
                name + ".zeros": ("u8", (rows, groups))}

    def to_dict(self) -> dict:
        d = {"type": self.type}
        if self.group_size:
            d["group_size"] = self.group_size
        return d

    @classmethod
    def from_dict(cls, d) -> "TensorQuant":
        if isinstance(d, str):
            return cls(type=d)
        if not isinstance(d, dict) or set(d) - {"type", "group_size"}:
            raise ConfigError(f"quantization entry must be {{type, group_size}}, got {d!r}")
        return cls(type=d.get("type", "f32"), group_size=d.get("group_size", 0))


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """float64 (head_dim / 2,): the RoPE frequency of each rotated pair, ``rope_theta ** (-2 i /
    head_dim)`` rescaled as cfg.rope_scaling says (its docstring has the formulas). Every backend,
    the float64 oracle and the PyTorch twin take their angles ``position * f_i`` from this."""
    D = cfg.head_dim
    f = cfg.rope_theta ** (-np.arange(0, D // 2, dtype=np.float64) * 2.0 / D)
    if cfg.rope_scaling == "linear":
        return f / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        P, lo, hi = float(cfg.rope_original_max_positions), cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelength = 2.0 * np.pi / f
        scaled = np.where(wavelength > P / lo, f / cfg.rope_factor, f)
        s = (P / wavelength - lo) / (hi - lo)
        blend = (1.0 - s) * scaled / cfg.rope_factor + s * scaled
        band = (wavelength >= P / hi) & (wavelength <= P / lo)
        return np.where(band, blend, scaled)
    return f
