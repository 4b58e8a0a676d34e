"""Malformed GraphDefs given to ``amanda.instrument``: each ends in a
TensorFlow error (the one TF's own ``import_graph_def`` raises) or an amanda
error, never a crash, a hang or an instrumented graph that computes
something else.

Mutations: truncated and flipped bytes of the serialized GraphDef, dangling
input names, cycles, unknown dtypes, huge dimensions, duplicate node names.
"""

import numpy as np
import pytest

import amanda

tf = pytest.importorskip("tensorflow")
hypothesis = pytest.importorskip("hypothesis")
from google.protobuf.message import DecodeError  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

v1 = tf.compat.v1

# What TensorFlow itself raises for a bad GraphDef (import_graph_def turns
# op-registration and validation errors into ValueError/TypeError).
TF_ERRORS = (tf.errors.OpError, ValueError, TypeError, KeyError)


class Count(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        context.insert_before_op(self.count)
        context.insert_after_op(self.count)

    def count(self, *arrays):
        self.calls += 1


def base_graph_def():
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [2, 3], name="x")
        w = tf.constant(np.arange(6, dtype=np.float32).reshape(3, 2), name="w")
        h = tf.nn.relu(tf.matmul(x, w, name="mm"), name="h")
        tf.reduce_sum(h + 1.0, name="out")
    return graph.as_graph_def()


BASE = base_graph_def()
SERIALIZED = BASE.SerializeToString()
FEED = np.arange(6, dtype=np.float32).reshape(2, 3) - 2


def outputs(graph_def):
    """``out:0`` of a GraphDef for FEED (raises what TF raises)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.import_graph_def(graph_def, name="")
    with v1.Session(graph=graph) as session:
        return session.run("out:0", {"x:0": FEED})


def check(graph_def):
    """Either both TF and amanda refuse the graph, or amanda's graph computes
    what TF computes (and refuses only with a TF or amanda error)."""
    try:
        instrumented = amanda.instrument(graph_def, Count())
    except amanda.AmandaError:
        return
    except TF_ERRORS:
        return
    try:
        want = outputs(graph_def)
    except TF_ERRORS + (RuntimeError,):   # RuntimeError: an empty graph
        return   # TF cannot run it either; amanda's copy runs (or fails) the same way
    assert np.array_equal(outputs(instrumented), want)


FUZZ = settings(max_examples=100, deadline=5000, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.integers(0, len(SERIALIZED) - 1))
def test_truncated_bytes(cut):
    try:
        graph_def = tf.compat.v1.GraphDef.FromString(SERIALIZED[:cut])
    except DecodeError:
        return
    check(graph_def)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(SERIALIZED) - 1), st.integers(1, 255)),
                min_size=1, max_size=4))
def test_flipped_bytes(flips):
    data = bytearray(SERIALIZED)
    for position, mask in flips:
        data[position] ^= mask
    try:
        graph_def = tf.compat.v1.GraphDef.FromString(bytes(data))
    except DecodeError:
        return
    check(graph_def)


NODES = [node.name for node in BASE.node]


def mutated(kind, node_index, other_index, value):
    graph_def = tf.compat.v1.GraphDef()
    graph_def.CopyFrom(BASE)
    node = graph_def.node[node_index % len(graph_def.node)]
    other = graph_def.node[other_index % len(graph_def.node)]
    if kind == "dangling":
        node.input.append(f"nowhere_{value}:{value % 3}")
    elif kind == "dangling_control":
        node.input.append(f"^nowhere_{value}")
    elif kind == "bad_index":
        node.input.append(f"{other.name}:{value}")
    elif kind == "cycle":
        other.input.append(node.name)
        node.input.append(other.name)
    elif kind == "control_cycle":
        other.input.append("^" + node.name)
        node.input.append("^" + other.name)
    elif kind == "self_loop":
        node.input.append(node.name)
    elif kind == "unknown_dtype":
        for attr in ("T", "dtype"):
            if attr in node.attr:
                node.attr[attr].type = 200 + value % 50
    elif kind == "huge_dim":
        shape = tf.TensorShape([2 ** 62, value]).as_proto()
        if "shape" in node.attr:
            node.attr["shape"].shape.CopyFrom(shape)
        else:
            node.attr["_output_shapes"].list.shape.add().CopyFrom(shape)
    elif kind == "duplicate":
        node.name = other.name
    elif kind == "unknown_op":
        node.op = f"NoSuchOp{value}"
    return graph_def


KINDS = ["dangling", "dangling_control", "bad_index", "cycle", "control_cycle", "self_loop",
         "unknown_dtype", "huge_dim", "duplicate", "unknown_op"]


@FUZZ
@given(st.sampled_from(KINDS), st.integers(0, 50), st.integers(0, 50), st.integers(0, 2 ** 20))
def test_structural_mutations(kind, node_index, other_index, value):
    check(mutated(kind, node_index, other_index, value))


def test_the_base_graph_is_instrumented():
    tool = Count()
    instrumented = amanda.instrument(BASE, tool)
    assert np.array_equal(outputs(instrumented), outputs(BASE))
    assert tool.calls > 0
