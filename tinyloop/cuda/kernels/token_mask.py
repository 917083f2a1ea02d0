"""Token mask: ``logits[i] = -inf`` for every token i whose bit is clear in a packed bitmask
(constrained decoding: a grammar's allowed set applied where the logits live, so only the mask
goes to the device and only the chosen id comes back).

Shapes (V = vocab_size)::

    logits  float32 (V,)                      updated in place
    words   int32 (W,), W >= ceil(V / 32)     bit (i % 32) of words[i // 32] set: token i allowed

Allowed entries keep their value bit for bit; forbidden ones become -inf. The bit order is the
one llguidance writes (and numpy's ``packbits(..., bitorder="little")`` over 4-byte words on a
little-endian host). Thread mapping: a flat grid-stride loop, one token per thread per step; every
output depends on its own logit and its own bit only: batch-invariant.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...errors import BackendError
from ._cache import jit_kernel
from ._common import NEG_INF, cdiv, check_array
from ._pdl import grid_dep_wait

NT = 256
MAX_BLOCKS = 256


@jit_kernel
def _mask_kernel(logits, words):
    grid_dep_wait()
    V = logits.shape[0]
    for i in range(cuda.grid(1), V, cuda.gridsize(1)):
        if (words[i >> 5] >> (i & 31)) & 1 == 0:
            logits[i] = NEG_INF


def mask_logits(logits, words, stream=0):
    """``logits[i] = -inf`` where bit i of `words` is clear (float32 (V,) in place; int32 words)."""
    op = "mask_logits"
    check_array(op, "logits", logits, np.float32, 1)
    check_array(op, "words", words, np.int32, 1)
    V = logits.shape[0]
    if words.shape[0] < cdiv(V, 32):
        raise BackendError(f"{op}: {words.shape[0]} mask words cover {32 * words.shape[0]} tokens, "
                           f"fewer than the vocabulary's {V}")
    if V == 0:
        return
    _mask_kernel[min(cdiv(V, NT), MAX_BLOCKS), NT, stream](logits, words)


def ptx_signatures():
    return [("token_mask", _mask_kernel.py_func, "void(float32[::1], int32[::1])")]
