"""Hypothesis strategies and helpers shared by the IR tests."""

from hypothesis import strategies as st

from amanda.ir import Graph

OP_TYPES = ("add", "mul", "relu", "conv2d", "split", "concat", "identity")
NAMESPACES = ("", "pytorch/2.13.0/eager", "onnx/21/graph")

# "$" in keys exercises the escaping of user dicts that look like markers.
_keys = st.text(alphabet="ab$_", min_size=1, max_size=3)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=4)
)
json_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
    max_leaves=6,
)
attr_dicts = st.dictionaries(st.sampled_from(["stride", "axis", "mode", "alpha", "pads"]), json_values, max_size=3)


@st.composite
def graphs(draw, max_ops=12):
    """Random verified DAGs: random types, namespaces and attrs, wired to earlier tensors."""
    graph = Graph(draw(st.sampled_from(["main", "g"])), namespace=draw(st.sampled_from(NAMESPACES)))
    tensors = [graph.add_input(**draw(attr_dicts)) for _ in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(0, max_ops))):
        inputs = draw(st.lists(st.sampled_from(tensors), max_size=3))
        controls = [draw(st.sampled_from(graph.ops))] if len(graph) and draw(st.integers(0, 4)) == 0 else []
        op = graph.create_op(
            draw(st.sampled_from(OP_TYPES)),
            inputs,
            num_outputs=draw(st.sampled_from([1, 1, 1, 0, 2, 3])),
            attrs=draw(attr_dicts),
            namespace=draw(st.sampled_from(NAMESPACES + (None,))),
            control_inputs=controls,
        )
        for tensor in op.outputs:
            tensor.attrs = draw(attr_dicts)
        tensors.extend(op.outputs)
    graph.set_outputs(draw(st.lists(st.sampled_from(tensors), max_size=3)))
    return graph


def all_tensors(graph):
    """Graph inputs then op outputs, in definition order."""
    return list(graph.inputs) + [t for op in graph for t in op.outputs]


def tensors_before(graph, op):
    """Tensors defined before ``op`` (graph inputs and earlier ops' outputs)."""
    found = list(graph.inputs)
    for other in graph:
        if other is op:
            break
        found.extend(other.outputs)
    return found


def assert_use_def(graph):
    """Both directions of the use-def invariant hold for every op and tensor."""
    slots = 0
    for op in graph:
        for position, tensor in enumerate(op.inputs):
            assert (op, position) in tensor.uses
            slots += 1
    uses = 0
    for tensor in all_tensors(graph):
        for op, position in tensor.uses:
            assert op.graph is graph
            assert op.inputs[position] is tensor
            uses += 1
    assert uses == slots


def snapshot(graph):
    """Everything a refused mutation must leave untouched."""
    uses = [(t.name, [(op.name, p) for op, p in t.uses]) for t in all_tensors(graph)]
    return str(graph), graph.structural_hash(), uses, [op.name for op in graph]
