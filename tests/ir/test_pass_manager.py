"""The pass contract (`PassResult`), `PassManager`, the pass adapters and the
OpContext setters the passes use."""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import amanda
from amanda.context import Deferred, OpContext
from amanda.errors import AmandaError, ToolError
from amanda.ir import Graph
from amanda.passes import PassError, PassManager, PassResult
from amanda.passes.instrumentation import GraphBackend, InstrumentationPass, _run_points
from amanda.passes.lower_actions import ROUTINE, LowerActionsPass
from amanda.passes.pipeline import instrument_graph
from amanda.passes.rewrite import Pattern, RewritePass, RewriteResult, Rule, apply_rules, op
from amanda.tool import FORWARD_AFTER, FORWARD_BEFORE, session_for

from .strategies import graphs


def chain(n=3):
    g = Graph("g", namespace="test/1/graph")
    value = g.add_input("x")
    for i in range(n):
        value = g.create_op("Relu", [value], name=f"relu{i}").outputs[0]
    g.set_outputs([value])
    return g


def tag(graph):
    """A pass that edits in place: one attr on the first op."""
    first = graph.ops[0]
    changed = first.attrs.get("seen") is None
    first.attrs["seen"] = True
    return PassResult(graph, changed)


def copy_pass(graph):
    return PassResult(graph.copy(), False)


def break_order(graph):
    """Corrupts use-def behind the IR's back, as a buggy pass could."""
    op = graph.ops[1]
    del op.inputs[0]._uses[(op, 0)]
    return PassResult(graph, True)


def test_passes_run_in_order_and_thread_the_graph():
    graph = chain()
    manager = PassManager([tag, copy_pass], name="demo")
    result = manager(graph)
    assert isinstance(result, PassResult) and result.modified
    assert result.graph is not graph and result.graph.ops[0].attrs["seen"] is True
    assert manager.history == [(1, "tag", True), (1, "copy_pass", False)]


def test_rounds_repeat_until_nothing_changes():
    manager = PassManager([tag], max_rounds=5)
    result = manager(chain())
    assert result.modified
    assert manager.history == [(1, "tag", True), (2, "tag", False)]


def test_error_names_the_failing_pass_and_those_run_before():
    def explode(graph):
        raise KeyError("boom")

    manager = PassManager([tag, copy_pass, explode], name="demo")
    with pytest.raises(PassError) as info:
        manager(chain())
    error = info.value
    assert "demo: pass 'explode' raised KeyError" in str(error)
    assert "passes run before it: 'tag', 'copy_pass'" in str(error)
    assert error.pass_name == "explode" and error.passes_run == ["tag", "copy_pass"]
    assert isinstance(error.__cause__, KeyError) and isinstance(error, AmandaError)


def test_a_pass_must_return_a_pass_result():
    def returns_graph(graph):
        return graph

    with pytest.raises(PassError, match="pass 'returns_graph' returned Graph; a pass must return"):
        PassManager([returns_graph])(chain())


def test_debug_mode_verifies_after_each_pass():
    graph = chain()
    with pytest.raises(PassError) as info:
        PassManager([tag, break_order, copy_pass], debug=True)(graph)
    assert "pass 'break_order' left an invalid graph" in str(info.value)
    assert "does not record this use" in str(info.value)
    assert info.value.passes_run == ["tag"]
    # without debug mode the broken graph goes through unnoticed
    assert PassManager([break_order])(chain()).modified


def test_debug_mode_checks_the_input_first():
    graph = break_order(chain()).graph
    with pytest.raises(PassError, match="the input graph is invalid") as info:
        PassManager([tag], debug=True)(graph)
    assert info.value.pass_name is None and info.value.passes_run == []


def test_amanda_errors_keep_their_type_with_a_note():
    def refuse(graph):
        raise ToolError("no", tool=None)

    with pytest.raises(ToolError) as info:
        PassManager([tag, refuse], name="demo")(chain())
    assert any("in pass 'refuse' of 'demo'" in note and "'tag'" in note for note in info.value.__notes__)


def test_pass_names_come_from_name_attr_partial_or_class():
    rules = [_relu_rule()]
    manager = PassManager([RewritePass(rules, name="fold"), functools.partial(apply_rules, rules=rules)])
    result = manager(chain())
    assert [name for _, name, _ in manager.history] == ["fold", "apply_rules"]
    assert result.modified and "Relu" not in {o.type for o in result.graph}


def _relu_rule():
    pattern = Pattern.trace(lambda x: op.Relu(x), name="relu")
    return Rule(pattern, lambda match: [match.inputs[0]])


def test_rewrite_result_is_a_pass_result():
    result = apply_rules(chain(), [_relu_rule()])
    assert isinstance(result, RewriteResult) and isinstance(result, PassResult)
    assert result.modified and result.counts() == {"relu": 3}


class ObserveRelu(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op_name() == "Relu" and context.get_op_id() == "relu1":
            context.insert_before_op(self.observe)

    def observe(self, x):
        return None


def test_instrumentation_and_lowering_as_passes():
    graph = chain()
    analyse = InstrumentationPass(session_for((ObserveRelu(),)), GraphBackend("test/1/graph"))
    manager = PassManager([analyse, LowerActionsPass(analyse)], debug=True)
    result = manager(graph)
    assert manager.history == [(1, "instrument", False), (1, "lower_actions", True)]
    assert [o.type for o in result.graph] == ["Relu", ROUTINE, "Relu", "Relu"]
    assert len(graph) == 3 and len(analyse.plan) == 1  # the input is untouched


def test_lowering_in_place_gives_the_graph_a_copy_would_be():
    """``in_place`` (for a caller that owns the graph) changes where the
    routine ops go, never what the lowered graph is."""
    def lowered(in_place):
        graph = chain()
        analyse = InstrumentationPass(session_for((ObserveRelu(),)), GraphBackend("test/1/graph"))
        result = PassManager([analyse, LowerActionsPass(analyse, in_place=in_place)],
                             debug=True)(graph)
        return graph, result.graph

    graph, copied = lowered(False)
    owned, in_place = lowered(True)
    assert copied is not graph and len(graph) == 3
    assert in_place is owned and in_place.structural_hash() == copied.structural_hash()
    assert str(in_place) == str(copied)


def test_pipeline_lowers_in_place_only_graphs_no_graph_tool_kept():
    class Whole(ObserveRelu):
        def __init__(self):
            super().__init__()
            self.requires_graph = True

        def graph_completed(self, graph):
            self.kept = graph

    backend = GraphBackend("test/1/graph")
    graph = chain()
    _, lowered = instrument_graph(graph, session_for((ObserveRelu(),)), backend,
                                  lower_in_place=True)
    assert lowered is graph and len(graph) == 4
    graph, whole = chain(), Whole()
    _, lowered = instrument_graph(graph, session_for((whole,)), backend, lower_in_place=True)
    assert lowered is not graph and whole.kept is graph and len(graph) == 3


def test_lowering_without_a_plan_is_a_pass_error():
    with pytest.raises(PassError, match="pass 'lower_actions' raised ValueError: .*no plan"):
        PassManager([LowerActionsPass(InstrumentationPass(None, None))])(chain())


def test_context_setters():
    context = OpContext("test/1/graph", None, "id", "Relu")
    with pytest.raises(ToolError, match="inputs are not available"):
        context.get_inputs()
    context._set_values(inputs=[1], outputs=[2])
    assert context.get_inputs() == [1] and context.get_outputs() == [2]
    with pytest.raises(ToolError, match="grad_outputs are not available"):
        context.get_grad_outputs()  # untouched values stay unavailable
    context._set_values(inputs=None)
    assert context.get_inputs() is None and context.get_outputs() == [2]
    with pytest.raises(TypeError, match="no values named 'input'"):
        context._set_values(input=[1])
    context._forget_values()
    assert context.get_outputs() is None and context.get_grad_inputs() is None
    graph = chain()
    context._set_ir(graph.ops[0], graph)
    assert context.get_ir_op() is graph.ops[0] and context.get_graph() is graph


def test_deferred_values_are_made_on_first_use_once():
    """A backend may hand a context `Deferred` values (ONNX does, for its
    ValueInfoProto symbols): made when a routine first asks, then kept; a
    tool that never asks never makes them."""
    made = []

    def make():
        made.append(1)
        return ["x", "w"]

    context = OpContext("test/1/graph", None, "id", "MatMul")
    context._set_values(inputs=Deferred(make), outputs=Deferred(lambda: ["y"]))
    assert made == []
    assert context.get_inputs() == ["x", "w"] and context.get_inputs() == ["x", "w"]
    assert made == [1] and context.get_outputs() == ["y"]
    context._set_values(inputs=Deferred(make))
    context._forget_values()
    assert context.get_inputs() is None and made == [1]


@pytest.mark.parametrize("slots", [("inputs", "outputs"), ("_inputs", "_outputs")])
def test_run_points_accepts_value_names_with_or_without_underscore(slots):
    seen = []

    class Look(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(lambda c: seen.append(("before", c.get_inputs())))
            self.add_inst_for_op(lambda c: seen.append(("after", c.get_outputs())), require_outputs=True)

    graph = chain(1)
    relu = graph.ops[0]
    context = OpContext("test/1/graph", relu, relu.name, relu.type)
    _run_points(relu, graph, session_for((Look(),)), GraphBackend(), context,
                (FORWARD_BEFORE, FORWARD_AFTER), slots)
    assert seen == [("before", list(relu.inputs)), ("after", list(relu.outputs))]
    assert context.get_graph() is graph and context.get_ir_op() is relu


@settings(max_examples=60, deadline=None, database=None)
@given(graphs(), st.data())
def test_rewrite_removal_order_puts_users_first(graph, data):
    from amanda.passes.rewrite import _users_first

    subset = data.draw(st.lists(st.sampled_from(graph.ops), unique=True)) if len(graph) else []
    order = _users_first(subset)
    assert sorted(map(id, order)) == sorted(map(id, subset))
    position = {op: i for i, op in enumerate(order)}
    for op in subset:
        for producer in [t.producer for t in op.inputs] + list(op.control_inputs):
            if producer in position:
                assert position[op] < position[producer]


def test_amanda_instrument_hands_graph_tools_the_graph_like_every_backend():
    """The one pipeline (amanda.passes.pipeline) runs graph_completed for
    requires_graph tools; amanda.instrument on an IR graph skipped it."""
    graph = chain()
    seen = []

    class Whole(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.requires_graph = True
            self.add_inst_for_op(self.analyse)

        def analyse(self, context):
            context.insert_before_op(lambda *xs: None)

        def graph_completed(self, g):
            seen.append([op.name for op in g.ops])

    lowered = amanda.instrument(graph, Whole())
    assert seen == [[op.name for op in graph.ops]]
    assert sum(op.type == ROUTINE for op in lowered.ops) == len(graph.ops)
