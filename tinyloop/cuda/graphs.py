"""CUDA graph capture of numba launches, through the driver API on a numba stream.

Launch every kernel once before capturing (numba compiles and loads modules on first launch, which
is not allowed while a stream captures). Scalars passed to kernels are frozen into the graph: keep
per-step values (positions, lengths) in device memory.
"""

from __future__ import annotations

from ..core.errors import BackendError


def _drv():
    from cuda.bindings import driver
    return driver


def stream_handle(stream):
    """The driver CUstream of a numba stream."""
    drv = _drv()
    h = stream.handle
    if isinstance(h, drv.CUstream):
        return h
    return drv.CUstream(int(getattr(h, "value", h) or 0))


def _check(err, what: str) -> None:
    if err != _drv().CUresult.CUDA_SUCCESS:
        raise BackendError(f"{what} failed: {err}")


class Graph:
    """An instantiated graph captured from `fn()` on `stream`; `nodes` counts its operations."""

    def __init__(self, stream, fn):
        drv = _drv()
        self.stream = stream
        st = stream_handle(stream)
        (err,) = drv.cuStreamBeginCapture(st, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        _check(err, "cuStreamBeginCapture")
        try:
            fn()
        finally:
            err, graph = drv.cuStreamEndCapture(st)
        _check(err, "cuStreamEndCapture")
        err, self.exec = drv.cuGraphInstantiate(graph, 0)
        _check(err, "cuGraphInstantiate")
        res = drv.cuGraphGetNodes(graph)
        self.nodes = int(res[-1]) if res[0] == drv.CUresult.CUDA_SUCCESS else -1
        self._graph = graph

    def launch(self) -> None:
        (err,) = _drv().cuGraphLaunch(self.exec, stream_handle(self.stream))
        _check(err, "cuGraphLaunch")
