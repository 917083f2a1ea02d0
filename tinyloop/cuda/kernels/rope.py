"""Rotary position embedding (RoPE), "half split" convention, in place; optionally fused with the
KV-cache append.

For head width hd, half = hd / 2 and i < half, the pair (x[i], x[i + half]) of every head of
query row t is rotated at position ``p = pos[0] + t`` by the angle ``a = float32(p) * inv_freq[i]``
(a float32 product)::

    x[i]        <- x[i] * cos(a) - x[i + half] * sin(a)
    x[i + half] <- x[i + half] * cos(a) + x[i] * sin(a)

The kernels do not evaluate cos and sin: they read them from a float32 table ``cs`` made once on
the host by `rope_table`, ``cs[p, i, 0] = cos(a)`` and ``cs[p, i, 1] = sin(a)`` for positions
p = 0 .. P-1, where cos and sin are evaluated in float64 (numpy) on the float32 angle and rounded
to float32, so they are accurate to rounding whatever p is. ``inv_freq[i] = theta ** (-2 i / hd)``
is computed in float64 and rounded to float32 (`inv_freq` helper). Earlier versions evaluated the
same formula per thread on the device (libdevice float64 cos/sin, about 3.5 us per decode-step
launch on an H200); the lookup has no float64 arithmetic. numpy's and libdevice's float64 cos/sin
may differ in the last float64 bit, which changes the float32 result only for a value within that
distance of a float32 rounding boundary; tests/cuda/test_kernels_gpu.py compares the table with
the device formula bit for bit.

The table must cover every position a launch reaches; the kernels do not check it. Launchers check
what the host can know (pos is a device array): the kernels writing a linear cache need
``P >= max_seq + POSITION_MARGIN`` (the cache's slots plus a draft tree of depth <= 64 rooted at
its end), plain `rope` needs ``P >= T`` and leaves ``pos[0] + T <= P`` to the caller. A ring
(``window`` W > 0: position p in slot p % S, tinyloop.runtime.cache.SlotMap) keeps absolute positions,
which pass S as the request goes on, so no check against S can hold: the caller's table must cover
the request's positions (the CUDA backend's covers every position its sessions reach).

Quantized KV codecs (int8, int4: a per-row scale needs the whole row, tinyloop/cuda/kv_codecs.py)
are not stored here: `rope` (in place, tree-aware) or the staging epilogue `qkv_stage_epilogue`
leave the rotated k and the v rows as float32 rows, and kernels/kv_store.py quantizes them.

Shapes (T rows, H query heads, Hkv kv heads, hd head width, L cache layers, S max_seq)::

    q         float32 (T, H * hd)          rotated in place
    k         float32 (T, Hkv * hd)        rotated in place
    v         float32 (T, Hkv * hd)        (rope_kv_append only) read
    qkv       float32 (T, (H + 2 Hkv) hd)  (rope_kv_append_qkv only) the fused q|k|v projection:
                                           q in columns [0, H hd), k in [H hd, (H + Hkv) hd),
                                           v after; read (k is rotated in place there as well)
    q_out     float32 (T, H * hd)          (rope_kv_append_qkv only) receives the rotated q
    pos       int32 (1,)                   position of row 0, read on the device
    cs        float32 (P, hd / 2, 2)       cos/sin table (`rope_table`): cs[p, i] = (cos, sin); one
                                           thread reads its 8-byte pair, a warp a contiguous run
    k_cache, v_cache  float16 or float32 (L, S, Hkv, hd)   (rope_kv_append only) slot p of
                      `layer` receives the rotated k row and the v row; rows with p >= S are not
                      written (the host keeps pos[0] + T <= S); with a ring, slot p % S
    depth, path       int32 (T,), (T, D+1)   optional draft-tree tables (linear caches only):
                      row t is then at position pos[0] + depth[t] and its K/V go to slot
                      pos[0] + path[t, depth[t]] (tinyloop.runtime.backend.TreeRows); empty tables
                      (0,) and (0, 1) mean the causal layout above
    k_stage, v_stage  float32 (T, Hkv * hd)   (qkv_stage_epilogue only) receive the rotated k
                      and the v rows (kv_store's input)

`rope_kv_append` and `rope_kv_append_qkv` are one kernel: it reads q, k and v at column offsets of
source arrays and writes the rotated q to a destination that may be the source (in place), so the
separate-buffer form passes (q, q, k, v, offsets 0) and the fused form (qkv, q_out, qkv, qkv,
offsets 0, H hd, (H + Hkv) hd).

Thread mapping: one thread per (row t, head, pair i), flat grid-stride. Every element depends only
on its own inputs and p, so the result is independent of T and of the grid: batch-invariant.
The table is read-only and shared by every launch, so a captured graph only holds its address.
The position is read from the device array `pos`, so a captured graph replays unchanged while
the host advances pos[0] between steps.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import Epilogue, cdiv, check_array, check_tree
from ._pdl import grid_dep_wait

NT = 256
MAX_BLOCKS = 4096
#: Positions past the cache's last slot the table must cover for the cache-writing kernels: a
#: draft tree rotates row t at pos[0] + depth[t], depth <= 64 (draft_ahead <= 64).
POSITION_MARGIN = 65


def inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """float32 (head_dim / 2,) array ``theta ** (-2 i / head_dim)``, computed in float64."""
    if head_dim <= 0 or head_dim % 2:
        raise BackendError(f"rope: head_dim={head_dim} must be a positive even number")
    i = np.arange(head_dim // 2, dtype=np.float64)
    return (float(theta) ** (-2.0 * i / head_dim)).astype(np.float32)


def rope_table(head_dim: int, theta: float, n_positions: int, freqs=None) -> np.ndarray:
    """float32 (n_positions, head_dim / 2, 2) table: ``[p, i] = (cos(a), sin(a))`` with the float32
    angle ``a = float32(p) * inv_freq[i]`` (float32 product), cos and sin evaluated in float64 on
    that angle and rounded to float32. `freqs` (head_dim / 2,): the model's frequencies
    (model.arch.rope_inv_freq, rounded to float32 here) instead of inv_freq(head_dim, theta).
    Upload it once (cuda.to_device) and pass it to every launch."""
    n = n_positions
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= 2 ** 31:
        raise BackendError(f"rope_table: n_positions={n!r} must be an integer in [1, 2**31]")
    f = inv_freq(head_dim, theta)
    if freqs is not None:
        freqs = np.asarray(freqs, np.float64)
        if freqs.shape != f.shape or not np.all(np.isfinite(freqs)) or not np.all(freqs > 0):
            raise BackendError(f"rope_table: freqs must be {f.shape[0]} finite positive frequencies")
        f = freqs.astype(np.float32)
    p = np.arange(int(n), dtype=np.int64).astype(np.float32)      # float32(p), rounded to nearest
    a = (p[:, None] * f[None, :]).astype(np.float64)                 # the float32 product, widened
    cs = np.empty((int(n), f.shape[0], 2), np.float32)
    cs[:, :, 0] = np.cos(a)
    cs[:, :, 1] = np.sin(a)
    return cs


@cuda.jit(device=True)
def rotate_pair(x0, x1, c, s):
    """The pair (x0, x1) rotated by the angle whose (cos, sin) is (c, s)."""
    return x0 * c - x1 * s, x1 * c + x0 * s


@cuda.jit(device=True)
def row_place(t, p0, depth, path):
    """(position, cache slot) of query row t on a linear cache: p0 + t for both in the causal
    layout; with tree tables (depth non-empty) position p0 + depth[t] and slot
    p0 + path[t, depth[t]]."""
    if depth.shape[0] > 0:
        return p0 + depth[t], p0 + path[t, depth[t]]
    return p0 + t, p0 + t


@cuda.jit(device=True)
def ring_slot(slot, W, S):
    """The slot of a row whose linear slot is `slot`: itself, or slot % S in a ring (W > 0)."""
    if W > 0:
        return slot % S
    return slot


@cuda.jit(device=True)
def _rotate(src, dst, t, scol, dcol, half, p, cs, i):
    """Rotate the pair (src[t, scol], src[t, scol + half]) into dst[t, dcol], dst[t, dcol + half]
    by the table's angle for (position p, pair i) (dst may be src: each element is read before it
    is written, by the same thread)."""
    r0, r1 = rotate_pair(src[t, scol], src[t, scol + half], cs[p, i, 0], cs[p, i, 1])
    dst[t, dcol] = r0
    dst[t, dcol + half] = r1
    return r0, r1


@jit_kernel
def _rope_kernel(q, k, pos, cs, depth, path):
    grid_dep_wait()
    half = cs.shape[1]
    hd = 2 * half
    T = q.shape[0]
    H = q.shape[1] // hd
    Hk = k.shape[1] // hd
    per_row = (H + Hk) * half
    n = T * per_row
    p0 = pos[0]
    for idx in range(cuda.grid(1), n, cuda.gridsize(1)):
        t = idx // per_row
        r = idx - t * per_row
        head = r // half
        i = r - head * half
        p, _ = row_place(t, p0, depth, path)
        if head < H:
            col = head * hd + i
            _rotate(q, q, t, col, col, half, p, cs, i)
        else:
            col = (head - H) * hd + i
            _rotate(k, k, t, col, col, half, p, cs, i)


@jit_kernel
def _rope_kv_append_kernel(q, q_out, k, v, qoff, koff, voff, k_cache, v_cache, layer, pos, cs,
                           depth, path, W):
    grid_dep_wait()
    # q, k, v: source arrays, read at column offsets qoff, koff, voff; rotated q goes to q_out
    # (columns from 0), rotated k back into k and into the cache, v into the cache.
    half = cs.shape[1]
    hd = 2 * half
    T = q_out.shape[0]
    H = q_out.shape[1] // hd
    Hk = k_cache.shape[2]
    S = k_cache.shape[1]
    per_row = (H + Hk) * half
    n = T * per_row
    p0 = pos[0]
    for idx in range(cuda.grid(1), n, cuda.gridsize(1)):
        t = idx // per_row
        r = idx - t * per_row
        head = r // half
        i = r - head * half
        p, slot = row_place(t, p0, depth, path)
        slot = ring_slot(slot, W, S)
        if head < H:
            col = head * hd + i
            _rotate(q, q_out, t, qoff + col, col, half, p, cs, i)
        else:
            kh = head - H
            col = kh * hd + i
            r0, r1 = _rotate(k, k, t, koff + col, koff + col, half, p, cs, i)
            if 0 <= slot < S:
                k_cache[layer, slot, kh, i] = r0
                k_cache[layer, slot, kh, i + half] = r1
                v_cache[layer, slot, kh, i] = v[t, voff + col]
                v_cache[layer, slot, kh, i + half] = v[t, voff + col + half]


def _check_common(op, q, k, pos, cs):
    check_array(op, "cs", cs, np.float32, 3, (None, None, 2))
    half = cs.shape[1]
    if half == 0 or cs.shape[0] == 0:
        raise BackendError(f"{op}: the cos/sin table cs has shape {tuple(cs.shape)}; it needs at least "
                           f"one position and one pair (rope_table)")
    hd = 2 * half
    check_array(op, "q", q, np.float32, 2)
    T = q.shape[0]
    check_array(op, "k", k, np.float32, 2, (T, None))
    if q.shape[1] % hd or k.shape[1] % hd or q.shape[1] == 0 or k.shape[1] == 0:
        raise BackendError(f"{op}: q width {q.shape[1]} and k width {k.shape[1]} must be "
                           f"positive multiples of head_dim={hd} (= 2 * cs.shape[1])")
    check_array(op, "pos", pos, np.int32, 1, (1,))
    n = T * (q.shape[1] + k.shape[1]) // 2
    if n >= 2 ** 31:
        raise BackendError(f"{op}: too many elements for one launch")
    return T, hd, n


def _check_positions(op, cs, need, what):
    if cs.shape[0] < need:
        raise BackendError(f"{op}: the cos/sin table cs covers {cs.shape[0]} positions, but {what} needs "
                           f"at least {need}; make it with rope_table(head_dim, theta, n_positions >= {need})")


def rope(q, k, pos, cs, stream=0, depth=None, path=None):
    """Rotate q and k in place at positions pos[0] + t, or at the tree layout's positions
    pos[0] + depth[t] (see module doc). The caller keeps every position below cs.shape[0]; the
    launcher can only check cs.shape[0] >= T."""
    op = "rope"
    T, hd, n = _check_common(op, q, k, pos, cs)
    _check_positions(op, cs, T, f"a launch of {T} rows (positions pos[0] .. pos[0] + {T - 1})")
    depth, path = check_tree(op, depth, path, T)
    if T == 0:
        return
    _rope_kernel[min(cdiv(n, NT), MAX_BLOCKS), NT, stream](q, k, pos, cs, depth, path)


def check_slots(op, T, S, window, cs, depth):
    """Host checks of a launch writing T rows into a cache of S slots (linear, or a ring when
    window > 0); returns the window as an int."""
    window = int(window)
    if not 0 <= window <= S:
        raise BackendError(f"{op}: window={window} is outside [0, {S}] (a ring of {S} slots)")
    tree = depth is not None and depth.shape[0] > 0
    if window == 0 and not tree:
        _check_positions(op, cs, S + POSITION_MARGIN, f"a cache of {S} slots (its slots plus "
                         f"POSITION_MARGIN={POSITION_MARGIN} for a draft tree's depth)")
    elif tree and window:
        raise BackendError(f"{op}: a draft tree's rows cannot be stored in a ring (window={window}); "
                           f"trees need a linear cache")
    if T > S:
        raise BackendError(f"{op}: {T} rows do not fit a cache of {S} slots")
    return window


def _check_cache(op, T, Hk, hd, k_cache, v_cache, layer, cs, window, depth):
    check_array(op, "k_cache", k_cache, (np.float16, np.float32), 4, (None, None, Hk, hd))
    check_array(op, "v_cache", v_cache, k_cache.dtype, 4, tuple(k_cache.shape))
    window = check_slots(op, T, int(k_cache.shape[1]), window, cs, depth)
    layer = int(layer)
    if not 0 <= layer < k_cache.shape[0]:
        raise BackendError(f"{op}: layer={layer} is outside [0, {k_cache.shape[0]})")
    return layer, window


def rope_kv_append(q, k, v, k_cache, v_cache, layer, pos, cs, stream=0, depth=None, path=None,
                   window=0):
    """`rope` on q and k, then store the rotated k rows and the v rows in cache layer `layer` at
    slots pos[0] + t (cast to the cache dtype); with tree tables, at the tree layout's positions
    and slots; with `window` > 0 at slots (pos[0] + t) % S of a ring (module doc)."""
    op = "rope_kv_append"
    T, hd, n = _check_common(op, q, k, pos, cs)
    check_array(op, "v", v, np.float32, 2, tuple(k.shape))
    depth, path = check_tree(op, depth, path, T)
    layer, window = _check_cache(op, T, k.shape[1] // hd, hd, k_cache, v_cache, layer, cs, window, depth)
    if T == 0:
        return
    _rope_kv_append_kernel[min(cdiv(n, NT), MAX_BLOCKS), NT, stream](
        q, q, k, v, 0, 0, 0, k_cache, v_cache, layer, pos, cs, depth, path, window)


def _check_qkv(op, q_out, k_cache, v_cache, layer, pos, cs, depth, path, window):
    """Checks shared by the fused-projection forms: (T, q_dim, kv_dim, layer, depth, path,
    window)."""
    # q_out stands in for both q and k in the shared checks (cs, pos, widths vs head_dim).
    T, hd, _ = _check_common(op, q_out, q_out, pos, cs)
    check_array(op, "k_cache", k_cache, (np.float16, np.float32), 4, (None, None, None, hd))
    kv_dim = int(k_cache.shape[2]) * hd
    if kv_dim == 0:
        raise BackendError(f"{op}: the cache has no kv heads")
    depth, path = check_tree(op, depth, path, T)
    layer, window = _check_cache(op, T, kv_dim // hd, hd, k_cache, v_cache, layer, cs, window, depth)
    return T, q_out.shape[1], kv_dim, layer, depth, path, window


def rope_kv_append_qkv(qkv, q_out, k_cache, v_cache, layer, pos, cs, stream=0, depth=None, path=None,
                       window=0):
    """`rope_kv_append` reading q, k and v from the fused projection `qkv` (T, q_dim + 2 kv_dim):
    the rotated q rows go to `q_out` (T, q_dim), the rotated k rows (also left in qkv's k
    columns) and the v rows to cache layer `layer` at slots pos[0] + t (or the tree layout's, or
    a ring's). kv_dim is the cache's n_kv_heads * head_dim."""
    op = "rope_kv_append_qkv"
    T, q_dim, kv_dim, layer, depth, path, window = _check_qkv(op, q_out, k_cache, v_cache, layer, pos,
                                                              cs, depth, path, window)
    check_array(op, "qkv", qkv, np.float32, 2, (T, q_dim + 2 * kv_dim))
    n = T * (q_dim + kv_dim) // 2
    if n >= 2 ** 31:
        raise BackendError(f"{op}: too many elements for one launch")
    if T == 0:
        return
    _rope_kv_append_kernel[min(cdiv(n, NT), MAX_BLOCKS), NT, stream](
        qkv, q_out, qkv, qkv, 0, q_dim, q_dim + kv_dim, k_cache, v_cache, layer, pos, cs, depth, path,
        window)


# ----------------------------------------------------------------------------- matmul epilogues
@cuda.jit(device=True)
def _pair_rows(p, half, hd, q_dim, kv_dim):
    """Weight rows of pair p of the fused q|k|v projection: a RoPE pair (i, i + half) of a q or k
    head for p < (q_dim + kv_dim) / 2, then the v columns two by two."""
    n_rope = (q_dim + kv_dim) // 2
    if p < n_rope:
        head = p // half
        na = head * hd + (p - head * half)
        return na, na + half
    na = q_dim + kv_dim + 2 * (p - n_rope)
    return na, na + 1


@cuda.jit(device=True)
def _qkv_dims(ep, N):
    """(half, hd, Hk, q_dim, kv_dim, rope pairs) of the fused q|k|v projection of N rows."""
    k_cache = ep[0]
    half = ep[4].shape[1]
    hd = 2 * half
    Hk = k_cache.shape[2]
    kv_dim = Hk * hd
    q_dim = N - 2 * kv_dim
    return half, hd, Hk, q_dim, kv_dim, (q_dim + kv_dim) // 2


@cuda.jit(device=True)
def _qkv_rows(ep, p, N):
    half, hd, Hk, q_dim, kv_dim, n_rope = _qkv_dims(ep, N)
    return _pair_rows(p, half, hd, q_dim, kv_dim)


@cuda.jit(device=True)
def _qkv_store(ep, q_out, t, p, va, vb, N):
    """Rotate a q pair into q_out, a k pair into the cache; store a v pair in the cache (the
    element placement and arithmetic of `_rope_kv_append_kernel`)."""
    k_cache, v_cache, layer, pos, cs, depth, path, W = ep[0], ep[1], ep[2], ep[3], ep[4], ep[5], ep[6], ep[7]
    half, hd, Hk, q_dim, kv_dim, n_rope = _qkv_dims(ep, N)
    H = q_dim // hd
    S = k_cache.shape[1]
    pp, slot = row_place(t, pos[0], depth, path)
    slot = ring_slot(slot, W, S)
    if p < n_rope:
        head = p // half
        i = p - head * half
        r0, r1 = rotate_pair(va, vb, cs[pp, i, 0], cs[pp, i, 1])
        if head < H:
            col = head * hd + i
            q_out[t, col] = r0
            q_out[t, col + half] = r1
        elif 0 <= slot < S:
            kh = head - H
            k_cache[layer, slot, kh, i] = r0
            k_cache[layer, slot, kh, i + half] = r1
    elif 0 <= slot < S:
        e = 2 * (p - n_rope)
        kh = e // hd
        d = e - kh * hd
        v_cache[layer, slot, kh, d] = va
        v_cache[layer, slot, kh, d + 1] = vb


@cuda.jit(device=True)
def _qkv_bias_store(ep, q_out, t, p, va, vb, N):
    """`_qkv_store` of the pair plus its q|k|v biases (ep[8]), added before the rotation."""
    half, hd, Hk, q_dim, kv_dim, n_rope = _qkv_dims(ep, N)
    na, nb = _pair_rows(p, half, hd, q_dim, kv_dim)
    bias = ep[8]
    _qkv_store(ep, q_out, t, p, va + bias[na], vb + bias[nb], N)


def _check_bias(op, bias, n):
    if bias is not None:
        check_array(op, "bias", bias, np.float32, 1, (n,))
    return bias


def qkv_epilogue(q_out, k_cache, v_cache, layer, pos, cs, depth=None, path=None, window=0,
                 bias=None) -> Epilogue:
    """RoPE + KV append as the epilogue of the fused q|k|v matmul (``matmul(q_out, x, wqkv, ...,
    epilogue=qkv_epilogue(...))``, weight rows q | k | v, N = q_dim + 2 kv_dim): the rotated q
    rows go to `q_out` (T, q_dim), the rotated k and the v rows to cache layer `layer` at the
    rows' slots (causal, or the tree layout of `depth` / `path`, or a ring when `window` > 0),
    exactly as the matmul into a (T, N) buffer followed by `rope_kv_append_qkv` (which also
    leaves the rotated k in the buffer; here there is no buffer). The matmul pairs rows
    (i, i + half) of every q and k head so one warp holds both members of a rotation pair.
    `bias` (float32 (N,), the q | k | v biases) is added to each projected value before RoPE,
    as the matmul, `bias.add_bias` and the unfused RoPE would."""
    T, q_dim, kv_dim, layer, depth, path, window = _check_qkv("qkv_epilogue", q_out, k_cache, v_cache,
                                                              layer, pos, cs, depth, path, window)
    args = (k_cache, v_cache, np.int64(layer), pos, cs, depth, path, np.int64(window))
    ct = np.dtype(k_cache.dtype).name
    if _check_bias("qkv_epilogue", bias, q_dim + 2 * kv_dim) is not None:
        return _QKV_BIAS_EPILOGUES[ct]._replace(args=args + (bias,), n_rows=q_dim + 2 * kv_dim,
                                                out_cols=q_dim, t_rows=T)
    return _QKV_EPILOGUES[ct]._replace(args=args, n_rows=q_dim + 2 * kv_dim, out_cols=q_dim, t_rows=T)


@cuda.jit(device=True)
def _stage_dims(ep, N):
    """(half, hd, q_dim, kv_dim, rope pairs) of the staged q|k|v projection of N rows."""
    half = ep[3].shape[1]
    hd = 2 * half
    kv_dim = ep[0].shape[1]
    q_dim = N - 2 * kv_dim
    return half, hd, q_dim, kv_dim, (q_dim + kv_dim) // 2


@cuda.jit(device=True)
def _stage_rows(ep, p, N):
    half, hd, q_dim, kv_dim, n_rope = _stage_dims(ep, N)
    return _pair_rows(p, half, hd, q_dim, kv_dim)


@cuda.jit(device=True)
def _stage_store(ep, q_out, t, p, va, vb, N):
    """Rotate a q pair into q_out and a k pair into k_stage; store a v pair in v_stage (the
    rotation of `_qkv_store`, float32 rows for kv_store)."""
    k_stage, v_stage, pos, cs, depth, path = ep[0], ep[1], ep[2], ep[3], ep[4], ep[5]
    half, hd, q_dim, kv_dim, n_rope = _stage_dims(ep, N)
    H = q_dim // hd
    pp, _ = row_place(t, pos[0], depth, path)
    if p < n_rope:
        head = p // half
        i = p - head * half
        r0, r1 = rotate_pair(va, vb, cs[pp, i, 0], cs[pp, i, 1])
        if head < H:
            col = head * hd + i
            q_out[t, col] = r0
            q_out[t, col + half] = r1
        else:
            col = (head - H) * hd + i
            k_stage[t, col] = r0
            k_stage[t, col + half] = r1
    else:
        e = 2 * (p - n_rope)
        v_stage[t, e] = va
        v_stage[t, e + 1] = vb


@cuda.jit(device=True)
def _stage_bias_store(ep, q_out, t, p, va, vb, N):
    """`_stage_store` of the pair plus its q|k|v biases (ep[6]), added before the rotation."""
    half, hd, q_dim, kv_dim, n_rope = _stage_dims(ep, N)
    na, nb = _pair_rows(p, half, hd, q_dim, kv_dim)
    bias = ep[6]
    _stage_store(ep, q_out, t, p, va + bias[na], vb + bias[nb], N)


def qkv_stage_epilogue(q_out, k_stage, v_stage, pos, cs, depth=None, path=None, bias=None) -> Epilogue:
    """RoPE as the epilogue of the fused q|k|v matmul for a quantized KV codec: the rotated q rows
    go to `q_out` (T, q_dim), the rotated k rows to `k_stage` and the v rows to `v_stage`
    (T, kv_dim) float32, at the rows' positions (causal or the tree layout) — the values
    `rope` leaves in separate q / k buffers; kv_store then quantizes the staged rows into the
    cache (a row's scale needs all its head_dim values, which no single warp of the matmul
    holds). `bias` as in `qkv_epilogue`."""
    op = "qkv_stage_epilogue"
    T, hd, _ = _check_common(op, q_out, q_out, pos, cs)
    check_array(op, "k_stage", k_stage, np.float32, 2, (T, None))
    kv_dim = int(k_stage.shape[1])
    if kv_dim == 0 or kv_dim % hd:
        raise BackendError(f"{op}: k_stage width {kv_dim} is not a positive multiple of head_dim={hd}")
    check_array(op, "v_stage", v_stage, np.float32, 2, (T, kv_dim))
    depth, path = check_tree(op, depth, path, T)
    n = q_out.shape[1] + 2 * kv_dim
    args = (k_stage, v_stage, pos, cs, depth, path)
    if _check_bias(op, bias, n) is not None:
        return _STAGE_BIAS_EPILOGUE._replace(args=args + (bias,), n_rows=n, out_cols=q_out.shape[1], t_rows=T)
    return _STAGE_EPILOGUE._replace(args=args, n_rows=n, out_cols=q_out.shape[1], t_rows=T)


def _qkv_proto(ct, bias=False):
    c = f"{ct}[:, :, :, ::1]"
    b = ", float32[::1]" if bias else ""
    return Epilogue(f"qkv_{ct}" + ("_bias" if bias else ""), _qkv_rows,
                    _qkv_bias_store if bias else _qkv_store, (), 0, 0,
                    f"Tuple(({c}, {c}, int64, int32[::1], float32[:, :, ::1], int32[::1], int32[:, ::1], "
                    f"int64{b}))")


_STAGE_SIG = "float32[:, ::1], float32[:, ::1], int32[::1], float32[:, :, ::1], int32[::1], int32[:, ::1]"
#: The qkv epilogue per cache dtype without arrays or sizes; `qkv_epilogue` fills them in (the
#: _bias variants carry the q|k|v biases as a last argument).
_QKV_EPILOGUES = {ct: _qkv_proto(ct) for ct in ("float16", "float32")}
_QKV_BIAS_EPILOGUES = {ct: _qkv_proto(ct, bias=True) for ct in ("float16", "float32")}
#: The staging epilogue without arrays or sizes; `qkv_stage_epilogue` fills them in.
_STAGE_EPILOGUE = Epilogue("qkv_stage", _stage_rows, _stage_store, (), 0, 0, f"Tuple(({_STAGE_SIG}))")
_STAGE_BIAS_EPILOGUE = Epilogue("qkv_stage_bias", _stage_rows, _stage_bias_store, (), 0, 0,
                                f"Tuple(({_STAGE_SIG}, float32[::1]))")


def ptx_epilogues():
    """The qkv epilogues (each cache dtype's and the staging one, with and without biases)
    without arrays (their `sig` only), for PTX tests of the matmul variants that carry them."""
    return (list(_QKV_EPILOGUES.values()) + list(_QKV_BIAS_EPILOGUES.values())
            + [_STAGE_EPILOGUE, _STAGE_BIAS_EPILOGUE])


def ptx_signatures():
    m = "float32[:, ::1]"
    t = "float32[:, :, ::1]"
    sigs = [("rope", _rope_kernel.py_func, f"void({m}, {m}, int32[::1], {t}, int32[::1], int32[:, ::1])")]
    for ct in ("float16", "float32"):
        c = f"{ct}[:, :, :, ::1]"
        sigs.append((f"rope_kv_append_{ct}", _rope_kv_append_kernel.py_func,
                     f"void({m}, {m}, {m}, {m}, int64, int64, int64, {c}, {c}, int64, int32[::1], "
                     f"{t}, int32[::1], int32[:, ::1], int64)"))
    return sigs
