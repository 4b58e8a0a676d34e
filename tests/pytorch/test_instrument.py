"""amanda.instrument on amanda IR graphs: a new graph, the input untouched."""

import pytest

import amanda
from amanda.ir import Graph
from amanda.passes.lower_actions import ROUTINE


def conv_relu_graph():
    g = Graph("g", namespace="onnx/21/graph")
    x, w = g.add_input("x"), g.add_input("w")
    conv = g.create_op("Conv", [x, w], name="conv")
    relu = g.create_op("Relu", [conv.outputs[0]], name="relu")
    g.set_outputs([relu.outputs[0]])
    return g


class MaskConv(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.seen = []
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        self.seen.append((context.namespace, context.get_op_name()))
        if context.get_op_name() == "Conv":
            context.insert_before_op(self.mask, inputs=[1])

    def mask(self, weight):
        return weight


def test_instrument_ir_graph_returns_a_new_graph_and_keeps_the_input():
    graph = conv_relu_graph()
    before = graph.structural_hash()
    tool = MaskConv()
    result = amanda.instrument(graph, tool)
    assert graph.structural_hash() == before
    result.verify()
    (routine,) = [op for op in result.ops if op.type == ROUTINE]
    conv = next(op for op in result.ops if op.name == "conv")
    assert conv.inputs[1].producer is routine
    assert routine.attrs["kind"] == "before_op" and routine.attrs["target"] == "conv"
    assert tool.seen == [("onnx/21/graph", "Conv"), ("onnx/21/graph", "Relu")]


def test_instrument_refuses_unknown_programs():
    with pytest.raises(amanda.BackendError, match="cannot instrument a dict"):
        amanda.instrument({}, MaskConv())
