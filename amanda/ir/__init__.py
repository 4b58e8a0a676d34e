"""The amanda IR: a minimal open-set graph of ops over SSA tensors.

    from amanda.ir import Graph

    g = Graph("main", namespace="pytorch/2.13.0/eager")
    x, w = g.add_input("x", shape=[1, 3, 8, 8]), g.add_input("w")
    conv = g.create_op("conv2d", [x, w], attrs={"stride": [1, 1]})
    g.set_outputs(conv.outputs)
    g.verify()
    print(g)  # %0 = pytorch::conv2d(%x, %w) {stride: [1, 1]}  # conv2d

Ops are data, ``(namespace, type, attrs)``; use-def is kept by the IR; the graph
has a verifier, a name-independent structural hash, a JSON form and networkx/DOT
views. Importing this package imports no backend and not networkx.
"""

from ._core import Op, Tensor
from .errors import IRError, VerificationError
from .graph import Graph
from .hashing import structural_hash
from .serialization import graph_from_json, graph_to_json
from .views import to_dot, to_networkx

__all__ = [
    "Graph",
    "IRError",
    "Op",
    "Tensor",
    "VerificationError",
    "graph_from_json",
    "graph_to_json",
    "structural_hash",
    "to_dot",
    "to_networkx",
]
