"""The built-in backends, registered through the ``tinyloop_backends`` hook like a third-party one.

Each entry names its Backend class as "module:Class" (imported only when a model is loaded on it)
and says whether this machine can run it. ``backend="auto"`` picks the available entry of highest
``auto_priority``.
"""

from __future__ import annotations

import os

from ..runtime.backend import BackendEntry
from ..runtime.hookspecs import hookimpl


class CPUEntry(BackendEntry):
    name = "cpu"
    impl = "tinyloop.cpu.backend:CPUBackend"
    auto_priority = 0
    weights_dtype = "dequantized"
    description = "weights dequantized to float32"


class CUDAEntry(BackendEntry):
    name = "cuda"
    impl = "tinyloop.cuda.backend:CUDABackend"
    auto_priority = 10
    weights_dtype = "packed"
    description = "weights packed as stored in the file"

    @classmethod
    def available(cls, simulator_ok: bool = False):
        """A CUDA device is usable. numba's CUDA simulator counts only when asked for explicitly
        (backend="cuda" under NUMBA_ENABLE_CUDASIM=1, for tests); "auto" never picks it."""
        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            return (True, "") if simulator_ok else (False, "only numba's CUDA simulator is enabled")
        try:
            from numba import cuda
            if cuda.is_available():
                return True, ""
        except Exception as exc:            # a broken driver install is "not available", not a crash
            return False, f"numba-cuda cannot reach a GPU ({type(exc).__name__}: {exc})"
        return False, "no CUDA GPU is available"


@hookimpl
def tinyloop_backends():
    return [CPUEntry, CUDAEntry]
