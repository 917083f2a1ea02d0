"""Memory estimate for running one model: weights + KV cache + scratch buffers. Pure arithmetic on a
model header (or a config plus quantization); nothing is allocated and no weights are read.

Components (bytes):

* **weights** -- backend "cuda" (and any backend that keeps weights packed): the physical tensors as
  stored in the file (quantized ``.q``/``.scales``/``.zeros`` parts, f16, f32). Backend "cpu": every
  logical tensor dequantized to float32, the matrices padded to whole blocks of 32 rows (its
  row-block layout): ``4 * parameter_count`` plus the padding. A backend that lays its weights out
  its own way says so through ``Backend.weights_nbytes``; otherwise the entry's ``weights_dtype``
  picks one of the two formulas ("dequantized": ``4 * parameter_count``).
* **kv_cache** -- ``batch * n_layers(loops) * slots * 2 (K and V) * kv_dim * kv_bytes_per_element``,
  slots = the cache slots the backend allocates for a request of max_seq_len (``Backend.cache_slots``:
  max_seq_len on the CPU, rounded up to a power of two >= 128 on CUDA),
  rounded up; ``kv_bytes_per_element`` comes from the cache mode (4 for fp32, 2 for fp16, fractional
  for packed modes that include their scales).
* **scratch** -- the workspace the backend allocates at load: exactly its buffers
  (``Backend.workspace_layout`` for ``min(max_seq_len, prefill_chunk or 512)`` rows: activations,
  logits, attention scores or split-reduction partials, id buffers); one pool per model, whatever
  the batch. A backend that does not describe its workspace gets the generic formula (rows x
  ``d_model + q_dim + 2 * kv_dim + 2 * d_ff`` floats plus a logits row). Allocator slack and the
  runtime itself (CUDA context, numba) are not counted.

weights + scratch is what ``vram_usage_bytes`` reports for a loaded model; a request adds its KV
cache (kv_cache for a request of max_seq_len tokens; tests/test_memory_accounting.py).
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

from ..model.arch import ModelConfig, TensorQuant, is_matrix, required_tensors
from ..errors import ConfigError

DTYPE_BYTES = {"f32": 4, "f16": 2, "u8": 1, "float32": 4, "float16": 2, "uint8": 1}
ACTIVATION_BYTES = 4


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def parameter_count(cfg: ModelConfig) -> int:
    """Logical parameters (elements of every required tensor)."""
    return sum(_prod(s) for s in required_tensors(cfg).values())


def physical_weight_bytes(cfg: ModelConfig, quant: Optional[Mapping[str, TensorQuant]] = None,
                          default_quant: Optional[TensorQuant] = None) -> int:
    """Bytes of the physical tensors a file with this config and quantization would store.
    Matrices without an entry in `quant` use `default_quant` (f32 if None); norms use f32 unless
    `quant` names them."""
    quant = quant or {}
    total = 0
    for name, shape in required_tensors(cfg).items():
        tq = quant.get(name)
        if tq is None:
            tq = default_quant if (default_quant is not None and is_matrix(name)) else TensorQuant("f32")
        for dtype, pshape in tq.physical(name, shape).values():
            total += _prod(pshape) * DTYPE_BYTES[dtype]
    return total


def estimate_memory(source, max_seq_len: int, loops: Optional[int] = None,
                    kv_bytes_per_element: float = 4.0, *,
                    quant: Optional[Mapping[str, TensorQuant]] = None,
                    default_quant: Optional[TensorQuant] = None,
                    backend: str = "cuda", batch: int = 1, prefill_chunk: int = 0) -> dict:
    """Estimate the memory of running a model (see the module docstring for the formulas).

    `source` is a ModelHeader (anything with ``.config`` and ``.tensors`` entries that have
    ``.nbytes``) or a :class:`ModelConfig` (then `quant` / `default_quant` describe the storage).
    `loops` defaults to ``config.default_loops``. Returns a dict of ints (bytes) and the inputs:
    ``weights_bytes, kv_cache_bytes, scratch_bytes, total_bytes, stored_weights_bytes,
    parameters, n_layers, loops, max_seq_len, batch, kv_bytes_per_element, backend, weights_dtype,
    prefill_chunk``. `prefill_chunk` is load_model's (0: min(max_seq_len, 512)): it sets the rows of
    the workspace.
    """
    if isinstance(source, ModelConfig):
        cfg = source
        stored = physical_weight_bytes(cfg, quant, default_quant)
    else:
        cfg = getattr(source, "config", None)
        tensors = getattr(source, "tensors", None)
        if not isinstance(cfg, ModelConfig) or tensors is None:
            raise ConfigError(f"estimate_memory needs a ModelConfig or a model header, got "
                              f"{type(source).__name__}")
        stored = sum(int(t.nbytes) for t in tensors)
    from ..runtime.engine import DEFAULT_PREFILL_CHUNK
    from ..runtime.plugins import get_plugin_manager
    entries = get_plugin_manager().backends()
    if not isinstance(backend, str) or backend not in entries:
        raise ConfigError(f"backend {backend!r} is not one of {', '.join(entries)}")
    entry = entries[backend]
    dequantized = entry.weights_dtype == "dequantized"
    if loops is None:
        loops = cfg.default_loops
    for name, v, hi in (("max_seq_len", max_seq_len, 1 << 30), ("loops", loops, cfg.max_loops),
                        ("batch", batch, 1 << 20)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise ConfigError(f"{name}={v!r} must be an integer in [1, {hi}]")
    kvb = float(kv_bytes_per_element)
    if not (0 < kvb < 1e6) or math.isnan(kvb):
        raise ConfigError(f"kv_bytes_per_element={kv_bytes_per_element!r} must be positive")

    params = parameter_count(cfg)
    held = entry.weights_model(cfg)
    weights = held if held is not None else params * 4 if dequantized else stored
    n_layers = cfg.n_layers(loops)
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or not 0 <= prefill_chunk <= 1 << 20:
        raise ConfigError(f"prefill_chunk={prefill_chunk!r} must be an integer in [0, 1048576] (0 = automatic)")
    rows = min(max_seq_len, prefill_chunk or DEFAULT_PREFILL_CHUNK)
    scratch, slots = entry.memory_model(cfg, rows, max_seq_len)
    kv = int(math.ceil(batch * n_layers * slots * 2 * cfg.kv_dim * kvb))
    if scratch is None:         # a backend that does not describe its workspace: the generic formula
        row = cfg.d_model + cfg.q_dim + 2 * cfg.kv_dim + 2 * cfg.d_ff
        if cfg.keeps_loop_input:
            row += cfg.d_model
        scratch = ACTIVATION_BYTES * (rows * row + cfg.vocab_size)
    return {
        "backend": backend,
        "weights_dtype": "float32 (dequantized)" if dequantized else "as stored (packed)",
        "weights_bytes": int(weights),
        "kv_cache_bytes": kv,
        "scratch_bytes": int(scratch),
        "total_bytes": int(weights) + kv + int(scratch),
        "stored_weights_bytes": int(stored),
        "parameters": params,
        "n_layers": n_layers,
        "loops": loops,
        "max_seq_len": max_seq_len,
        "batch": batch,
        "kv_bytes_per_element": kvb,
        "prefill_chunk": rows,
    }


def format_bytes(n: float) -> str:
    """Human-readable size with binary units ("1.50 GiB")."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover
