"""A routine attached to op X sees exactly X's tensors, in program order.

Whatever onnxruntime did to the graph (fusions, folded BatchNorm, layout
changes), a routine before or after a node of the user's model receives the
values of that node's inputs or outputs as the plain model defines them
(same dtype and shape, same values), and the routines of one run are called
in the order of the model's nodes: a node's before-routines, its
after-routines, then the next node's. The reference values come from an
uninstrumented run of the model with every tensor added as a graph output.
"""

import os
import warnings

import numpy as np
import pytest

import amanda
import amanda.runtime.onnx
from tests.onnx.conftest import DATA, helper, light_feeds, numpy_helper, onnx, ort, session
from onnx import TensorProto

LEVELS = [ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
          ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, ort.GraphOptimizationLevel.ORT_ENABLE_ALL]


class Record(amanda.Tool):
    """Keeps a copy of what every before/after routine receives, in call order.

    ``may_replace`` makes the routine's code able to return something, so
    it sits in the model's dataflow instead of on a side branch.
    """

    def __init__(self, may_replace=False):
        super().__init__()
        self.log = []
        self.ops = []     # op ids in the order analysis met them: the program order
        self.add_inst_for_op(self.analyse, require_outputs=True)
        self.look = self.look_inline if may_replace else self.look_side

    def analyse(self, context):
        node = context.get_op()
        self.ops.append(context.get_op_id())
        context.insert_before_op(self.look, op=context.get_op_id(), kind="before",
                                 names=list(node.input))
        context.insert_after_op(self.look, op=context.get_op_id(), kind="after",
                                names=list(node.output))

    def look_side(self, *arrays, op, kind, names):
        self.log.append((op, kind, names, [None if a is None else np.array(a) for a in arrays]))

    def look_inline(self, *arrays, op, kind, names):
        self.log.append((op, kind, names, [None if a is None else np.array(a) for a in arrays]))
        if not arrays:   # never true: the code may return something, that is all
            return arrays
        return None


def cnn():
    """Conv -> BatchNormalization -> Relu -> MaxPool -> Flatten -> Gemm -> Relu -> Gemm:
    Conv+BN folding, Conv+Relu and Gemm+Relu fusion, NCHWc layouts at ALL."""
    rng = np.random.default_rng(3)

    def weight(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "cw", "cb"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["hr"], name="relu2"),
        helper.make_node("Gemm", ["hr", "w2", "b2"], ["y"], name="fc2", transB=1)]
    variance = numpy_helper.from_array(rng.uniform(0.5, 2, 8).astype(np.float32), "v")
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
        [weight("cw", 8, 3, 3, 3), weight("cb", 8), weight("g", 8), weight("b", 8),
         weight("m", 8), variance, weight("w1", 16, 8 * 4 * 4), weight("b1", 16),
         weight("w2", 5, 16), weight("b2", 5)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)}
    return model, feeds


def matmul_add():
    """MatMul + Add (fused into Gemm) -> Relu -> MatMul + Add -> Softmax."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("W1", (6, 7)), ("B1", (7,)), ("W2", (7, 3)), ("B2", (3,)))]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["mm1"], name="mm1"),
             helper.make_node("Add", ["mm1", "B1"], ["a1"], name="add1"),
             helper.make_node("Relu", ["a1"], ["r1"], name="relu1"),
             helper.make_node("MatMul", ["r1", "W2"], ["mm2"], name="mm2"),
             helper.make_node("Add", ["mm2", "B2"], ["a2"], name="add2"),
             helper.make_node("Softmax", ["a2"], ["y"], name="softmax", axis=-1)]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model, {"x": rng.standard_normal((4, 6)).astype(np.float32)}


def squeezenet():
    model = onnx.load(os.path.join(DATA, "light", "light_squeezenet.onnx"))
    return model, light_feeds(model)


MODELS = {"cnn": cnn, "matmul_add": matmul_add}


def reference(model, feeds):
    """Every tensor of the model by name, from a plain run with all of them as outputs."""
    every = onnx.ModelProto()
    every.CopyFrom(model)
    declared = {o.name for o in every.graph.output}
    for node in every.graph.node:
        every.graph.output.extend(onnx.ValueInfoProto(name=o) for o in node.output
                                  if o and o not in declared)
    names = [o.name for o in every.graph.output]
    values = dict(zip(names, session(every, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
                      .run(names, feeds)))
    values.update(feeds)
    values.update((i.name, numpy_helper.to_array(i)) for i in model.graph.initializer)
    return values


def check(tool, model, feeds, runs, exact, plain=None):
    """``plain``: the outputs of the plain session at the level the
    instrumented one ran at; the after-routines of the ops making them see
    them bit for bit (the optimised kernels' own values)."""
    values = reference(model, feeds)
    order = [(op, kind) for op in tool.ops for kind in ("before", "after")]
    assert len(tool.ops) == len(model.graph.node)
    assert [(op, kind) for op, kind, _, _ in tool.log] == order * runs
    outputs = dict(zip([o.name for o in model.graph.output], plain or ()))
    for op, kind, names, arrays in tool.log:
        assert len(arrays) == len(names), (op, kind)
        for name, array in zip(names, arrays):
            expected = values[name]
            assert array is not None, (op, kind, name)
            assert (array.dtype, array.shape) == (expected.dtype, expected.shape), \
                (op, kind, name)
            if exact:
                np.testing.assert_array_equal(array, expected, err_msg=f"{op} {kind} {name}")
            else:   # kernels the optimiser fused round differently
                scale = float(np.abs(expected).max(initial=1.0))
                np.testing.assert_allclose(array, expected, rtol=1e-5, atol=1e-6 * scale,
                                           err_msg=f"{op} {kind} {name}")
            if name in outputs:
                np.testing.assert_array_equal(array, outputs[name], err_msg=f"{op} {name}")


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
@pytest.mark.parametrize("build", sorted(MODELS))
def test_side_branches_see_the_plain_values_in_program_order(build, level):
    model, feeds = MODELS[build]()
    tool = Record()
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    with amanda.apply(tool):
        instrumented = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])
    for _ in range(2):
        got = instrumented.run(None, feeds)
    plain = session(model, level).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(plain, got))
    check(tool, model, feeds, 2, exact=level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
          plain=plain)


@pytest.mark.parametrize("build", sorted(MODELS))
def test_routines_in_the_dataflow_see_the_plain_values_in_program_order(build):
    model, feeds = MODELS[build]()
    tool = Record(may_replace=True)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with amanda.apply(tool):
        instrumented = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])
    instrumented.run(None, feeds)
    check(tool, model, feeds, 1, exact=True)


@pytest.mark.parametrize("build", sorted(MODELS))
def test_instrumented_model_sees_the_plain_values_in_program_order(build):
    model, feeds = MODELS[build]()
    tool = Record()
    instrumented = amanda.instrument(model, tool)
    amanda.runtime.onnx.inference_session(instrumented).run(None, feeds)
    check(tool, model, feeds, 1, exact=False)


def test_light_squeezenet_routines_see_the_plain_values_in_program_order():
    model, feeds = squeezenet()
    tool = Record()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amanda.apply(tool):
            instrumented = ort.InferenceSession(model.SerializeToString(),
                                                providers=["CPUExecutionProvider"])
    got = instrumented.run(None, feeds)
    plain = session(model).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(plain, got))
    check(tool, model, feeds, 1, exact=False, plain=plain)
