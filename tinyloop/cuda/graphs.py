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

from ..errors import BackendError


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


def _edge_api(drv):
    """(get, remove, add) graph-edge calls that carry edge data: the plain names in CUDA 13's
    bindings, the ``_v2`` names in CUDA 12.3+'s; None where the bindings have neither."""
    names = ("cuGraphGetEdges", "cuGraphRemoveDependencies", "cuGraphAddDependencies")
    if all(hasattr(drv, n + "_v2") for n in names):
        return tuple(getattr(drv, n + "_v2") for n in names)
    if hasattr(drv, "CUgraphEdgeData") and all(hasattr(drv, n) for n in names):
        return tuple(getattr(drv, n) for n in names)
    return None


def _make_programmatic(graph) -> int:
    """Turn every kernel -> kernel edge of `graph` into a programmatic dependency (port
    PROGRAMMATIC: the dependent may launch once every block of the upstream kernel has executed
    griddepcontrol.launch_dependents, which ours never do, or exited). Returns the number of
    edges changed. An optimisation only: where the bindings or the driver lack edge data, the
    graph keeps its default edges (returns 0); a graph whose edges were removed but could not be
    re-added as programmatic gets its default edges back."""
    drv = _drv()
    api = _edge_api(drv)
    if api is None:
        return 0
    get_edges, remove, add = api
    ok = drv.CUresult.CUDA_SUCCESS
    try:
        res = get_edges(graph)
        if len(res) != 5 or res[0] != ok or not res[4]:
            return 0
        err, frm, to, data, n = get_edges(graph, res[4])
        if err != ok:
            return 0
        kernel = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
        types = {}

        def is_kernel(node) -> bool:
            key = int(node)
            if key not in types:
                e, t = drv.cuGraphNodeGetType(node)
                types[key] = e == ok and t == kernel
            return types[key]

        def default(d) -> bool:
            return d is None or (int(d.from_port) == 0 and int(d.to_port) == 0 and int(d.type) == 0)

        pairs = [(f, t) for f, t, d in zip(frm[:n], to[:n], data[:n])
                 if default(d) and is_kernel(f) and is_kernel(t)]
        if not pairs:
            return 0
        a, b = [f for f, _ in pairs], [t for _, t in pairs]
        edge = drv.CUgraphEdgeData()
        edge.from_port = drv.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
        edge.type = drv.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    except (AttributeError, TypeError, ValueError):    # bindings without edge data
        return 0
    (err,) = remove(graph, a, b, None, len(pairs))
    if err != ok:
        return 0
    try:
        (err,) = add(graph, a, b, [edge] * len(pairs), len(pairs))
    except (TypeError, ValueError):
        err = None
    if err == ok:
        return len(pairs)
    (err,) = add(graph, a, b, None, len(pairs))
    _check(err, "cuGraphAddDependencies (restoring default edges)")
    return 0


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


# --------------------------------------------------------------------------- guarded graphs
def _capture_into(stream, fn, graph, deps=(), relaxed: bool = True) -> None:
    """Capture `fn()` on `stream` into the existing `graph` (a conditional node's body, or the
    top-level graph after the nodes `deps`). Relaxed mode: a kernel's first launch may load its
    module while capturing."""
    drv = _drv()
    st = stream_handle(stream)
    mode = (drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED if relaxed
            else drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    deps = list(deps)
    (err,) = drv.cuStreamBeginCaptureToGraph(st, graph, deps or None, None, len(deps), mode)
    _check(err, "cuStreamBeginCaptureToGraph")
    try:
        fn()
    finally:
        err, _ = drv.cuStreamEndCapture(st)
    _check(err, "cuStreamEndCapture")


def _nodes(graph) -> list:
    drv = _drv()
    res = drv.cuGraphGetNodes(graph)
    _check(res[0], "cuGraphGetNodes")
    if not res[-1]:
        return []
    err, nodes, n = drv.cuGraphGetNodes(graph, res[-1])
    _check(err, "cuGraphGetNodes")
    return list(nodes[:n])


def _leaves(among) -> list:
    """The nodes of `among` that no node depends on."""
    drv = _drv()
    out = []
    for node in among:
        res = drv.cuGraphNodeGetDependentNodes(node)
        _check(res[0], "cuGraphNodeGetDependentNodes")
        if not res[-1]:
            out.append(node)
    return out


def conditional_nodes_supported() -> bool:
    """The driver and bindings build IF conditional nodes (CUDA 12.4 and later)."""
    try:
        drv = _drv()
        err, version = drv.cuDriverGetVersion()
        return (err == drv.CUresult.CUDA_SUCCESS and version >= 12040
                and hasattr(drv, "cuGraphConditionalHandleCreate") and hasattr(drv, "cuStreamBeginCaptureToGraph"))
    except Exception:       # bindings without the API
        return False


class GuardedGraph:
    """One instantiated graph of a guarded step (GuardedSteps.replay_guarded): `head`, then each of
    `stretches` in its own IF node, then each fill in an IF node, then `tail`, in sequence. A
    conditional handle belongs to one node, so every stretch has its own (default 1 at each launch:
    ``conts``, a device array in stretch order) and every fill too (default 0: ``fill_handles``
    by depth); probe kernels set them on the device. ``prepare(self)`` is called before anything
    is captured, and ``piece`` says which piece is being captured (0: the head, i + 1: stretch i),
    so a probe knows which stretches an exit skips (``conts[piece:]``).

    Pieces are captured straight into their nodes (cuStreamBeginCaptureToGraph): the head and the
    tail into the top-level graph itself (``flat``; else each into a child graph node), the rest
    into the conditional bodies. With ``programmatic`` the kernel -> kernel edges inside each
    become programmatic (the edges into and out of a conditional node stay default)."""

    #: Measurement only (bench/guarded_overhead.py): every stretch as plain nodes, no IF node, so
    #: an exit skips nothing; what the conditional nodes cost is the difference.
    unconditional = False

    def __init__(self, stream, head, stretches, fills, tail, prepare, programmatic: bool = False,
                 flat: bool = True):
        import numpy as np
        from numba import cuda
        drv = _drv()
        self.stream = stream
        err, graph = drv.cuGraphCreate(0)
        _check(err, "cuGraphCreate")
        self._graph = graph
        err, ctx = drv.cuCtxGetCurrent()
        _check(err, "cuCtxGetCurrent")
        assign = drv.CU_GRAPH_COND_ASSIGN_DEFAULT

        def handle(default):
            err, h = drv.cuGraphConditionalHandleCreate(graph, ctx, default, assign)
            _check(err, "cuGraphConditionalHandleCreate")
            return h
        uncond = self.unconditional and flat
        # (a handle without its node fails instantiation; unconditional stretches have none, and
        # their zero entries must never be set: measurement of never-exiting steps only)
        cont_handles = [0 if uncond else handle(1) for _ in stretches]
        fill_handles = {d: handle(0) for d in fills}
        self.conts = cuda.to_device(np.array([int(h) for h in cont_handles] or [0], np.uint64)[:len(stretches)])
        self.fill_handles = {d: int(h) for d, h in fill_handles.items()}
        self.piece = 0
        self.programmatic_edges = 0
        prepare(self)
        prev = []

        def add(body_fn, cond=None):
            nonlocal prev
            if cond is None and flat:
                before = {int(n) for n in _nodes(graph)}
                _capture_into(stream, body_fn, graph, deps=prev)
                new = [n for n in _nodes(graph) if int(n) not in before]
                if new:             # nothing captured: the next piece keeps these dependencies
                    prev = _leaves(new)
                return
            if cond is None:
                err, child = drv.cuGraphCreate(0)
                _check(err, "cuGraphCreate")
                _capture_into(stream, body_fn, child)
                self.programmatic_edges += _make_programmatic(child) if programmatic else 0
                err, node = drv.cuGraphAddChildGraphNode(graph, prev, len(prev), child)
                _check(err, "cuGraphAddChildGraphNode")
            else:
                params = drv.CUgraphNodeParams()
                params.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
                params.conditional.handle = cond
                params.conditional.type = drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
                params.conditional.size = 1
                params.conditional.ctx = ctx
                err, node = drv.cuGraphAddNode(graph, prev, None, len(prev), params)
                _check(err, "cuGraphAddNode (conditional)")
                body = params.conditional.phGraph_out[0]
                _capture_into(stream, body_fn, body)
                self.programmatic_edges += _make_programmatic(body) if programmatic else 0
            prev = [node]
        add(head)
        for i, (fn, h) in enumerate(zip(stretches, cont_handles)):
            self.piece = i + 1
            add(fn, None if uncond else h)
        self.piece = len(stretches)
        for d, fn in fills.items():
            add(fn, fill_handles[d])
        add(tail)
        if flat and programmatic:       # the head's and the tail's kernel -> kernel edges
            self.programmatic_edges += _make_programmatic(graph)
        err, self.exec = drv.cuGraphInstantiate(graph, 0)
        _check(err, "cuGraphInstantiate")
        res = drv.cuGraphGetNodes(graph)
        self.nodes = int(res[-1]) if res[0] == drv.CUresult.CUDA_SUCCESS else -1

    def launch(self) -> None:
        (err,) = _drv().cuGraphLaunch(self.exec, stream_handle(self.stream))
        _check(err, "cuGraphLaunch")
