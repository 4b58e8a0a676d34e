"""The backend-neutral graph path: instrumentation pass and action lowering
on IR graphs."""

import pytest

import amanda
from amanda.errors import ToolError
from amanda.ir import Graph
from amanda.passes.instrumentation import GraphBackend, run_instrumentation_pass
from amanda.passes.lower_actions import ROUTINE, lower_actions
from amanda.tool import session_for


class Backend(GraphBackend):
    namespace = "test/1/graph"


def small_graph():
    """x -> Conv -> Relu -> out, with the conv's two gradient ops and an
    unowned gradient seed."""
    g = Graph("g", namespace="test/1/graph")
    x, w = g.add_input("x"), g.add_input("w")
    conv = g.create_op("Conv", [x, w], name="conv")
    relu = g.create_op("Relu", [conv.outputs[0]], name="relu")
    seed = g.create_op("Fill", [], name="grad/seed", attrs={"backward": True, "forward_op": None})
    relu_grad = g.create_op("ReluGrad", [seed.outputs[0], relu.outputs[0]], name="grad/relu",
                            attrs={"backward": True, "forward_op": "relu"})
    g.create_op("ConvBackpropFilter", [x, relu_grad.outputs[0]], name="grad/conv_filter",
                attrs={"backward": True, "forward_op": "conv"})
    g.create_op("ConvBackpropInput", [w, relu_grad.outputs[0]], name="grad/conv_input",
                attrs={"backward": True, "forward_op": "conv"})
    g.set_outputs([relu.outputs[0]])
    return g


class Pruner(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.backward = []
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward_analysis, backward=True)

    def forward(self, context):
        if context.get_op_name() == "Conv":
            context["masked"] = True
            context.insert_before_op(self.mask, inputs=[1])
        if context.get_op_name() == "Relu":
            context.insert_after_op(self.observe)

    def backward_analysis(self, context):
        op = context.get_op()
        self.backward.append((context.get_backward_op().name, op.name if op else None,
                              context.get("masked")))
        if context.get_backward_op().type == "ConvBackpropFilter":
            context.insert_after_backward_op(self.mask)

    def mask(self, w):
        return w

    def observe(self, y):
        return None


def test_pass_analyses_forward_then_backward_with_owner_context():
    graph = small_graph()
    tool = Pruner()
    plan = run_instrumentation_pass(graph, session_for((tool,)), Backend())
    assert [e.op.name for e in plan.actions()] == ["conv", "relu", "grad/conv_filter"]
    assert ("grad/conv_filter", "conv", True) in tool.backward
    assert ("grad/seed", None, None) in tool.backward   # reported as unowned, not guessed


def test_pass_reuses_a_previous_plan_for_grown_graphs():
    graph = small_graph()
    counted = []
    tool = amanda.Tool()
    tool.add_inst_for_op(lambda c: counted.append(c.get_op_id()))
    session = session_for((tool,))
    plan = run_instrumentation_pass(graph, session, Backend())
    graph.create_op("Relu", [graph.ops[1].outputs[0]], name="extra")
    run_instrumentation_pass(graph, session, Backend(), plan=plan)
    assert counted == ["conv", "relu", "extra"]


def test_lowering_rewires_like_eager_pytorch():
    graph = small_graph()
    plan = run_instrumentation_pass(graph, session_for((Pruner(),)), Backend())
    lowered = lower_actions(graph, plan)
    lowered.verify()
    assert graph.structural_hash() != lowered.structural_hash()
    small_graph().verify()
    ops = {op.name: op for op in lowered.ops}
    routines = [op for op in lowered.ops if op.type == ROUTINE]
    assert [r.attrs["kind"] for r in routines] == ["before_op", "after_op", "after_backward_op"]
    before, after, backward = routines
    # the conv and its own gradient ops read the masked weight
    assert ops["conv"].inputs[1].producer is before
    assert ops["grad/conv_input"].inputs[0].producer is before
    # the relu's consumers read the observed output, but not its own gradient op
    assert lowered.outputs[0].producer is after
    assert ops["grad/relu"].inputs[1].producer is ops["relu"]
    assert backward.inputs[0].producer is ops["grad/conv_filter"]


def test_lowering_reports_bad_positions():
    class Bad(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(lambda c: c.insert_before_op(lambda *t: t, inputs=[5]))

    graph = small_graph()
    plan = run_instrumentation_pass(graph, session_for((Bad(),)), Backend())
    with pytest.raises(ToolError, match=r"selects position 5 but the op has 2"):
        lower_actions(graph, plan)


def test_after_routines_of_several_tools_chain_in_recorded_order():
    """The second tool's after-routine reads what the first one returned (as
    in eager PyTorch), and consumers read the last one's result."""
    def first(y):
        return y

    def second(y):
        return y

    def tool(routine):
        t = amanda.Tool()
        t.add_inst_for_op(lambda c: c.insert_after_op(routine)
                          if c.get_op_name() == "Relu" else None)
        return t

    graph = small_graph()
    plan = run_instrumentation_pass(graph, session_for((tool(first), tool(second))),
                                    Backend())
    lowered = lower_actions(graph, plan)
    lowered.verify()
    ops = {op.name: op for op in lowered.ops}
    routines = {op.attrs["routine"].split(".")[-1]: op for op in lowered.ops
                if op.type == ROUTINE}
    first, second = routines["first"], routines["second"]
    assert first.inputs[0].producer is ops["relu"]
    assert second.inputs[0].producer is first
    assert lowered.outputs[0].producer is second
    assert ops["grad/relu"].inputs[1].producer is ops["relu"]
