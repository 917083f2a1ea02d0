"""Backend conformance suite: what every tinyloop backend must do (tinyloop.runtime.backend.Backend).

Not a test module itself (no ``test_`` prefix): runners import everything from it and provide the
``backend_factory`` fixture, a callable ``(cfg: ModelConfig, max_seq_len: int) -> Backend``
(scope module or wider)::

    tests/test_conformance_cpu.py         the CPU backend (main suite)
    tests/cuda/test_conformance_sim.py    the CUDA backend under numba's simulator (marker cudasim,
                                          its own pytest process, tiny shapes)
    tests/test_conformance_gpu.py         the CUDA backend on a real GPU (marker gpu)

A runner may also override ``conformance_dims`` (ModelConfig overrides of the models written here;
default: conftest.TINY), ``conformance_quick`` (True thins the loops of the costliest tests for a
slow backend, e.g. the simulator) and ``device_bytes_in_use`` (a callable giving the device memory in use, for
the no-allocation test; default None: not checked).

Every test checks one op of the contract against a naive numpy reference written at the top of this
module. Only the public contract is used: Backend methods, ``cache.spec`` / ``cache.n_slots`` /
``cache.nbytes``, and ``rows_to_host`` / ``logits_block_to_host`` to read activations. Inputs reach
the backend's buffers the way the forward puts them there (``set_ids`` + ``embed`` from a model
file written here, then ``rmsnorm`` / ``matmul``); every reference is computed from the inputs as
read back from the backend, so an op is judged on its own. The contract has no way to read a cache:
:func:`cache_storage` (documented below) reads the storage arrays of the two layouts known today
through ``rows_to_host`` and skips the checks that need it on any other layout; the cache tests
also check the same properties through ``attention`` alone, which needs nothing outside the
contract.

Tolerances by dtype: activations are float32, so ops that round (matmul, rmsnorm, swiglu, rope,
attention) are compared with float64 references within float32 accumulation bounds; ops that only
move or select values (embed, add, copy, rows, copy_cache, move_cache_slots, argmax, topk, batch
invariance, tree chains, the stored codes of a KV codec) are compared bit for bit. A KV codec's
effect is modelled exactly by the codec's own numpy reference (``codec.decode(*codec.encode(rows))``
of the rows the backend produced), so attention over any codec has the float32 tolerance too.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from tinyloop.model.arch import ModelConfig, TensorQuant, required_tensors, rope_inv_freq
import dataclasses

from tinyloop.runtime.backend import CAPABILITIES, Backend, TreeRows, Workspace
from tinyloop.runtime.cache import CacheMode, CacheSpec, LayerGroup, SlotMap, build_spec
from tinyloop.errors import BackendError
from tinyloop.model.format import open_model, write_model
from tinyloop.model.init_state import random_state
from tinyloop.runtime.forward import Forward
from tinyloop.runtime.plugins import get_plugin_manager
from tinyloop.model.reference import reference_logits

from conftest import TINY, random_weights

F32_EPS = float(np.finfo(np.float32).eps)

#: Weight storage formats of the model files (type, group size): every format the file stores.
WEIGHT_FORMATS = [("f32", 0), ("f16", 0), ("q8", 16), ("q4", 16), ("q2", 16)]
#: The built-in KV codecs (tinyloop/plugins/caches/codecs.py).
CODECS = ["fp32", "fp16", "int8", "int4"]
#: Rows of every workspace made here.
ROWS = 8
#: max_seq_len of the backends made here: positions up to ~3 * 128 + a few (a ring rounded to 128
#: slots, as the CUDA backend rounds it, wrapped three times).
MAX_SEQ = 512

#: Host bytes a few one-token decode steps may allocate at peak (test_no_allocation_in_decode_steps;
#: at most half a cache layer).
HOST_ALLOC_LIMIT = 64 * 1024

#: Relative tolerances (of the largest |reference| value, or of the |x| @ |W| bound for matmul).
TOL = dict(
    matmul=1e-5,        # float32 dot products of <= a few hundred terms
    rmsnorm=1e-5,
    swiglu=1e-5,
    attention=2e-5,     # float32 softmax and weighted sums over decoded rows
    # the whole forward against reference_logits (float64), by KV codec: the backend's K/V differ
    # from the float64 reference's in the last float32 bits, which moves a quantized code by one
    # step where it sits at a rounding boundary
    forward_fp32=1e-4, forward_fp16=1e-3, forward_int8=1e-2, forward_int4=5e-2,
)


# =============================================================================== numpy references
def ref_matmul(x, W, acc=None):
    """out[t, n] (+)= sum_k x[t, k] W[n, k] in float64, and the bound |x| @ |W|^T (+ |acc|)."""
    x64, W64 = np.asarray(x, np.float64), np.asarray(W, np.float64)
    out = x64 @ W64.T
    bound = np.abs(x64) @ np.abs(W64).T
    if acc is not None:
        out = out + np.asarray(acc, np.float64)
        bound = bound + np.abs(np.asarray(acc, np.float64))
    return out, bound


def ref_rmsnorm(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def ref_swiglu(g, u):
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    return g / (1.0 + np.exp(-g)) * u


def ref_rope(x, positions, n_heads, D, cfg):
    """Half-split RoPE of rows x (T, n_heads * D) at the given absolute positions (float64), with
    the model's frequencies (rope_inv_freq: rope_theta, rescaled as its rope_scaling says)."""
    x = np.asarray(x, np.float64)
    inv = rope_inv_freq(cfg)
    ang = np.asarray(positions, np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    xh = x.reshape(x.shape[0], n_heads, D)
    a, b = xh[..., : D // 2], xh[..., D // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape)


def ref_attention(q, keys, vals, n_heads, n_kv, D):
    """GQA attention in float64. q (T, H*D); keys[t] / vals[t] (n_t, Hkv, D): the rows query row t
    sees, in order. Query head h reads KV head h // (H / Hkv); scores scaled by 1/sqrt(D)."""
    q = np.asarray(q, np.float64)
    T, group = q.shape[0], n_heads // n_kv
    out = np.zeros((T, n_heads * D))
    for t in range(T):
        K, V = np.asarray(keys[t], np.float64), np.asarray(vals[t], np.float64)
        for h in range(n_heads):
            s = K[:, h // group] @ q[t, h * D:(h + 1) * D] / np.sqrt(D)
            p = np.exp(s - s.max())
            out[t, h * D:(h + 1) * D] = (p / p.sum()) @ V[:, h // group]
    return out


def ref_topk(row, k):
    """The k ids of largest value, best first, ties to the lower id."""
    return sorted(range(len(row)), key=lambda i: (-float(row[i]), i))[:k]


def codec_class(name):
    return get_plugin_manager().codec(name)


def codec_rows(codec, rows):
    """What a cache in `codec` holds for float32 rows (..., D): decode(encode(rows)), float32."""
    return codec.decode(*codec.encode(np.asarray(rows, np.float32)))


class RingModel:
    """The numpy model of one cache layer: slot contents (decoded K and V rows) and the slot map
    (window 0: slot = position, attend 0..p; window W: slot p % n_slots, attend the last W)."""

    def __init__(self, n_slots, window, n_kv, D):
        self.S, self.W = n_slots, window
        self.k = np.zeros((n_slots, n_kv, D), np.float32)
        self.v = np.zeros((n_slots, n_kv, D), np.float32)

    def slot(self, p):
        return p % self.S if self.W else p

    def store(self, p0, k, v):
        """Rows k, v (T, Hkv, D), already as the codec stores them, at positions p0 .. p0+T-1."""
        for t in range(k.shape[0]):
            self.k[self.slot(p0 + t)] = k[t]
            self.v[self.slot(p0 + t)] = v[t]

    def visible(self, p):
        """Slots position p attends to, in reduction (position) order."""
        j0 = max(0, p - self.W + 1) if self.W else 0
        return [self.slot(j) for j in range(j0, p + 1)]

    def attention(self, q, p0, n_heads, n_kv, D):
        T = q.shape[0]
        sl = [self.visible(p0 + t) for t in range(T)]
        return ref_attention(q, [self.k[s] for s in sl], [self.v[s] for s in sl], n_heads, n_kv, D)


# =============================================================================== helpers
def assert_close(got, ref, rtol, what):
    """max |got - ref| <= rtol * max |ref| (float64)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, expected {ref.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(got - ref).max()) / scale
    assert err <= rtol, f"{what}: max error {err:.3g} (of max |ref| {scale:.3g}) exceeds {rtol:g}"


def assert_bits(got, want, what):
    """Bit-for-bit equality of float arrays (or exact equality of others)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    if got.dtype.kind == "f":
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
        itype = {2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
        bad = got.view(itype) != want.view(itype)
    else:
        bad = got != want
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} elements differ, first at {idx}: "
                             f"{got[idx]!r} != {want[idx]!r}")


def spec_of(groups, n_slots, window=0, n_loop=1):
    """A CacheSpec of (name, n_layers, codec) groups, in order (the loop group last)."""
    return CacheSpec(tuple(LayerGroup(n, k, c) for n, k, c in groups), SlotMap(n_slots, window), n_loop)


def mode_of(codec):
    """A CacheMode storing every layer group in `codec`."""
    return type(f"Conformance_{codec}", (CacheMode,), {"name": f"conformance_{codec}", "codec": codec})


#: A spec with one group per built-in codec (global layers 0..3 = fp32, fp16, int8, int4).
def mixed_spec(n_slots, window=0):
    return spec_of([("pre", 1, "fp32"), ("post", 1, "fp16"), ("draft_post", 1, "int8"),
                    ("loop", 1, "int4")], n_slots, window)


def cache_storage(rig, cache):
    """Host copies of every storage array of `cache`, per layer group: [(k_arrays, v_arrays)], each
    a dict data / scale / zero -> numpy array of shape (n_layers, slots, n_kv[, cols]) (absent when
    the codec has none); data in the codec's ``data_dtype`` (a backend holding fp16 as uint16 bit
    patterns is viewed back as float16).

    The backend contract does not expose cache storage. This reads the two layouts that exist
    today, through the backend's own ``rows_to_host`` (then cast back to the array's dtype, which
    is exact for every code and scale): a CPU cache's ``groups`` are (codec, impl, K, V) tuples of
    storages with ``data`` / ``scale`` / ``zero`` arrays (empty placeholders when unused), a CUDA
    cache's are objects with ``k`` / ``v`` Rows of the same names (None when unused). Any other
    layout: the calling test is skipped (contract gap: no cache read-back)."""
    groups = getattr(cache, "groups", None)
    if groups is None or len(groups) != len(cache.spec.groups):
        pytest.skip("the cache exposes no storage arrays (the backend contract has no cache read-back)")
    out = []
    for g, lg in zip(groups, cache.spec.groups):
        if hasattr(g, "k") and hasattr(g, "v"):
            parts = (g.k, g.v)
        elif isinstance(g, tuple) and len(g) == 4:
            parts = (g[2], g[3])
        else:
            pytest.skip(f"unknown cache storage layout {type(g).__name__} (no cache read-back in the contract)")
        codec = codec_class(lg.codec)
        kv = []
        for st in parts:
            arrays = {}
            for name in ("data", "scale", "zero"):
                a = getattr(st, name, None)
                if a is None or int(np.prod(a.shape)) == 0:
                    continue
                h = np.asarray(rig.be.rows_to_host(a, a.shape[0])).astype(a.dtype)
                if name == "data" and h.dtype != np.dtype(codec.data_dtype):
                    h = h.view(codec.data_dtype)
                arrays[name] = h
            kv.append(arrays)
        out.append(tuple(kv))
    return out


class Rig:
    """One backend from `factory` with a model file loaded (``load_weights``) and one workspace of
    ROWS rows; ``W`` holds the file's logical (dequantized float32) tensors."""

    def __init__(self, factory, path, max_seq_len=MAX_SEQ, rows=ROWS):
        self.mf = open_model(str(path))
        self.cfg = self.mf.header.config
        self.W = {n: np.array(self.mf.logical(n), np.float32) for n in required_tensors(self.cfg)}
        self.be = factory(self.cfg, max_seq_len)
        assert isinstance(self.be, Backend)
        self.w = self.be.load_weights(self.mf)
        self.ws = self.be.alloc_workspace(rows)

    @property
    def head(self):
        return self.W["embed"] if self.cfg.tied_embeddings else self.W["head"]

    def host(self, buf, n):
        """Rows 0..n-1 of an activation buffer as a float32 host copy (rows_to_host)."""
        return np.array(self.be.rows_to_host(buf, n), np.float32)

    def embed(self, ids, out=None):
        """out[0:T] = embedding rows of ids (the forward's first op); returns them as read back."""
        out = self.ws.x if out is None else out
        self.be.embed(self.w.embed, self.be.set_ids(self.ws, list(ids)), out, len(ids))
        return self.host(out, len(ids))

    def fill_qkv(self, ids, blk=None):
        """ws.q / ws.k / ws.v = projections of rmsnorm(embed(ids)) by block `blk` (default loop.0),
        as the attention half makes them; returns host copies (un-rotated)."""
        be, ws = self.be, self.ws
        blk = self.w.loop[0] if blk is None else blk
        T = len(ids)
        self.embed(ids)
        be.rmsnorm(ws.x, blk.attn_norm, ws.h, T)
        be.matmul(ws.h, blk.wq, ws.q, T)
        be.matmul(ws.h, blk.wk, ws.k, T)
        be.matmul(ws.h, blk.wv, ws.v, T)
        return self.host(ws.q, T), self.host(ws.k, T), self.host(ws.v, T)

    def append(self, cache, layer, pos, ids):
        """fill_qkv(ids), then rope_kv_append at `pos` (an int or a position handle); returns the
        rotated q and k and the v rows as read back after the op, as (T, H*D), (T, Hkv, D) x 2.
        ``self.pre`` keeps the (q, k) rows before the op."""
        c = self.cfg
        T = len(ids)
        q0, k0, _ = self.fill_qkv(ids)
        self.pre = (q0, k0)
        handle = self.be.positions(pos) if isinstance(pos, int) else pos
        self.be.rope_kv_append(self.ws.q, self.ws.k, self.ws.v, cache, layer, handle, T)
        shape = (T, c.n_kv_heads, c.head_dim)
        return (self.host(self.ws.q, T), self.host(self.ws.k, T).reshape(shape),
                self.host(self.ws.v, T).reshape(shape))

    def attend(self, cache, layer, pos, T, out=None):
        out = self.ws.att if out is None else out
        handle = self.be.positions(pos) if isinstance(pos, int) else pos
        self.be.attention(self.ws.q, cache, layer, handle, T, out)
        return self.host(out, T)

    def close(self):
        self.be.free()
        self.mf.close()


def write_model_file(path, dims, quant="f32", group_size=0, seed=0, edit=None):
    """A model file of ModelConfig(**dims) with conftest.random_weights (then `edit(weights)`)."""
    cfg = ModelConfig(**dims)
    w = random_weights(cfg, seed)
    if edit is not None:
        edit(cfg, w)
    write_model(str(path), cfg, w, default_quant=TensorQuant(quant, group_size))
    return cfg


# =============================================================================== fixtures
@pytest.fixture(scope="module")
def conformance_dims():
    """ModelConfig overrides of the models the suite writes (a runner may override this)."""
    return dict(TINY)


@pytest.fixture(scope="module")
def conformance_quick():
    """True: thin the loops of the costliest tests (fewer row counts, fewer single-row launches,
    fewer ring launches) for a slow backend such as numba's CUDA simulator; every test keeps its
    checks."""
    return False


@pytest.fixture(scope="module")
def device_bytes_in_use():
    """A callable returning the device memory in use (bytes), or None where not measurable (the
    contract has no way to ask a backend what it allocates on its device)."""
    return None


@pytest.fixture(scope="module")
def rig(backend_factory, conformance_dims, tmp_path_factory):
    """A float32 model on the backend under test."""
    path = tmp_path_factory.mktemp("conformance") / "f32.tinyloop"
    write_model_file(path, conformance_dims, "f32", seed=11)
    r = Rig(backend_factory, path)
    yield r
    r.close()


@pytest.fixture(scope="module", params=WEIGHT_FORMATS, ids=[q for q, _ in WEIGHT_FORMATS])
def quant_rig(request, backend_factory, conformance_dims, tmp_path_factory):
    """A model in each weight storage format on the backend under test."""
    quant, group = request.param
    path = tmp_path_factory.mktemp("conformance") / f"{quant}.tinyloop"
    write_model_file(path, conformance_dims, quant, group, seed=12)
    r = Rig(backend_factory, path)
    yield r
    r.close()


#: Probe rows of the ties model: token i < len(PROBES) embeds as the unit vector e_i, so its
#: logits row (x @ head^T) is exactly column i of `head`, set below.
def _probe_columns(V):
    rng = np.random.default_rng(7)
    cols = []
    c = rng.uniform(-1, 1, V); c[[5, V - 3]] = 2.0; cols.append(c)             # tie of the max, far apart
    cols.append(np.zeros(V))                                                     # all equal
    c = np.full(V, -1.0); c[[V - 2, V - 1]] = -0.5; cols.append(c)             # negative, tie at the end
    cols.append(rng.permutation(V) / V - 0.5)                                    # distinct
    c = rng.uniform(-1, 1, V); c[9] = 3.0; c[[3, 7, 11]] = 1.5; cols.append(c)  # tie in second place
    cols.append(np.floor(rng.uniform(0, 4, V)))                                  # many ties
    return np.stack(cols, 1).astype(np.float32)


@pytest.fixture(scope="module")
def ties_rig(backend_factory, conformance_dims, tmp_path_factory):
    def edit(cfg, w):
        cols = _probe_columns(cfg.vocab_size)
        n = cols.shape[1]
        assert cfg.d_model >= n and cfg.vocab_size > 11 and not cfg.tied_embeddings
        w["embed"][:n] = np.eye(n, cfg.d_model, dtype=np.float32)
        w["head"][:] = 0.0
        w["head"][:, :n] = cols
    path = tmp_path_factory.mktemp("conformance") / "ties.tinyloop"
    write_model_file(path, conformance_dims, "f32", seed=13, edit=edit)
    r = Rig(backend_factory, path)
    yield r
    r.close()


@pytest.fixture(scope="module")
def fwd_rig(backend_factory, conformance_dims, tmp_path_factory):
    """A q4 model (quantized matmuls in every block) for whole-forward tests; max_seq_len 2048 (the
    no-allocation test's cache of 2048 slots)."""
    path = tmp_path_factory.mktemp("conformance") / "fwd.tinyloop"
    write_model_file(path, conformance_dims, "q4", 16, seed=14)
    r = Rig(backend_factory, path, max_seq_len=2048)
    yield r
    r.close()


def _ids(rig, n, seed):
    return [int(i) for i in np.random.default_rng(seed).integers(0, rig.cfg.vocab_size, n)]


# =============================================================================== contract
def test_capabilities_are_declared(rig):
    """A backend's optional capabilities are the capability classes it inherits: each one it claims
    has every method of that class implemented (nothing abstract left), supports() agrees, and an
    unknown capability name is a typed error."""
    be = rig.be
    assert isinstance(be, Backend)
    assert be.capabilities <= set(CAPABILITIES)
    assert not getattr(type(be), "__abstractmethods__", None), "abstract methods left unimplemented"
    for name, cls in CAPABILITIES.items():
        assert be.supports(name) == (name in be.capabilities)
        assert isinstance(be, cls) or name not in be.capabilities
    with pytest.raises(BackendError, match="warp_drive"):
        be.supports("warp_drive")


def test_workspace_declares_every_buffer(rig):
    """Every workspace buffer is a declared dataclass field (an undeclared attribute cannot be
    set), the core buffers exist with rows rows each, and buffers() lists every field."""
    ws, cfg = rig.ws, rig.cfg
    assert isinstance(ws, Workspace) and dataclasses.is_dataclass(ws)
    names = {f.name for f in dataclasses.fields(ws)} - {"rows"}
    assert set(ws.buffers()) == names
    with pytest.raises(AttributeError):
        ws.not_declared = 1
    widths = dict(x=cfg.d_model, h=cfg.d_model, e=cfg.d_model, q=cfg.q_dim, k=cfg.kv_dim, v=cfg.kv_dim,
                  att=cfg.q_dim, g=cfg.d_ff, u=cfg.d_ff, logits=cfg.vocab_size)
    for name, width in widths.items():
        buf = getattr(ws, name)
        assert tuple(buf.shape) == (ws.rows, width), f"ws.{name} has shape {tuple(buf.shape)}"
    assert ws.ids is not None and int(ws.ids.shape[0]) >= ws.rows


# =============================================================================== elementwise / rows
def test_embed_is_the_dequantized_table_row(quant_rig):
    r = quant_rig
    V = r.cfg.vocab_size
    ids = [0, V - 1, 3, 3, V // 2, 1, V - 1, 7][:ROWS]
    assert_bits(r.embed(ids), r.W["embed"][ids], f"embed ({r.mf.header.quant['embed'].type})")
    # one row alone, into row 0 of another buffer
    assert_bits(r.embed([V - 2], out=r.ws.e), r.W["embed"][[V - 2]], "one-row embed")


def test_rmsnorm(rig):
    ids = _ids(rig, ROWS, 1)
    x = rig.embed(ids)
    for name, blk in (("loop.0.attn_norm", rig.w.loop[0].attn_norm), ("final_norm", rig.w.final_norm)):
        rig.be.rmsnorm(rig.ws.x, blk, rig.ws.h, ROWS)
        got = rig.host(rig.ws.h, ROWS)
        ref = ref_rmsnorm(x, rig.W[name], rig.cfg.norm_eps)
        for t in range(ROWS):
            assert_close(got[t], ref[t], TOL["rmsnorm"], f"rmsnorm {name} row {t}")


def test_rmsnorm_touches_only_T_rows(rig):
    rig.embed(_ids(rig, ROWS, 2), out=rig.ws.h)
    before = rig.host(rig.ws.h, ROWS)
    rig.embed(_ids(rig, ROWS, 3))
    rig.be.rmsnorm(rig.ws.x, rig.w.final_norm, rig.ws.h, 3)
    assert_bits(rig.host(rig.ws.h, ROWS)[3:], before[3:], "rmsnorm rows >= T")


def _check_matmul(r, xbuf, W_name, W, out, T, accumulate=False):
    be = r.be
    x = r.host(xbuf, T)
    before = r.host(out, r.ws.rows)
    be.matmul(xbuf, W, out, T, accumulate=accumulate)
    got = r.host(out, r.ws.rows)
    ref, bound = ref_matmul(x, r.W[W_name] if W_name in r.W else r.head, before[:T] if accumulate else None)
    err = np.abs(got[:T] - ref)
    lim = TOL["matmul"] * bound + 1e-30
    kind = r.mf.header.quant[W_name].type
    assert np.all(err <= lim), (f"matmul{' accumulate' if accumulate else ''} {W_name} ({kind}), T={T}: "
                                f"error {float((err / lim).max()):.3g} x the float32 bound")
    assert_bits(got[T:], before[T:], f"matmul {W_name}: rows >= T")


def test_matmul(quant_rig, conformance_quick):
    """out = x @ W^T over the weights as the file stores them (dequantized exactly), plain and
    accumulating, for q|k|v / o / gate / down / head shapes, at T = 1, 3 and all rows; rows >= T
    untouched."""
    r, be, ws = quant_rig, quant_rig.be, quant_rig.ws
    blk = r.w.loop[0]
    for T in ((1, ROWS) if conformance_quick else (1, 3, ROWS)):
        r.embed(_ids(r, ROWS, 4 + T))
        be.rmsnorm(ws.x, blk.attn_norm, ws.h, ROWS)
        _check_matmul(r, ws.h, "loop.0.wq", blk.wq, ws.q, T)
        _check_matmul(r, ws.h, "loop.0.wk", blk.wk, ws.k, T)
        _check_matmul(r, ws.h, "loop.0.w_gate", blk.w_gate, ws.g, T)
        _check_matmul(r, ws.h, "head" if not r.cfg.tied_embeddings else "embed", r.w.head, ws.logits, T)
        be.matmul(ws.h, blk.wq, ws.q, ROWS)
        _check_matmul(r, ws.q, "loop.0.wo", blk.wo, ws.x, T, accumulate=True)
        be.matmul(ws.h, blk.w_up, ws.g, ROWS)
        _check_matmul(r, ws.g, "loop.0.w_down", blk.w_down, ws.x, T, accumulate=True)


def test_matmul_batch_invariant(quant_rig, conformance_quick):
    """Row t of a T-row matmul is bit-identical to the same row launched alone (T = 1, row 0), and
    to the same row of a shorter launch: the reduction order does not depend on T."""
    r, be, ws = quant_rig, quant_rig.be, quant_rig.ws
    blk = r.w.loop[0]
    ids = _ids(r, ROWS, 5)

    def run(rows):
        n = len(rows)
        r.embed(rows)
        be.rmsnorm(ws.x, blk.attn_norm, ws.h, n)
        outs = {}
        for name, W, xin, out in (("wq", blk.wq, ws.h, ws.q), ("w_gate", blk.w_gate, ws.h, ws.g),
                                  ("head", r.w.head, ws.h, ws.logits), ("w_down", blk.w_down, ws.g, ws.e)):
            be.matmul(xin, W, out, n)
            outs[name] = r.host(out, n)
        return outs

    full = run(ids)
    for T in ((3,) if conformance_quick else (2, 5)):
        part = run(ids[:T])
        for name in full:
            assert_bits(part[name], full[name][:T], f"matmul {name}: {T}-row launch vs {ROWS}-row launch")
    for t in ((0, 3, ROWS - 1) if conformance_quick else range(ROWS)):
        one = run([ids[t]])
        for name in full:
            assert_bits(one[name][0], full[name][t], f"matmul {name}: row {t} alone vs in a {ROWS}-row launch")


@pytest.mark.parametrize("out_name", ["g", "u"])
def test_swiglu(rig, out_name):
    """out = silu(g) * u, including in place (out is g, as mlp_half calls it, or u)."""
    be, ws, blk = rig.be, rig.ws, rig.w.loop[0]
    T = 5
    rig.embed(_ids(rig, ROWS, 6))
    be.rmsnorm(ws.x, blk.mlp_norm, ws.h, ROWS)
    be.matmul(ws.h, blk.w_gate, ws.g, ROWS)
    be.matmul(ws.h, blk.w_up, ws.u, ROWS)
    g, u = rig.host(ws.g, ROWS), rig.host(ws.u, ROWS)
    out = getattr(ws, out_name)
    be.swiglu(ws.g, ws.u, out, T)
    got = rig.host(out, ROWS)
    ref = ref_swiglu(g[:T], u[:T])
    for t in range(T):
        assert_close(got[t], ref[t], TOL["swiglu"], f"swiglu row {t}")
    assert_bits(got[T:], (g if out_name == "g" else u)[T:], "swiglu rows >= T")


def test_add_and_copy(rig):
    be, ws = rig.be, rig.ws
    T = 5
    x = rig.embed(_ids(rig, ROWS, 7))
    y = rig.embed(_ids(rig, ROWS, 8), out=ws.e)
    be.add(ws.x, ws.e, T)
    got = rig.host(ws.x, ROWS)
    assert_bits(got[:T], (x[:T] + y[:T]).astype(np.float32), "add")
    assert_bits(got[T:], x[T:], "add rows >= T")
    assert_bits(rig.host(ws.e, ROWS), y, "add leaves y")
    be.copy(ws.e, ws.x, 3)
    assert_bits(rig.host(ws.e, ROWS), np.concatenate([got[:3], y[3:]]), "copy")
    # the residual stashes of speculative verify-resume
    for stash in (ws.snap_x, ws.snap_e):
        if stash is not None:
            be.copy(stash, ws.x, ROWS)
            assert_bits(rig.host(stash, ROWS), got, "copy into a snapshot buffer")


def test_rows_views(rig):
    """rows(buf, r0) is a view starting at row r0: ops on views read and write exactly those rows,
    with the values of the same rows of a whole launch."""
    be, ws, blk = rig.be, rig.ws, rig.w.loop[0]
    x = rig.embed(_ids(rig, ROWS, 9))
    e = rig.embed(_ids(rig, ROWS, 10), out=ws.e)
    be.copy(be.rows(ws.e, 2), be.rows(ws.x, 1), 3)
    want = e.copy()
    want[2:5] = x[1:4]
    assert_bits(rig.host(ws.e, ROWS), want, "copy(rows(e, 2), rows(x, 1), 3)")
    assert_bits(rig.host(be.rows(ws.e, 2), 3), x[1:4], "rows_to_host of a view")
    be.rmsnorm(ws.x, blk.attn_norm, ws.h, ROWS)
    be.matmul(ws.h, blk.wq, ws.q, ROWS)
    full = rig.host(ws.q, ROWS)
    be.matmul(be.rows(ws.h, 3), blk.wq, be.rows(ws.att, 1), 2)
    assert_bits(rig.host(ws.att, 3)[1:3], full[3:5], "matmul on row views")
    be.add(be.rows(ws.x, 6), be.rows(ws.e, 0), 2)
    assert_bits(rig.host(ws.x, ROWS)[6:], (x[6:] + want[:2]).astype(np.float32), "add on row views")


# =============================================================================== attention
LAUNCHES = [(0, 5), (5, 1), (6, 2)]   # (first position, rows): a prefill chunk, a decode step, a chunk


def _check_rope(rig, q_before, k_before, q_after, k_after, positions):
    """Rotated q and k against the float64 RoPE of the rows before the op. The angle's float32
    rounding (p * inv_freq in float32, as the CUDA table is made) grows with the position."""
    c = rig.cfg
    tol = 1e-6 + 2 * F32_EPS * (max(positions) + 16)
    assert_close(q_after, ref_rope(q_before, positions, c.n_heads, c.head_dim, c), tol, "rope(q)")
    assert_close(k_after.reshape(k_before.shape),
                 ref_rope(k_before, positions, c.n_kv_heads, c.head_dim, c), tol, "rope(k)")


@pytest.mark.parametrize("codec", CODECS)
def test_rope_kv_append_and_attention(rig, codec):
    """For every codec (in a mixed-codec cache: the group is found by cache.spec.group_of): RoPE
    in place on q and k at positions pos+t; attention over the codec's decoded rows of the rotated
    k and v (decode(encode(rows))) within float32 tolerance, over prefill chunks and decode steps;
    the stored codes, scales and zero points are encode()'s bit for bit."""
    c, be = rig.cfg, rig.be
    spec = spec_of([("pre", 1, "fp32"), ("loop", 2, codec)], 16)
    cache = be.alloc_cache(spec)
    cc = codec_class(codec)
    layer = 2                                # the second layer of the codec's group
    model = RingModel(cache.n_slots, 0, c.n_kv_heads, c.head_dim)
    written = {}
    try:
        for i, (p0, T) in enumerate(LAUNCHES):
            q, k, v = rig.append(cache, layer, p0, _ids(rig, T, 20 + i))
            _check_rope(rig, *rig.pre, q, k, [p0 + t for t in range(T)])
            model.store(p0, codec_rows(cc, k), codec_rows(cc, v))
            for t in range(T):
                written[p0 + t] = (k[t], v[t])
            got = rig.attend(cache, layer, p0, T)
            assert_close(got, model.attention(q, p0, c.n_heads, c.n_kv_heads, c.head_dim), TOL["attention"],
                         f"attention over a {codec} cache, launch at {p0} of {T} rows")
        # the stored format, bit for bit (needs the cache read-back helper)
        (kst, vst) = cache_storage(rig, cache)[1]
        slots = sorted(written)
        for st, which in ((kst, 0), (vst, 1)):
            rows = np.stack([written[s][which] for s in slots])
            data, scale, zero = cc.encode(rows)
            assert_bits(st["data"][1, slots], data, f"{codec} {'kv'[which]} codes")
            if cc.has_scale:
                assert_bits(st["scale"][1, slots], scale, f"{codec} {'kv'[which]} scales")
            if cc.has_zero:
                assert_bits(st["zero"][1, slots], zero, f"{codec} {'kv'[which]} zero points")
            # nothing else written: other layers and slots stay zero
            for name, a in st.items():
                rest = np.delete(a[1], slots, axis=0)
                assert not rest.any() and not a[0].any(), f"{codec} {name}: writes outside the launch's slots"
        for name, a in cache_storage(rig, cache)[0][0].items():
            assert not a.any(), "a launch into one group wrote another group"
    finally:
        be.release_cache(cache)


def test_attention_reads_its_own_layer_and_group(rig):
    """Four layers in four codec groups hold different rows: each layer's attention reads its own."""
    c, be = rig.cfg, rig.be
    cache = be.alloc_cache(mixed_spec(16))
    T = 4
    try:
        rows = {}
        for layer in range(4):
            rows[layer] = rig.append(cache, layer, 0, _ids(rig, T, 30 + layer))
        for layer, lg in enumerate(cache.spec.groups):
            cc = codec_class(lg.codec)
            q = rows[3][0]                     # the last launch's rotated q sits in ws.q
            _, k, v = rows[layer]
            model = RingModel(cache.n_slots, 0, c.n_kv_heads, c.head_dim)
            model.store(0, codec_rows(cc, k), codec_rows(cc, v))
            got = rig.attend(cache, layer, 0, T)
            assert_close(got, model.attention(q, 0, c.n_heads, c.n_kv_heads, c.head_dim), TOL["attention"],
                         f"attention of layer {layer} ({lg.codec})")
    finally:
        be.release_cache(cache)


@pytest.mark.parametrize("codec", CODECS)
def test_ring_slot_map(rig, codec, conformance_quick):
    """SlotMap(n_slots=R, window=W): position p at slot p % R (R = cache.n_slots, the allocated
    ring), attention over positions max(0, p-W+1) .. p; launches far past R (the ring wrapped
    several times). The numpy model tracks every slot, stale ones included."""
    c, be = rig.cfg, rig.be
    W, T = 3, 4
    cache = be.alloc_cache(spec_of([("pre", 1, "fp32"), ("loop", 1, codec)], W + T - 1, window=W))
    try:
        assert cache.spec.slots.window == W and cache.spec.slots.ring
        R = cache.n_slots
        assert R >= W + T - 1
        model = RingModel(R, W, c.n_kv_heads, c.head_dim)
        cc = codec_class(codec)
        launches = [(0, T), (T, T), (R - 2, T), (R + 2, 1), (3 * R + 2, T), (3 * R + 2 + T, 2)]
        if conformance_quick:
            launches = [(0, T), (R - 2, T), (R + 2, 1), (3 * R + 2, T)]
        assert launches[-1][0] + 2 < MAX_SEQ
        for i, (p0, n) in enumerate(launches):
            q, k, v = rig.append(cache, 1, p0, _ids(rig, n, 40 + i))
            model.store(p0, codec_rows(cc, k), codec_rows(cc, v))
            got = rig.attend(cache, 1, p0, n)
            assert_close(got, model.attention(q, p0, c.n_heads, c.n_kv_heads, c.head_dim), TOL["attention"],
                         f"ring attention ({codec}, R={R}, W={W}), launch at {p0} of {n} rows")
    finally:
        be.release_cache(cache)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_attention_batch_invariant(rig, codec, conformance_quick):
    """Row t of a T-row rope_kv_append + attention launch is bit-identical to the same row launched
    alone (one row at position pos + t, after the rows before it), after a prefix. Rows not
    launched alone reach the second cache as chunks (themselves batch-invariant)."""
    be = rig.be
    spec = spec_of([("pre", 1, codec), ("loop", 1, codec)], 32)
    a, b = be.alloc_cache(spec), be.alloc_cache(spec)
    try:
        prefix = _ids(rig, 3, 50)
        ids = _ids(rig, ROWS, 51)
        for cache in (a, b):
            rig.append(cache, 1, 0, prefix)
        q_all, k_all, _ = rig.append(a, 1, 3, ids)
        out_all = rig.attend(a, 1, 3, ROWS)
        alone = (0, ROWS - 1) if conformance_quick else range(ROWS)
        done = 0
        for t in alone:
            if t > done:
                rig.append(b, 1, 3 + done, ids[done:t])
            q, k, _ = rig.append(b, 1, 3 + t, [ids[t]])
            done = t + 1
            assert_bits(q[0], q_all[t], f"rotated q, row {t} alone")
            assert_bits(k[0], k_all[t], f"rotated k, row {t} alone")
            assert_bits(rig.attend(b, 1, 3 + t, 1)[0], out_all[t],
                        f"attention ({codec}) row {t} alone vs in a {ROWS}-row launch")
    finally:
        be.release_cache(a)
        be.release_cache(b)


# =============================================================================== tree rows
def _needs(be, capability):
    if not be.supports(capability):
        pytest.skip(f"the {be.name} backend does not provide the optional capability {capability!r}")


def _tree_rows(rig, depth, path, pos, row0=0):
    _needs(rig.be, "tree")
    layout = rig.be.tree_layout(np.asarray(depth, np.int32), np.asarray(path, np.int32))
    return rig.be.tree_positions(layout, pos, row0)


def test_tree_chain_equals_causal(rig):
    """TreeRows of a chain (depth t, path 0..t) is causal attention, bit for bit: rotated q, the
    attention rows and what later causal launches read from the cache."""
    be = rig.be
    spec = spec_of([("pre", 1, "fp32"), ("loop", 1, "int8")], 32)
    n, C = 5, 3
    depth = np.arange(n)
    path = np.array([[i if i <= t else 0 for i in range(n)] for t in range(n)])
    a, b = be.alloc_cache(spec), be.alloc_cache(spec)
    try:
        ctx, ids, nxt = _ids(rig, C, 60), _ids(rig, n, 61), _ids(rig, 2, 62)
        outs = []
        for cache, tree in ((a, False), (b, True)):
            rig.append(cache, 1, 0, ctx)
            pos = _tree_rows(rig, depth, path, C) if tree else C
            q, _, _ = rig.append(cache, 1, pos, ids)
            pos = _tree_rows(rig, depth, path, C) if tree else C
            out = rig.attend(cache, 1, pos, n)
            rig.append(cache, 1, C + n, nxt)
            outs.append((q, out, rig.attend(cache, 1, C + n, 2)))
        for what, x, y in zip(("rotated q", "attention", "later causal attention"), outs[0], outs[1]):
            assert_bits(y, x, f"chain tree vs causal: {what}")
    finally:
        be.release_cache(a)
        be.release_cache(b)


def test_tree_rows_branching(rig):
    """A branching draft tree: node t at RoPE position pos + depth[t], K/V at slot pos + t (its own
    path entry), attending to the context 0..pos-1 then its path; launched whole and in two chunks
    (tree_positions with row0), which agree bit for bit."""
    c, be = rig.cfg, rig.be
    #          0
    #        /   \
    #       1     2
    #      / \     \
    #     3   4     5
    depth = np.array([0, 1, 1, 2, 2, 2])
    path = np.array([[0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 1, 3], [0, 1, 4], [0, 2, 5]])
    n, C = len(depth), 4
    spec = spec_of([("pre", 1, "fp32"), ("loop", 1, "fp16")], 32)
    cc = codec_class("fp16")
    a, b = be.alloc_cache(spec), be.alloc_cache(spec)
    try:
        ctx, ids = _ids(rig, C, 70), _ids(rig, n, 71)
        _, kc, vc = rig.append(a, 1, 0, ctx)
        rig.append(b, 1, 0, ctx)
        q, k, v = rig.append(a, 1, _tree_rows(rig, depth, path, C), ids)
        _check_rope(rig, *rig.pre, q, k, list(C + depth))
        got = rig.attend(a, 1, _tree_rows(rig, depth, path, C), n)
        K = np.concatenate([codec_rows(cc, kc), codec_rows(cc, k)])
        V = np.concatenate([codec_rows(cc, vc), codec_rows(cc, v)])
        sees = [list(range(C)) + [C + int(path[t, i]) for i in range(depth[t] + 1)] for t in range(n)]
        ref = ref_attention(q, [K[s] for s in sees], [V[s] for s in sees], c.n_heads, c.n_kv_heads, c.head_dim)
        assert_close(got, ref, TOL["attention"], "tree attention")
        # the same tree in two launches: nodes 0..2, then nodes 3..5 (row0 = 3, row views)
        ws = rig.ws
        rig.fill_qkv(ids)
        for r0, m in ((0, 3), (3, 3)):
            rows = _tree_rows(rig, depth, path, C, row0=r0)
            be.rope_kv_append(be.rows(ws.q, r0), be.rows(ws.k, r0), be.rows(ws.v, r0), b, 1, rows, m)
        for r0, m in ((0, 3), (3, 3)):
            rows = _tree_rows(rig, depth, path, C, row0=r0)
            be.attention(be.rows(ws.q, r0), b, 1, rows, m, be.rows(ws.att, r0))
        assert_bits(rig.host(ws.q, n), q, "tree in two launches: rotated q")
        assert_bits(rig.host(ws.att, n), got, "tree in two launches: attention")
    finally:
        be.release_cache(a)
        be.release_cache(b)


def test_tree_rows_refused_on_a_ring(rig):
    be = rig.be
    cache = be.alloc_cache(spec_of([("pre", 1, "fp32"), ("loop", 1, "fp32")], 8, window=4))
    try:
        rig.fill_qkv([1, 2])
        with pytest.raises(BackendError):
            be.rope_kv_append(rig.ws.q, rig.ws.k, rig.ws.v, cache, 1,
                              _tree_rows(rig, [0, 1], [[0, 0], [0, 1]], 0), 2)
    finally:
        be.release_cache(cache)


# =============================================================================== argmax / top-k
def _probe_logits(r):
    """ws.logits rows 0..5 = the probe columns (exact: x is a unit vector), read back."""
    be, ws = r.be, r.ws
    n = _probe_columns(r.cfg.vocab_size).shape[1]
    r.embed(list(range(n)))
    be.matmul(ws.x, r.w.head, ws.logits, n)
    logits = np.array(be.logits_block_to_host(ws, n), np.float32)
    assert_bits(logits, _probe_columns(r.cfg.vocab_size).T, "probe logits")
    return logits


def test_argmax_ties_to_lowest_id(ties_rig):
    r, be, ws = ties_rig, ties_rig.be, ties_rig.ws
    logits = _probe_logits(r)
    n = logits.shape[0]
    want = [int(np.argmax(row)) for row in logits]
    be.launch_argmax_rows(ws, n)
    assert be.read_argmax_rows(ws, n) == want
    for i in range(n):
        r.embed([i])
        be.matmul(ws.x, r.w.head, ws.logits, 1)
        assert_bits(np.array(be.logits_to_host(ws, 0), np.float32), logits[i], "logits_to_host")
        be.launch_argmax(ws)
        assert be.read_argmax(ws) == want[i], f"argmax of probe {i}"


@pytest.mark.parametrize("k", [1, 4, 8])
def test_topk_ties_to_lowest_id(ties_rig, k):
    r, be, ws = ties_rig, ties_rig.be, ties_rig.ws
    _needs(be, "tree")
    logits = _probe_logits(r)
    n = logits.shape[0]
    be.launch_topk_rows(ws, n, k)
    assert be.read_topk_rows(ws, n, k) == [ref_topk(row, k) for row in logits]


def test_device_chained_ids(ties_rig):
    """device_chaining backends: top-k ids written into ws.ids (out_row), argmax tokens stored
    with store_token, read back with read_ids; begin/finish_read_argmax."""
    r, be, ws = ties_rig, ties_rig.be, ties_rig.ws
    _needs(be, "device_chaining")
    _needs(be, "tree")
    logits = _probe_logits(r)
    n, k = 3, 2
    be.launch_topk_rows(ws, n, k, out_row=1)
    got = be.read_ids(ws, 1 + n * k)[1:]
    assert got == [i for row in logits[:n] for i in ref_topk(row, k)]
    for i in (4, 2):
        r.embed([i])
        be.matmul(ws.x, r.w.head, ws.logits, 1)
        be.launch_argmax(ws)
        be.store_token(ws, 0)
        be.begin_read_argmax(ws)
        assert be.finish_read_argmax(ws) == int(np.argmax(logits[i]))
        assert be.read_ids(ws, 1) == [int(np.argmax(logits[i]))]


def test_device_acceptance(ties_rig):
    """device_acceptance backends: launch_accept finds the longest prefix of drafts the verify argmax
    rows agree with, leaves verified[n] as the device token and advances the position handle by
    n + 1; the record read through either host slot says so (its position read by the next
    acceptance); k outside the workspace and a bad slot are BackendErrors."""
    r, be, ws = ties_rig, ties_rig.be, ties_rig.ws
    _needs(be, "device_acceptance")
    logits = _probe_logits(r)
    want = [int(np.argmax(row)) for row in logits]
    k = len(want) - 1
    p = 3
    pos = be.positions(p)
    for slot, agree in ((0, 2), (1, 0), (0, k)):
        r.embed(list(range(len(want))))
        be.matmul(ws.x, r.w.head, ws.logits, len(want))
        be.launch_argmax_rows(ws, k + 1)
        drafts = [want[i] if i < agree else (want[i] + 1) % r.cfg.vocab_size for i in range(k)]
        be.set_ids(ws, [11] + drafts)
        assert be.device_position() is pos
        be.launch_accept(ws, k)
        be.begin_read_cycle(ws, k, slot)
        assert be.finish_read_cycle(ws, k, slot) == (p, agree, [11] + drafts, want)
        assert be.read_argmax(ws) == want[agree]
        p += agree + 1
    with pytest.raises(BackendError):
        be.launch_accept(ws, ws.rows)
    with pytest.raises(BackendError):
        be.begin_read_cycle(ws, k, 2)
    with pytest.raises(BackendError, match="cache"):
        be.launch_accept(ws, 1, 2)                  # a tree names the cache its path is compacted in


def test_device_acceptance_tree(ties_rig):
    """device_acceptance over a two-branch tree of depth 1 (nodes: root, two children): the walk
    takes the second child (the first does not hold the verify argmax), the device token becomes
    the argmax after it, the position advances by 2, and the child's cache slot moves to the slot
    of its depth in every layer (codes, scales, zero points), the rest of the cache untouched."""
    r, be, ws = ties_rig, ties_rig.be, ties_rig.ws
    _needs(be, "device_acceptance")
    _needs(be, "tree")
    want = [int(np.argmax(row)) for row in _probe_logits(r)][:3]
    be.launch_argmax_rows(ws, 3)
    p = 3
    cache = be.alloc_cache(mixed_spec(16))
    try:
        _fill_all_layers(r, cache, ROWS, 120)
        before = cache_storage(r, cache) if _has_storage(cache) else None
        ids = [11, (want[0] + 1) % r.cfg.vocab_size, want[0]]
        be.set_ids(ws, ids)
        be.positions(p)
        be.launch_accept(ws, 1, 2, cache)
        be.begin_read_cycle(ws, 1, 1, 2)
        assert be.finish_read_cycle(ws, 1, 1, 2) == (p, 1, ids, want)
        assert be.read_argmax(ws) == want[2]
        if before is not None:
            for gi, (g0, g1) in enumerate(zip(before, cache_storage(r, cache))):
                for st0, st1 in zip(g0, g1):
                    for name in st0:
                        moved = st0[name].copy()
                        moved[:, p + 1] = moved[:, p + 2]
                        assert_bits(st1[name], moved, f"tree acceptance {cache.spec.groups[gi].codec} {name}")
    finally:
        be.release_cache(cache)


def ref_mask(logits, words):
    """The token_masks reference: -inf where the token's bit of the packed words is clear."""
    bits = np.unpackbits(np.asarray(words, np.int32).view(np.uint8), bitorder="little")[:len(logits)]
    return np.where(bits == 1, logits, np.float32(-np.inf)).astype(np.float32)


def test_launch_masked_argmax(ties_rig):
    """token_masks backends: launch_masked_argmax sets exactly the tokens whose bit is clear to -inf (the
    others keep their bits, bit 31 included), the masked argmax is read back as usual (tied maxima,
    one allowed token, the top token forbidden), and mask words that do not cover the vocabulary
    or are not an int32 numpy array are a BackendError before anything changes."""
    r, be, ws = ties_rig, ties_rig.be, ties_rig.ws
    _needs(be, "token_masks")
    logits = _probe_logits(r)
    V = r.cfg.vocab_size
    n_words = -(-V // 32)
    rng = np.random.default_rng(5)
    top = int(np.argmax(logits[0]))
    masks = [rng.integers(-2 ** 31, 2 ** 31, n_words, dtype=np.int64).astype(np.int32),
             np.full(n_words + 3, -1, np.int32)]                 # everything allowed, extra words
    one = np.zeros(n_words, np.int32)
    one.view(np.uint32)[(V - 1) >> 5] = np.uint32(1 << ((V - 1) & 31))
    masks.append(one)                                            # only the last token
    no_top = np.full(n_words, -1, np.int32)
    no_top.view(np.uint32)[top >> 5] &= ~np.uint32(1 << (top & 31))
    masks.append(no_top)
    for words in masks:
        r.embed([0])
        be.matmul(ws.x, r.w.head, ws.logits, 1)
        be.launch_masked_argmax(ws, words)
        want = ref_mask(logits[0], words)
        assert be.read_argmax(ws) == int(np.argmax(want))
        assert_bits(np.array(be.logits_to_host(ws, 0), np.float32), want, "masked logits")
    for bad in (np.zeros(n_words - 1, np.int32), np.zeros(n_words, np.int64), [0] * n_words,
                np.zeros((1, n_words), np.int32)):
        r.embed([0])
        be.matmul(ws.x, r.w.head, ws.logits, 1)
        with pytest.raises(BackendError, match="mask"):
            be.launch_masked_argmax(ws, bad)
        assert_bits(np.array(be.logits_to_host(ws, 0), np.float32), logits[0], "logits after a refused mask")


# =============================================================================== caches
@pytest.mark.parametrize("window", [0, 4])
def test_alloc_cache_follows_the_spec(rig, window):
    """The cache's spec keeps the requested groups, window and n_loop, with at least the requested
    slots (cache.spec is authoritative; n_slots agrees); nbytes is the spec's; it starts zeroed."""
    c, be = rig.cfg, rig.be
    spec = mixed_spec(10, window)
    cache = be.alloc_cache(spec)
    try:
        assert cache.spec.groups == spec.groups and cache.spec.n_loop == spec.n_loop
        assert cache.spec.slots.window == window and cache.n_slots == cache.spec.n_slots >= 10
        assert cache.nbytes == cache.spec.nbytes(c.n_kv_heads, c.head_dim, get_plugin_manager().kv_codecs())
        rig.fill_qkv([1])
        for layer in range(4):
            assert_bits(rig.attend(cache, layer, 0, 1), np.zeros((1, c.q_dim), np.float32),
                        f"attention over a fresh cache (layer {layer})")
        for g in cache_storage(rig, cache):
            for st in g:
                assert all(not a.any() for a in st.values()), "a fresh cache is not zeroed"
    finally:
        be.release_cache(cache)


def test_released_cache_comes_back_zeroed(rig):
    c, be = rig.cfg, rig.be
    spec = mixed_spec(10)
    cache = be.alloc_cache(spec)
    _fill_all_layers(rig, cache, 3, 80)
    be.release_cache(cache)
    again = be.alloc_cache(spec)
    try:
        rig.fill_qkv([1])
        for layer in range(4):
            assert_bits(rig.attend(again, layer, 0, 1), np.zeros((1, c.q_dim), np.float32),
                        f"attention over a cache allocated after a release (layer {layer})")
    finally:
        be.release_cache(again)


def _fill_all_layers(rig, cache, n, seed, p0=0):
    """Every layer of a cache gets n rows at positions p0..: one fill_qkv, then rope_kv_append into
    each layer in turn (k is rotated again in place each time, so every layer gets other K rows);
    returns {layer: (k, v)} as read back after each append."""
    c = rig.cfg
    rig.fill_qkv(_ids(rig, n, seed))
    shape = (n, c.n_kv_heads, c.head_dim)
    out = {}
    for layer in range(cache.spec.n_layers):
        rig.be.rope_kv_append(rig.ws.q, rig.ws.k, rig.ws.v, cache, layer, rig.be.positions(p0), n)
        out[layer] = (rig.host(rig.ws.k, n).reshape(shape), rig.host(rig.ws.v, n).reshape(shape))
    return out


@pytest.mark.parametrize("window", [0, 3])
def test_copy_cache(rig, window):
    """copy_cache(dst, src, n): dst then reads src's K/V (every layer and group, codes, scales and
    zero points) in slots 0..n-1, bit for bit; a copy, not an alias. Checked through attention,
    and on the storage arrays where they can be read."""
    c, be = rig.cfg, rig.be
    n = 6
    spec = mixed_spec(window + n - 1 if window else 12, window)
    src, dst = be.alloc_cache(spec), be.alloc_cache(spec)
    try:
        # a ring past its end (positions 5..10); dst holds other rows first
        p0 = 5 if window else 0
        qids = _ids(rig, n, 99)

        def read(cache, fill=True):
            if fill:
                rig.fill_qkv(qids)             # the same (un-rotated) queries every time
            return [rig.attend(cache, layer, p0, n) for layer in range(4)]
        _fill_all_layers(rig, dst, n, 100, p0)
        _fill_all_layers(rig, src, n, 90, p0)
        want = read(src)
        stored = cache_storage(rig, src) if _has_storage(src) else None
        be.copy_cache(dst, src, p0 + n)
        for layer, got in enumerate(read(dst, fill=False)):
            assert_bits(got, want[layer], f"attention over the copy, layer {layer}")
        # overwrite src: dst keeps its copy
        _fill_all_layers(rig, src, n, 110, p0)
        for layer, got in enumerate(read(dst)):
            assert_bits(got, want[layer], f"the copy after src changed, layer {layer}")
        if stored is not None:
            slots = sorted({(p0 + t) % dst.n_slots if window else p0 + t for t in range(n)})
            for gi, (g_src, g_dst) in enumerate(zip(stored, cache_storage(rig, dst))):
                for st_s, st_d in zip(g_src, g_dst):
                    assert set(st_s) == set(st_d)
                    for name in st_s:
                        assert_bits(st_d[name][:, slots], st_s[name][:, slots],
                                    f"copy_cache {spec.groups[gi].codec} {name}")
    finally:
        be.release_cache(src)
        be.release_cache(dst)


def _has_storage(cache):
    groups = getattr(cache, "groups", None)
    return groups is not None and all((hasattr(g, "k") and hasattr(g, "v")) or (isinstance(g, tuple) and len(g) == 4)
                                      for g in groups)


def test_copy_cache_layers_between_layouts(rig):
    """copy_cache_layers(dst, src, n) (capability cache_reuse): every group dst shares with src (by
    name) gets src's first min(layers) layers in slots 0..n-1, bit for bit (codes, scales, zeros);
    dst's other slots and groups keep their contents; a copy, not an alias."""
    _needs(rig.be, "cache_reuse")
    be = rig.be
    src_spec = spec_of([("pre", 1, "fp32"), ("post", 1, "fp16"), ("loop", 3, "int4")], 8)
    dst_spec = spec_of([("pre", 1, "fp32"), ("post", 1, "fp16"), ("draft_post", 1, "int8"),
                        ("loop", 2, "int4")], 20)
    src, dst = be.alloc_kept_cache(src_spec), be.alloc_kept_cache(dst_spec)
    assert dst.spec.groups == dst_spec.groups and dst.n_slots >= 20
    n = 4
    _fill_all_layers(rig, src, 6, 90)
    _fill_all_layers(rig, dst, 6, 100)
    before_s, before_d = cache_storage(rig, src), cache_storage(rig, dst)
    be.copy_cache_layers(dst, src, n)
    _fill_all_layers(rig, src, 6, 110)        # src changes afterwards: dst keeps its copy
    after = cache_storage(rig, dst)
    pairs = {0: (0, 1), 1: (1, 1), 3: (2, 2)}   # dst group -> (src group, layers copied)
    for gi, g_dst in enumerate(after):
        for side, st_d in enumerate(g_dst):
            old = before_d[gi][side]
            for name, arr in st_d.items():
                what = f"group {dst_spec.groups[gi].name} {'KV'[side]} {name}"
                if gi in pairs:
                    si, nl = pairs[gi]
                    assert_bits(arr[:nl, :n], before_s[si][side][name][:nl, :n], f"copied {what}")
                    assert_bits(arr[:nl, n:], old[name][:nl, n:], f"slots past the copy of {what}")
                    assert_bits(arr[nl:], old[name][nl:], f"layers past the copy of {what}")
                else:
                    assert_bits(arr, old[name], f"unshared {what}")


def test_copy_cache_layers_refusals(rig):
    """A shared group of another codec, a ring, or more slots than a cache holds: BackendError."""
    _needs(rig.be, "cache_reuse")
    be = rig.be
    a = be.alloc_kept_cache(spec_of([("pre", 1, "fp32"), ("loop", 1, "fp16")], 8))
    b = be.alloc_kept_cache(spec_of([("pre", 1, "fp16"), ("loop", 1, "fp16")], 8))
    ring = be.alloc_kept_cache(spec_of([("pre", 1, "fp32"), ("loop", 1, "fp16")], 8, window=4))
    with pytest.raises(BackendError, match="codec"):
        be.copy_cache_layers(b, a, 2)
    with pytest.raises(BackendError, match="linear"):
        be.copy_cache_layers(ring, a, 2)
    with pytest.raises(BackendError, match="slots"):
        be.copy_cache_layers(a, a, a.n_slots + 1)


def test_alloc_rows_is_a_zeroed_row_buffer(rig):
    """alloc_rows(n, cols): zeroed float32 rows usable with copy / rows like an activation buffer."""
    _needs(rig.be, "cache_reuse")
    be, ws, c = rig.be, rig.ws, rig.cfg
    buf = be.alloc_rows(5, c.d_model)
    assert not rig.host(buf, 5).any()
    rig.embed([3, 4])
    be.copy(be.rows(buf, 2), ws.x, 2)
    got = rig.host(buf, 5)
    assert_bits(got[2:4], rig.host(ws.x, 2), "rows copied into the buffer")
    assert not got[:2].any() and not got[4:].any()


def test_move_cache_slots(rig):
    """move_cache_slots(cache, moves): for each (src, dst) in order, slot dst of every layer := slot
    src (codes, scales and zero points). Attention over the moved cache against the numpy model of
    the moves, and the storage arrays bit for bit where they can be read."""
    _needs(rig.be, "tree")
    c, be = rig.cfg, rig.be
    n = ROWS
    cache = be.alloc_cache(mixed_spec(16))
    try:
        rows = _fill_all_layers(rig, cache, n, 120)
        before = cache_storage(rig, cache) if _has_storage(cache) else None
        moves = [(6, 2), (2, 3), (7, 0), (5, 5)]     # in order: slot 3 gets the row that was at 6
        be.move_cache_slots(cache, moves)
        q, _, _ = rig.fill_qkv(_ids(rig, n, 130))    # an un-rotated q is as good a query as any
        for layer, lg in enumerate(cache.spec.groups):
            cc = codec_class(lg.codec)
            model = RingModel(cache.n_slots, 0, c.n_kv_heads, c.head_dim)
            model.store(0, codec_rows(cc, rows[layer][0]), codec_rows(cc, rows[layer][1]))
            for s, d in moves:
                model.k[d], model.v[d] = model.k[s].copy(), model.v[s].copy()
            assert_close(rig.attend(cache, layer, 0, n), model.attention(q, 0, c.n_heads, c.n_kv_heads, c.head_dim),
                         TOL["attention"], f"attention after move_cache_slots, layer {layer} ({lg.codec})")
        if before is not None:
            for gi, (g0, g1) in enumerate(zip(before, cache_storage(rig, cache))):
                for st0, st1 in zip(g0, g1):
                    for name in st0:
                        want = st0[name].copy()
                        for s, d in moves:
                            want[:, d] = want[:, s]
                        assert_bits(st1[name], want, f"move_cache_slots {cache.spec.groups[gi].codec} {name}")
    finally:
        be.release_cache(cache)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("codec", ["fp16", "int8", "int4"])
def test_copy_kv_layers_at(rig, codec, window):
    """copy_kv_layers_at(cache, position, src, dsts) (capability kv_layer_copy): the K/V rows of
    that position's slot in each dst layer := src's (codes, scales, zero points), bit for bit;
    every other slot and layer keeps its contents; a layer of another group is refused."""
    _needs(rig.be, "kv_layer_copy")
    be, n = rig.be, 6
    cache = be.alloc_cache(spec_of([("pre", 1, "fp32"), ("loop", 4, codec)], 8, window))
    try:
        _fill_all_layers(rig, cache, n, 140)
        if not _has_storage(cache):
            pytest.skip("the cache exposes no storage arrays")
        before = cache_storage(rig, cache)
        position = 4
        slot = cache.spec.slots.slot(position)
        be.copy_kv_layers_at(cache, be.positions(position), 2, range(3, 5))      # loop layers 1 -> 2, 3
        be.read_argmax_rows(rig.ws, 1)                                          # ops finished
        after = cache_storage(rig, cache)
        assert_bits(after[0][0]["data"], before[0][0]["data"], "the pre group is untouched")
        for st0, st1 in zip(before[1], after[1]):
            for name in st0:
                want = st0[name].copy()
                want[2, slot] = want[1, slot]
                want[3, slot] = want[1, slot]
                assert_bits(st1[name], want, f"copy_kv_layers_at {codec} {name}")
        with pytest.raises(BackendError, match="not in the group"):
            be.copy_kv_layers_at(cache, be.positions(position), 2, range(0, 1))
    finally:
        be.release_cache(cache)


# =============================================================================== composites
@pytest.mark.parametrize("codec", ["fp32", "int8"])
@pytest.mark.parametrize("which", ["fwd_rig", "family_rig"])
def test_composites_match_the_default_implementations(request, which, codec):
    """attn_half / mlp_half / final_logits (a backend may fuse them) compute what the default
    implementations over the primitives (tinyloop.runtime.backend.Backend) do, within float32
    tolerance: the residual, the logits and the K/V they leave in the cache; also for a model
    with q/k/v biases and a scaled embedding (family_rig)."""
    r = request.getfixturevalue(which)
    be, ws, cfg = r.be, r.ws, r.cfg
    blk = r.w.pre[0] if r.w.pre else r.w.loop[0]
    spec = spec_of([("pre", 1, codec), ("loop", 1, codec)], 16)
    caches = [be.alloc_cache(spec), be.alloc_cache(spec)]
    ids = _ids(r, 5, 170)
    try:
        outs = []
        for cache, impl in zip(caches, (type(be), Backend)):
            r.embed(ids)
            impl.attn_half(be, ws, blk, cache, 0, be.positions(0), 5)
            x_attn = r.host(ws.x, 5)
            impl.mlp_half(be, ws, blk, 5)
            x_mlp = r.host(ws.x, 5)
            impl.final_logits(be, ws, r.w, 2, 3)
            logits = np.array(be.logits_block_to_host(ws, 3), np.float32)
            r.fill_qkv(_ids(r, 5, 171))                    # the same queries over each cache
            outs.append((x_attn, x_mlp, logits, r.attend(cache, 0, 0, 5)))
        for what, got, ref in zip(("attn_half residual", "mlp_half residual", "final_logits(row0=2)",
                                   "attention over the K/V attn_half stored"), outs[0], outs[1]):
            assert_close(got, ref, TOL["attention"], f"{type(be).__name__} {what} vs the default composite ({codec})")
    finally:
        for cache in caches:
            be.release_cache(cache)


def test_advance_position(rig):
    """advance_position(handle, n) moves a device-resident position handle by n in place (a host
    int handle is immutable: the op is a no-op there and nothing is checked)."""
    be = rig.be
    h = be.positions(3)
    if isinstance(h, (int, np.integer)):
        pytest.skip(f"the {be.name} backend's positions are host ints (advance_position is a no-op)")
    cache = be.alloc_cache(spec_of([("pre", 1, "fp32"), ("loop", 1, "fp32")], 16))
    try:
        be.advance_position(h, 2)
        rig.append(cache, 1, h, [4, 5])
        q0, k0 = rig.pre
        q = rig.host(rig.ws.q, 2)
        c = rig.cfg
        assert_close(q, ref_rope(q0, [5, 6], c.n_heads, c.head_dim, c), 1e-5,
                     "rope at an advanced position")
    finally:
        be.release_cache(cache)


# =============================================================================== whole forward
def _forward(rig, cache, ids, p0, loops):
    """Forward of the rows ids at positions p0.. and their logits, as read back."""
    fwd = Forward(rig.cfg, rig.be, rig.w, rig.ws)
    T = len(ids)
    fwd.forward(rig.be.set_ids(rig.ws, ids), rig.be.positions(p0), T, cache, loops)
    fwd.logits(0, T)
    return np.array(rig.be.logits_block_to_host(rig.ws, T), np.float32)


@pytest.mark.parametrize("codec", CODECS)
def test_forward_matches_reference(fwd_rig, codec, conformance_quick):
    """tinyloop.runtime.forward.Forward on the backend (its composites, fused or not) against the
    float64 reference_logits with the codec's cache model, over a prefill and a decode step."""
    r = fwd_rig
    loops = 1 if conformance_quick else 2
    ids = _ids(r, 7, 140)
    cache = r.be.alloc_cache(build_spec(r.cfg, loops, mode_of(codec), SlotMap(16)))
    try:
        got = np.concatenate([_forward(r, cache, ids[:6], 0, loops), _forward(r, cache, ids[6:], 6, loops)])
        ref = reference_logits(r.cfg, r.W, ids, loops, kv_codec=codec_class(codec))
        for t in range(len(ids)):
            assert_close(got[t], ref[t], TOL[f"forward_{codec}"], f"forward logits ({codec} cache), row {t}")
    finally:
        r.be.release_cache(cache)


@pytest.fixture(scope="module")
def family_rig(backend_factory, conformance_dims, tmp_path_factory):
    """A q4 model with the family's optional features on: q/k/v biases, a scaled embedding, the
    model's own sliding window (4 positions) and Llama 3.1's RoPE frequency scaling (its original
    context 8 puts the fastest frequency in the blended band, the others scaled by 4)."""
    path = tmp_path_factory.mktemp("conformance") / "family.tinyloop"
    write_model_file(path, {**conformance_dims, "qkv_bias": True, "embed_scale": 1.75,
                            "sliding_window": 4, "rope_scaling": "llama3", "rope_factor": 4.0,
                            "rope_original_max_positions": 8}, "q4", 16, seed=15)
    r = Rig(backend_factory, path, max_seq_len=64)
    yield r
    r.close()


@pytest.mark.parametrize("ring", [False, True], ids=["linear", "ring"])
def test_family_extensions_forward_matches_reference(family_rig, ring, conformance_quick):
    """qkv_bias, embed_scale, sliding_window and llama3 RoPE through the forward against reference_logits:
    within the window on a linear slot map, and past it on a ring of the model's window (which
    applies the span exactly), prefill then one-row steps."""
    r = family_rig
    W = r.cfg.sliding_window
    loops = 1 if conformance_quick else 2
    n = 9 if ring else W
    ids = _ids(r, n, 180)
    cache = r.be.alloc_cache(build_spec(r.cfg, loops, mode_of("fp32"), SlotMap(16, window=W if ring else 0)))
    try:
        got = [_forward(r, cache, ids[:3], 0, loops)] + [_forward(r, cache, [ids[t]], t, loops)
                                                           for t in range(3, n)]
        got = np.concatenate(got)
        ref = reference_logits(r.cfg, r.W, ids, loops)
        for t in range(n):
            assert_close(got[t], ref[t], TOL["forward_fp32"], f"family forward logits, row {t}")
    finally:
        r.be.release_cache(cache)
    assert_bits(r.embed(ids[:2]), r.W["embed"][ids[:2]] * np.float32(r.cfg.embed_scale), "scaled embed")


#: The looped layouts' block and loop features (Huginn-0125's, Ouro's), each on a small model.
LOOPED_LAYOUTS = {
    "huginn": dict(block_norm="sandwich", loop_inject="adapter", loop_init="zeros", loop_norm="after",
                   embed_scale=2.0, qkv_bias=True),
    "huginn_random": dict(block_norm="sandwich", loop_inject="adapter", loop_init="random", loop_norm="after",
                          loop_init_scale=0.7, loop_init_seed=2 ** 64 - 5, embed_scale=2.0, qkv_bias=True),
    "ouro": dict(block_norm="sublayer", loop_norm="every", head_norm=False, n_pre=0, n_post=0),
}


@pytest.fixture(scope="module", params=sorted(LOOPED_LAYOUTS))
def layout_rig(request, backend_factory, conformance_dims, tmp_path_factory):
    path = tmp_path_factory.mktemp("conformance") / f"{request.param}.tinyloop"
    write_model_file(path, {**conformance_dims, **LOOPED_LAYOUTS[request.param]}, "q4", 16, seed=17)
    r = Rig(backend_factory, path, max_seq_len=64)
    yield r
    r.close()


def test_looped_layouts_forward_matches_reference(layout_rig, conformance_quick):
    """Sandwich / sublayer-output block norms, the loop-input adapter with a zero initial state,
    the after-loop and every-iteration loop norms and a head without a norm, through the forward
    against reference_logits at two depths: prefill, then one-row steps."""
    r = layout_rig
    n, depths = (4, (2,)) if conformance_quick else (7, (1, 3))
    ids = _ids(r, n, 190)
    for loops in depths:
        cache = r.be.alloc_cache(build_spec(r.cfg, loops, mode_of("fp32"), SlotMap(16)))
        try:
            got = np.concatenate([_forward(r, cache, ids[:3], 0, loops)]
                                 + [_forward(r, cache, [ids[t]], t, loops) for t in range(3, n)])
        finally:
            r.be.release_cache(cache)
        ref = reference_logits(r.cfg, r.W, ids, loops)
        for t in range(n):
            assert_close(got[t], ref[t], TOL["forward_fp32"], f"{r.cfg.block_norm} forward logits, L={loops}, row {t}")


def test_looped_layouts_batch_invariant(layout_rig, conformance_quick):
    """The looped layouts' blocks, prefill in one launch == one token at a time, bit for bit
    (logits): a backend may run a one-row sublayer output differently from a many-row one (the
    CUDA backend's matmul row tails), never with other bits."""
    r = layout_rig
    loops, n = (2, 3) if conformance_quick else (3, 5)
    ids = _ids(r, n, 195)
    caches = [r.be.alloc_cache(build_spec(r.cfg, loops, mode_of("fp32"), SlotMap(16))) for _ in range(2)]
    try:
        whole = _forward(r, caches[0], ids, 0, loops)
        steps = np.concatenate([_forward(r, caches[1], [ids[t]], t, loops) for t in range(n)])
        assert_bits(steps, whole, f"{r.cfg.block_norm} forward: one token at a time vs one launch")
    finally:
        for cache in caches:
            r.be.release_cache(cache)


def test_init_state_matches_host_draw(layout_rig):
    """The random initial state (loop_init "random") bit for bit against the host definition
    (tinyloop.model.init_state), at a causal launch's positions and at a draft tree's
    (pos + depth[t]), whole and from a later row."""
    r, c = layout_rig, layout_rig.cfg
    if c.loop_init != "random":
        pytest.skip(f"the {c.loop_init!r} layout has no random initial state")

    def ref(positions):
        return random_state(c.loop_init_seed, c.loop_init_scale, positions, c.d_model)

    r.be.init_state(r.ws.x, r.be.positions(11), 5)
    assert_bits(r.host(r.ws.x, 5), ref(np.arange(11, 16)), "init_state, causal rows at 11..15")
    r.be.init_state(r.ws.x, r.be.positions(0), 1)
    assert_bits(r.host(r.ws.x, 1), ref([0]), "init_state, position 0")
    if r.be.supports("tree"):
        depth = np.array([0, 1, 1, 2, 2, 2])
        path = np.array([[0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 1, 3], [0, 1, 4], [0, 2, 5]])
        r.be.init_state(r.ws.x, _tree_rows(r, depth, path, 9), 6)
        assert_bits(r.host(r.ws.x, 6), ref(9 + depth), "init_state, tree rows")
        r.be.init_state(r.ws.x, _tree_rows(r, depth, path, 9, row0=3), 3)
        assert_bits(r.host(r.ws.x, 3), ref(9 + depth[3:]), "init_state, tree rows from row 3")


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_forward_batch_invariant(fwd_rig, codec, conformance_quick):
    """Prefill in one launch == in chunks == token by token, bit for bit (logits)."""
    r = fwd_rig
    loops, n = (1, 4) if conformance_quick else (2, ROWS)
    ids = _ids(r, n, 150)
    spec = build_spec(r.cfg, loops, mode_of(codec), SlotMap(16))
    caches = [r.be.alloc_cache(spec) for _ in range(3)]
    try:
        whole = _forward(r, caches[0], ids, 0, loops)
        chunks = np.concatenate([_forward(r, caches[1], ids[:3], 0, loops), _forward(r, caches[1], ids[3:], 3, loops)])
        steps = np.concatenate([_forward(r, caches[2], [ids[t]], t, loops) for t in range(n)])
        assert_bits(chunks, whole, f"forward ({codec}): two chunks vs one launch")
        assert_bits(steps, whole, f"forward ({codec}): one token at a time vs one launch")
    finally:
        for cache in caches:
            r.be.release_cache(cache)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_lanes_equal_one_sequence_launches(fwd_rig, codec, conformance_quick):
    """Capability ``lanes``: a lanes cache holds several sequences in its lane regions; a launch
    whose rows belong to different lanes at different positions (prefill rows of two lanes packed
    together, then one-row-per-lane steps, then a step over a subset of the lanes in another
    order) gives each row the logits of the same row of a one-sequence decode, bit for bit."""
    r = fwd_rig
    if not r.be.supports("lanes"):
        pytest.skip("the backend has no lanes capability")
    loops = 1 if conformance_quick else 2
    seqs = [_ids(r, 5, 160), _ids(r, 2, 161), _ids(r, 4, 162)]
    refs = []
    for seq in seqs:
        cache = r.be.alloc_cache(build_spec(r.cfg, loops, mode_of(codec), SlotMap(16)))
        try:
            refs.append(np.concatenate([_forward(r, cache, [t], p, loops) for p, t in enumerate(seq)]))
        finally:
            r.be.release_cache(cache)
    fwd = Forward(r.cfg, r.be, r.w, r.ws)
    lanes = r.be.alloc_cache(build_spec(r.cfg, loops, mode_of(codec), SlotMap(3 * 8, lanes=3)))
    assert lanes.spec.slots.lanes == 3 and lanes.spec.slots.lane_slots >= 8

    def launch(rows):
        """rows: (lane, position) pairs; returns the logits of each row."""
        ids = r.be.set_ids(r.ws, [seqs[l][p] for l, p in rows])
        pos = r.be.lane_positions(lanes, [l for l, _ in rows], [p for _, p in rows])
        fwd.forward(ids, pos, len(rows), lanes, loops)
        fwd.logits(0, len(rows))
        return np.array(r.be.logits_block_to_host(r.ws, len(rows)), np.float32)

    try:
        # prefill: lane 0 positions 0..2 and lane 2 positions 0..1 in one launch, lane 1 alone
        got = launch([(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)])
        for t, (l, p) in enumerate([(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]):
            assert_bits(got[t], refs[l][p], f"lanes prefill row {t} (lane {l}, position {p})")
        assert_bits(launch([(1, 0)])[0], refs[1][0], "lanes launch of one row")
        got = launch([(0, 3), (1, 1), (2, 2)])
        for t, (l, p) in enumerate([(0, 3), (1, 1), (2, 2)]):
            assert_bits(got[t], refs[l][p], f"lanes step row {t} (lane {l}, position {p})")
        got = launch([(2, 3), (0, 4)])                        # a compacted step, lanes reordered
        assert_bits(got[0], refs[2][3], "compacted lanes step, lane 2")
        assert_bits(got[1], refs[0][4], "compacted lanes step, lane 0")
        with pytest.raises(BackendError, match="lane"):
            r.be.lane_positions(lanes, [3], [0])
        with pytest.raises(BackendError, match="position"):
            r.be.lane_positions(lanes, [0], [lanes.spec.slots.lane_slots])
        with pytest.raises(BackendError):
            r.be.lane_positions(lanes, [0] * (r.ws.rows + 1), [0] * (r.ws.rows + 1))
    finally:
        r.be.release_cache(lanes)
    plain = r.be.alloc_cache(build_spec(r.cfg, loops, mode_of(codec), SlotMap(16)))
    try:
        with pytest.raises(BackendError, match="lanes"):
            r.be.lane_positions(plain, [0], [0])
    finally:
        r.be.release_cache(plain)


def test_replay_runs_the_step(fwd_rig):
    """replay(key, fn) runs fn's ops (captured or not): the same logits as running them directly,
    on every call, with the position advanced in place where positions live on the device."""
    r = fwd_rig
    be, ws = r.be, r.ws
    loops = 1
    ids = _ids(r, 4, 160)
    spec = build_spec(r.cfg, loops, mode_of("fp32"), SlotMap(16))
    a, b = be.alloc_cache(spec), be.alloc_cache(spec)
    try:
        want = [_forward(r, a, [t], p, loops)[0] for p, t in enumerate(ids)]
        fwd = Forward(r.cfg, be, r.w, ws)
        pos = be.positions(0)
        for p, t in enumerate(ids):
            tok = be.set_ids(ws, [t])
            pos = be.positions(p)

            def step():
                fwd.forward(tok, pos, 1, b, loops)
                fwd.logits(0, 1)
            be.replay(("conformance", id(b)), step)
            assert_bits(np.array(be.logits_to_host(ws, 0), np.float32), want[p], f"replayed step {p}")
    finally:
        be.release_cache(a)
        be.release_cache(b)


# =============================================================================== no allocation
def test_no_allocation_in_decode_steps(fwd_rig, device_bytes_in_use, conformance_quick):
    """Ops allocate nothing: over one-token decode steps (forward, logits, argmax) memory_bytes()
    and the workspace's buffers are unchanged, host (numpy / Python) allocations stay far below one
    cache layer, and device memory in use is unchanged where the runner can measure it."""
    r = fwd_rig
    be, ws = r.be, r.ws
    loops = 1 if conformance_quick else 2
    cache = be.alloc_cache(build_spec(r.cfg, loops, mode_of("fp32"), SlotMap(2048)))
    fwd = Forward(r.cfg, be, r.w, ws)

    def step(p, tok):
        fwd.forward(be.set_ids(ws, [tok]), be.positions(p), 1, cache, loops)
        fwd.logits(0, 1)
        be.launch_argmax(ws)
        return be.read_argmax(ws)

    try:
        tok = step(0, 1)
        tok = step(1, tok)                 # warm: kernels compiled, lazy tables made
        held = be.memory_bytes()
        bufs = {k: id(v) for k, v in ws.buffers().items()}
        dev0 = device_bytes_in_use() if device_bytes_in_use else None
        layer_bytes = cache.nbytes // (2 * cache.spec.n_layers)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for p in range(2, 6):
                tok = step(p, tok)
            first, _ = tracemalloc.get_traced_memory()
            for p in range(6, 10):
                tok = step(p, tok)
            current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert be.memory_bytes() == held, "memory_bytes() changed during decode steps"
        assert {k: id(v) for k, v in ws.buffers().items()} == bufs, "a workspace buffer was replaced"
        # what a decode step may allocate on the host: small temporaries (Python objects, a few
        # rows), well below one cache layer (K or V)
        limit = min(HOST_ALLOC_LIMIT, layer_bytes // 2)
        assert peak - base < limit, (f"decode steps allocated {peak - base} bytes on the host at peak "
                                     f"(limit {limit}; one cache layer: {layer_bytes})")
        # what the runtime keeps must not grow with the steps: once-per-process caches (a launch
        # configuration the driver layer memoises on first use) may appear in the first four steps,
        # nothing more in the next four
        assert current - first < limit // 4, (f"decode steps 6..9 kept {current - first} more bytes "
                                              f"allocated on the host than steps 2..5")
        if dev0 is not None:
            dev1 = device_bytes_in_use()
            assert dev1 <= dev0, f"device memory in use grew by {dev1 - dev0} bytes during decode steps"
    finally:
        be.release_cache(cache)
