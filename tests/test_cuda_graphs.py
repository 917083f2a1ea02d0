"""graphs._make_programmatic against a stand-in for the driver bindings (no GPU): which edges become
programmatic, and that a graph never loses its edges when the bindings or the driver refuse."""

from __future__ import annotations

import types

import pytest

from tinyloop.errors import BackendError
from tinyloop.cuda import graphs

OK, FAIL = 0, 1
KERNEL, MEMCPY = "kernel", "memcpy"


class EdgeData:
    def __init__(self, from_port=0, to_port=0, type=0):
        self.from_port, self.to_port, self.type = from_port, to_port, type

    def key(self):
        return (self.from_port, self.to_port, self.type)


class FakeDriver:
    """Just enough of cuda.bindings.driver: nodes are ints, edges (from, to, EdgeData)."""

    CUresult = types.SimpleNamespace(CUDA_SUCCESS=OK)
    CUgraphNodeType = types.SimpleNamespace(CU_GRAPH_NODE_TYPE_KERNEL=KERNEL)
    CUgraphDependencyType = types.SimpleNamespace(CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC=1)
    CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1

    def __init__(self, node_types, edges, refuse_programmatic=False, edge_data=True):
        if edge_data:          # bindings before CUDA 12.3 have no CUgraphEdgeData
            self.CUgraphEdgeData = EdgeData
        self.node_types = node_types
        self.edges = [(f, t, EdgeData(*d)) for f, t, d in edges]
        self.refuse_programmatic = refuse_programmatic

    def cuGraphGetEdges(self, graph, n=0):
        if n == 0:
            return OK, [], [], [], len(self.edges)
        e = self.edges[:n]
        return OK, [f for f, _, _ in e], [t for _, t, _ in e], [d for _, _, d in e], len(e)

    def cuGraphNodeGetType(self, node):
        return OK, self.node_types[node]

    def cuGraphRemoveDependencies(self, graph, a, b, data, n):
        for f, t in zip(a, b):
            match = [e for e in self.edges if e[0] == f and e[1] == t and e[2].key() == (0, 0, 0)]
            if not match:
                return (FAIL,)
            self.edges.remove(match[0])
        return (OK,)

    def cuGraphAddDependencies(self, graph, a, b, data, n):
        if data is not None and self.refuse_programmatic:
            return (FAIL,)
        for i, (f, t) in enumerate(zip(a, b)):
            self.edges.append((f, t, data[i] if data is not None else EdgeData()))
        return (OK,)

    def state(self):
        return sorted((f, t, d.key()) for f, t, d in self.edges)


#: kernels 0, 1, a copy 2, kernels 3, 4: 0 -> 1 -> 2 -> 3 -> 4
CHAIN = ({0: KERNEL, 1: KERNEL, 2: MEMCPY, 3: KERNEL, 4: KERNEL},
         [(0, 1, (0, 0, 0)), (1, 2, (0, 0, 0)), (2, 3, (0, 0, 0)), (3, 4, (0, 0, 0))])


def _use(monkeypatch, drv):
    monkeypatch.setattr(graphs, "_drv", lambda: drv)
    return drv


def test_kernel_to_kernel_edges_become_programmatic(monkeypatch):
    drv = _use(monkeypatch, FakeDriver(*CHAIN))
    assert graphs._make_programmatic("g") == 2
    assert drv.state() == [(0, 1, (1, 0, 1)), (1, 2, (0, 0, 0)), (2, 3, (0, 0, 0)), (3, 4, (1, 0, 1))]


def test_edges_with_data_are_left_alone(monkeypatch):
    nodes, edges = CHAIN
    drv = _use(monkeypatch, FakeDriver(nodes, [(0, 1, (2, 0, 0))] + edges[1:]))
    assert graphs._make_programmatic("g") == 1
    assert drv.state()[0] == (0, 1, (2, 0, 0)) and drv.state()[-1] == (3, 4, (1, 0, 1))


def test_refused_programmatic_edges_restore_default_ones(monkeypatch):
    drv = _use(monkeypatch, FakeDriver(*CHAIN, refuse_programmatic=True))
    before = drv.state()
    assert graphs._make_programmatic("g") == 0
    assert drv.state() == before


def test_bindings_without_edge_data_leave_the_graph(monkeypatch):
    drv = _use(monkeypatch, FakeDriver(*CHAIN, edge_data=False))
    before = drv.state()
    assert graphs._make_programmatic("g") == 0
    assert drv.state() == before


def test_a_graph_that_cannot_get_its_edges_back_is_an_error(monkeypatch):
    drv = FakeDriver(*CHAIN)

    def add(graph, a, b, data, n):
        return (FAIL,)
    drv.cuGraphAddDependencies = add
    _use(monkeypatch, drv)
    with pytest.raises(BackendError, match="restoring default edges"):
        graphs._make_programmatic("g")
