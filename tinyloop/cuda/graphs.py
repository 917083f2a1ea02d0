"""CUDA graph capture of numba launches, through the driver API on a numba stream.

Launch every kernel once before capturing (numba compiles and loads modules on first launch, which
is not allowed while a stream captures). Scalars passed to kernels are frozen into the graph: keep
per-step values (positions, lengths) in device memory.

With ``programmatic=True`` every kernel-to-kernel edge of the captured graph becomes a programmatic
dependency (kernels/_pdl.py): the dependent kernel may be launched before its predecessor's
completion has been fully processed and waits for it in ``griddepcontrol.wait``, which every
kernel of this package executes before its first memory access. Edges from or to other nodes
(copies, memsets) keep full serialization.
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


def _make_programmatic(graph) -> int:
    """Turn every kernel -> kernel edge of `graph` into a programmatic dependency (port
    PROGRAMMATIC: the dependent may launch once every block of the upstream kernel has executed
    griddepcontrol.launch_dependents, which ours never do, or exited). Returns the number of
    edges changed."""
    drv = _drv()
    err, _, _, _, n = drv.cuGraphGetEdges(graph)
    _check(err, "cuGraphGetEdges")
    if not n:
        return 0
    err, frm, to, data, n = drv.cuGraphGetEdges(graph, n)
    _check(err, "cuGraphGetEdges")
    kernel = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
    types = {}

    def is_kernel(node) -> bool:
        key = int(node)
        if key not in types:
            e, t = drv.cuGraphNodeGetType(node)
            _check(e, "cuGraphNodeGetType")
            types[key] = t == kernel
        return types[key]

    pairs = [(f, t) for f, t in zip(frm[:n], to[:n]) if is_kernel(f) and is_kernel(t)]
    if not pairs:
        return 0
    a, b = [f for f, _ in pairs], [t for _, t in pairs]
    (err,) = drv.cuGraphRemoveDependencies(graph, a, b, None, len(pairs))
    _check(err, "cuGraphRemoveDependencies")
    edge = drv.CUgraphEdgeData()
    edge.from_port = drv.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    edge.type = drv.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    (err,) = drv.cuGraphAddDependencies(graph, a, b, [edge] * len(pairs), len(pairs))
    _check(err, "cuGraphAddDependencies")
    return len(pairs)


class Graph:
    """An instantiated graph captured from `fn()` on `stream`; `nodes` counts its operations."""

    def __init__(self, stream, fn, programmatic: bool = False):
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
        self.programmatic_edges = _make_programmatic(graph) if programmatic else 0
        err, self.exec = drv.cuGraphInstantiate(graph, 0)
        _check(err, "cuGraphInstantiate")
        res = drv.cuGraphGetNodes(graph)
        self.nodes = int(res[-1]) if res[0] == drv.CUresult.CUDA_SUCCESS else -1
        self._graph = graph

    def launch(self) -> None:
        (err,) = _drv().cuGraphLaunch(self.exec, stream_handle(self.stream))
        _check(err, "cuGraphLaunch")
