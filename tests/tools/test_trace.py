"""Eager execution lifted into the IR: one step = one graph of forward and
backward ops joined by tensor edges."""

import torch

import amanda
from amanda.ir import Graph
from amanda.tools.graph import GraphTracingTool


def step(model):
    y = model(torch.rand(1, 3, 32, 32))
    y.sum().backward()


def test_one_step_is_one_verified_graph(cnn):
    tracer = GraphTracingTool()
    with amanda.apply(tracer):
        step(cnn)
    graph = tracer.graph
    graph.verify()
    forward = [op for op in graph.ops if not op.attrs.get("backward")]
    backward = [op for op in graph.ops if op.attrs.get("backward")]
    assert [op.type for op in forward].count("conv2d") == 4
    assert [op.type for op in backward].count("ConvolutionBackward0") == 4
    # each backward op hangs off its forward op and has the right id
    for op in backward:
        (owner,) = op.control_inputs
        assert owner.attrs["op_id"] == op.attrs["forward_op_id"]
    # gradient edges: the first conv's backward consumes the second's output
    convs = [op for op in backward if op.type == "ConvolutionBackward0"]
    assert convs[-1].inputs[0].producer is convs[-2]
    # forward tensor edges and shapes
    assert forward[0].type == "rand"   # the input is made inside the step
    conv1 = forward[1]
    assert conv1.inputs[0].producer is forward[0]
    assert conv1.outputs[0].attrs["shape"] == [1, 32, 30, 30]
    assert conv1.outputs[0].uses[0][0] is forward[2]
    assert sum(1 for op in backward if op.type == "AccumulateGrad") == 12


def test_same_graph_every_step_and_json_round_trip(cnn):
    tracer = GraphTracingTool(keep=3)
    with amanda.apply(tracer):
        for _ in range(3):
            step(cnn)
    hashes = {g.structural_hash() for g in tracer.graphs}
    assert len(tracer.graphs) == 3 and len(hashes) == 1
    again = Graph.from_json(tracer.graph.to_json())
    assert again.structural_hash() == tracer.graph.structural_hash()


def test_contexts_see_the_graph_so_far(cnn):
    class LookBack(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.depends_on(GraphTracingTool())
            self.producers = {}
            self.add_inst_for_op(self.analyse, require_outputs=True)

        def analyse(self, context):
            op = context.get_ir_op()
            assert op in context.get_graph()
            if op.type == "linear":
                self.producers.setdefault(op.attrs["module"],
                                          [t.producer and t.producer.type for t in op.inputs])

    tool = LookBack()
    with amanda.apply(tool):
        step(cnn)
    assert tool.producers["fc1"][0] == "reshape"
    assert tool.producers["fc2"][0] == "relu"
