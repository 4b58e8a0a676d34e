"""Observe-only sessions read the plan at its sites: no routine op is made.

When every routine of a session created inside ``apply`` only looks and
none sits in a body, the pipeline stops before lowering (``lower_when``) and
the side branches read each action where its routine op would be
(`amanda.runtime.onnx.sites`). Checked by difference: the side branches
built from the sites and from the lowered routine ops are the same model
and the same plan, fetched and hosted; the session's outputs and calls are
the plain model's and the hosted one's; and lowering happens exactly where
a routine may change the dataflow.
"""

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import amanda
import amanda.passes.lower_actions as lowering_pass
from amanda.runtime.onnx.instrument import _instrument
from amanda.runtime.onnx.lowering import lower
from amanda.runtime.onnx.observe import _SideBranches
from amanda.runtime.onnx.session import _optimised_by_onnxruntime, _plain_options
from amanda.runtime.onnx.sites import SitedGraph, lowerable
from amanda.tool import session_for
from tests.onnx.conftest import mlp, ort, same


def chain():
    """x[2,4] -> MatMul W -> Add B -> Relu -> Softmax -> y: onnxruntime fuses
    the first two, so the MatMul's output is recomputed for its observers."""
    rng = np.random.default_rng(5)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
         helper.make_node("Add", ["m", "B"], ["a"], name="add"),
         helper.make_node("Relu", ["a"], ["r"], name="relu"),
         helper.make_node("Softmax", ["r"], ["y"], name="softmax", axis=-1)], "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W"),
         numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


class Observer(amanda.Tool):
    """Two routines before and two after every op (recorded order matters),
    and one that receives no tensor; every call is logged."""

    def __init__(self):
        super().__init__()
        self.log = []
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        op = context.get_op_id()
        context.insert_before_op(self.look, tag=f"{op}:before:1")
        context.insert_before_op(self.look, inputs=[0], tag=f"{op}:before:2")
        context.insert_after_op(self.look, tag=f"{op}:after:1")
        context.insert_after_op(self.count, outputs=[], tag=f"{op}:after:2")

    def look(self, *arrays, tag):
        self.log.append((tag, tuple(float(np.sum(a)) for a in arrays if a is not None)))

    def count(self, tag):
        self.log.append((tag, ()))


class Replacer(Observer):
    def analyse(self, context):
        super().analyse(context)
        if context.get_op_name() == "Relu":
            context.replace_op(lambda x: np.maximum(x, 0))


MODELS = {"mlp": mlp, "chain": chain}


def _plan(branches):
    """What a side-branch model computes, keys aside: the nodes and outputs
    it adds, and for each fetched routine its site and tensors."""
    model = branches.model()
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    fetched = [(where, action.kwargs, count, hosted, names)
               for action, where, count, hosted, names in branches.fetched]
    return nodes, [o.name for o in model.graph.output], fetched


@pytest.mark.parametrize("fetch", [True, False], ids=["fetched", "hosted"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_sites_give_the_side_branches_what_routine_ops_give(name, fetch):
    user = MODELS[name]()
    session = session_for([Observer()])
    lowered, observing = _instrument(user, session, callbacks=True, apart=True)
    assert lowered is None and isinstance(observing.top, SitedGraph)
    sited = observing.top
    routine_ops = sited.lowered()
    assert sum(op.type == lowering_pass.ROUTINE for op in routine_ops) == \
        sum(op.type == lowering_pass.ROUTINE for op in sited) == 4 * len(user.graph.node)
    results = []
    # the sites prepared while onnxruntime optimises (as a session does,
    # the IR graph then dropped where every routine is at a site) or not,
    # and the routine ops
    for graph, prepared in ((sited, "dropped"), (sited, True), (sited, False),
                            (routine_ops, False)):
        folder, optimised = _optimised_by_onnxruntime(
            user.SerializeToString(), _plain_options(None), True, ["CPUExecutionProvider"],
            None, {})
        try:
            branches = _SideBranches(graph, user, fetch=fetch, eager=not fetch)
            if prepared:
                branches.prepare()
                assert branches._sites_prepared == fetch
                if prepared == "dropped" and fetch:
                    branches.drop_graph()   # `model` then reads nothing of the IR graph
                    assert branches.top is None and not branches.names
            branches.take(optimised)
            results.append(_plan(branches))
        finally:
            folder.cleanup()
    assert results[0] == results[1] == results[2] == results[3]
    assert any("recomputed" in n for _, _, outputs in results[0][0] for n in outputs)
    # written with the routines in the dataflow, both are one model
    written = [lower(g) for g in (lowerable(sited), routine_ops)]
    assert [(n.op_type, list(n.input)) for n in written[0].graph.node] == \
        [(n.op_type, list(n.input)) for n in written[1].graph.node]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_observe_only_session_lowers_nothing_and_sees_what_a_hosted_one_sees(
        name, monkeypatch):
    user = MODELS[name]()
    data = user.SerializeToString()
    x = np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    lowered = []
    real = lowering_pass.lower_actions
    monkeypatch.setattr(lowering_pass, "lower_actions",
                        lambda *a, **k: lowered.append(1) or real(*a, **k))
    logs = []
    for hosted in (False, True):
        tool = Observer()
        with amanda.apply(tool):
            if hosted:
                with amanda.runtime.onnx.hosted_observation():
                    made = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
            else:
                made = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        assert all(same(a, b) for a, b in zip(want, made.run(None, {"x": x})))
        logs.append(tool.log)
    assert not lowered
    assert logs[0] == logs[1] and len(logs[0]) == 4 * len(user.graph.node)
    # the order of the sites: each op's routines in recorded order, ops in order
    tags = [tag for tag, _ in logs[0]]
    ops = list(dict.fromkeys(t.split(":")[0] for t in tags))
    assert tags == [f"{op}:{point}" for op in ops
                    for point in ("before:1", "before:2", "after:1", "after:2")]
    # a routine that may change the dataflow is lowered
    with amanda.apply(Replacer()):
        made = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    made.run(None, {"x": x})
    assert lowered == [1]


@pytest.mark.parametrize("interval", [None, 0.001])
def test_the_switch_interval_is_restored_after_the_optimisation_ahead(interval):
    """The optimisation ahead runs on a thread with the switch interval
    lowered (`_SwitchInterval`); once the session is made it is what it
    was, the default or the user's own, also when amanda's work failed."""
    import sys
    from amanda.runtime.onnx import session as driver
    saved = sys.getswitchinterval()
    try:
        if interval is not None:
            sys.setswitchinterval(interval)
        want = sys.getswitchinterval()
        seen = []
        real = driver._optimised_by_onnxruntime

        def optimise(*args, **kwargs):
            seen.append(sys.getswitchinterval())
            return real(*args, **kwargs)

        driver._optimised_by_onnxruntime, restore = optimise, real
        try:
            with amanda.apply(Observer()):
                ort.InferenceSession(chain().SerializeToString(),
                                     providers=["CPUExecutionProvider"])
            assert seen and abs(seen[0] - driver._SwitchInterval.LOW) < 1e-6 < want - seen[0]
            assert sys.getswitchinterval() == want

            class Failing(Observer):
                def analyse(self, context):
                    raise ValueError("the tool's bug")

            with pytest.raises(amanda.ToolError, match="the tool's bug"):
                with amanda.apply(Failing()):
                    ort.InferenceSession(chain().SerializeToString(),
                                         providers=["CPUExecutionProvider"])
            assert len(seen) == 2 and sys.getswitchinterval() == want
        finally:
            driver._optimised_by_onnxruntime = restore
    finally:
        sys.setswitchinterval(saved)


def test_a_failure_while_onnxruntime_optimises_leaves_nothing_running(monkeypatch):
    """The side branches' preparation runs while onnxruntime optimises the
    model on amanda's thread: if it fails, the optimisation is waited for and
    its files removed before the error reaches the user."""
    import os
    import sys
    from amanda.runtime.onnx import scratch
    from amanda.runtime.onnx.observe import _SideBranches as branches

    def failing(self):
        raise RuntimeError("preparation failed")

    monkeypatch.setattr(branches, "prepare", failing)
    interval = sys.getswitchinterval()
    with pytest.raises(RuntimeError, match="preparation failed"):
        with amanda.apply(Observer()):
            ort.InferenceSession(chain().SerializeToString(), providers=["CPUExecutionProvider"])
    assert set(os.listdir(scratch.folder())) <= {scratch.STUB}
    assert sys.getswitchinterval() == interval


def tied():
    """x[2,4] -> MatMul (Identity of W) -> Add (a Constant) -> Mul (the sum
    of two Constants) -> Reshape (Identity of a Constant) -> Relu -> y.
    onnxruntime folds the Identity nodes and the Constants' sum away: the
    Identities' outputs and the summed Constants exist only in the user's
    graph."""
    rng = np.random.default_rng(3)
    bias = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32))
    graph = helper.make_graph(
        [helper.make_node("Identity", ["W"], ["Wt"], name="tie"),
         helper.make_node("Constant", [], ["B"], name="bias", value=bias),
         helper.make_node("Constant", [], ["half"], name="half", value_float=0.25),
         helper.make_node("Constant", [], ["quarter"], name="quarter",
                          value=numpy_helper.from_array(np.array(0.25, np.float32))),
         helper.make_node("Add", ["half", "quarter"], ["s"], name="scale"),
         helper.make_node("Constant", [], ["shape0"], name="dims", value_ints=[3, 2]),
         helper.make_node("Identity", ["shape0"], ["shape"], name="dims_id"),
         helper.make_node("MatMul", ["x", "Wt"], ["m"], name="mm"),
         helper.make_node("Add", ["m", "B"], ["a"], name="add"),
         helper.make_node("Mul", ["a", "s"], ["ms"], name="mul"),
         helper.make_node("Reshape", ["ms", "shape"], ["r"], name="reshape"),
         helper.make_node("Relu", ["r"], ["y"], name="relu")], "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
        [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


class Keeper(amanda.Tool):
    """Keeps a copy of every node's outputs, by node name."""

    def __init__(self):
        super().__init__()
        self.seen = {}
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        context.insert_after_op(self.keep, node=context.get_op().name)

    def keep(self, *arrays, node):
        self.seen[node] = [np.array(a) for a in arrays]


@pytest.mark.parametrize("fetch", [True, False], ids=["fetched", "hosted"])
def test_folded_constants_and_identities_are_observed_without_a_node(fetch):
    """A value onnxruntime folded away that an Identity or a Constant made
    is what the Identity's input or the Constant's attribute holds: the side
    branches make no node for it (an initializer or the input's name stands
    for it), and the routine sees exactly that value."""
    user = tied()
    data = user.SerializeToString()
    folder, optimised = _optimised_by_onnxruntime(
        data, _plain_options(None), True, ["CPUExecutionProvider"], None, {})
    try:
        own = collections.Counter(n.op_type for n in optimised.graph.node)
        assert not any(n.op_type in ("Identity", "Constant") for n in optimised.graph.node)
        sited = _instrument(user, session_for([Keeper()]), callbacks=True, apart=True)[1].top
        model = _SideBranches(sited, user, optimised, fetch=fetch, eager=not fetch).model()
    finally:
        folder.cleanup()
    added = collections.Counter(n.op_type for n in model.graph.node) - own
    assert "Identity" not in added and "Constant" not in added, added
    # what each routine sees, against the user's graph run at ORT_DISABLE_ALL
    # with every value an output
    every = onnx.ModelProto()
    every.CopyFrom(user)
    del every.graph.output[:]
    every.graph.output.extend(helper.make_empty_tensor_value_info(o) for n in user.graph.node
                              for o in n.output)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    x = np.random.default_rng(4).standard_normal((2, 4)).astype(np.float32)
    values = dict(zip([o.name for o in every.graph.output],
                      ort.InferenceSession(every.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
                      .run(None, {"x": x})))
    tool = Keeper()
    with amanda.apply(tool):
        if fetch:
            made = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        else:
            with amanda.runtime.onnx.hosted_observation():
                made = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert all(same(a, b) for a, b in zip(want, made.run(None, {"x": x})))
    folded = [n for n in user.graph.node if n.op_type in ("Identity", "Constant")]
    assert len(folded) == 6
    for node in folded:
        (got,) = tool.seen[node.name]
        assert same(got, values[node.output[0]]), node.name
