"""Unmarked routines that are pure tensor arithmetic become TF ops, not
``tf.numpy_function`` callbacks; routines with side effects stay hosted.

Checked by difference on a small convolutional graph: the instrumented
GraphDef equals the hosted one (`amanda.portable.inference(False)`) and the
graph with its filters masked by hand.
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda import portable  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::amanda.errors.NotBitExactWarning")

HOSTED = ("PyFunc", "PyFuncStateless", "EagerPyFunc")


def conv_graph(masks=None):
    """Three conv2d + relu blocks over constant filters, then a mean."""
    rng = np.random.default_rng(2)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 12, 12, 3], name="x")
        h = x
        for i in range(3):
            name = f"filter{i}"
            value = (rng.standard_normal((3, 3, h.shape[-1], 6)) * 0.3).astype(np.float32)
            if masks is not None:
                value = value * masks[f"{name}:0"]
            h = tf.nn.relu(tf.nn.conv2d(h, tf.constant(value, name=name), 1, "SAME",
                                        name=f"conv{i}"), name=f"relu{i}")
        tf.reduce_mean(h, axis=[1, 2], name="y")
    return graph


def closure_mask(mask):
    return lambda weight: weight * mask


def keyword_mask(weight, mask):
    return weight * mask


def doubled_positive(y):
    return portable.where(y > 0, y * 2.0, y)


class MaskConvs(amanda.Tool):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.rng = np.random.default_rng(0)
        self.masks = {}
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        op = context.get_op()
        if op.type == "Conv2D":
            shape = op.inputs[1].shape.as_list()
            mask = (self.rng.random(shape) > 0.5).astype(np.float32)
            self.masks[op.inputs[1].name] = mask
            if self.style == "closure":
                context.insert_before_op(closure_mask(mask), inputs=[1])
            else:
                context.insert_before_op(keyword_mask, inputs=[1], mask=mask)
        elif op.type == "Relu" and self.style == "closure":
            context.insert_after_op(doubled_positive)


def run(graph_def, feed):
    graph = tf.Graph()
    with graph.as_default():
        tf.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as session:
        return session.run("y:0", {"x:0": feed})


FEED = np.random.default_rng(5).standard_normal((2, 12, 12, 3)).astype(np.float32)


@pytest.mark.parametrize("style", ["closure", "keyword"])
def test_mask_routines_become_tf_ops_equal_to_hosted(style):
    tool = MaskConvs(style)
    native = amanda.instrument(conv_graph(), tool)
    assert not [n.name for n in native.node if n.op in HOSTED]
    assert len(tool.masks) == 3
    assert sum(n.op == "Mul" for n in native.node) >= 3
    with portable.inference(False):
        hosted_tool = MaskConvs(style)
        hosted = amanda.instrument(conv_graph(), hosted_tool)
    assert sum(n.op in HOSTED for n in hosted.node) >= 3
    got = run(native, FEED)
    assert np.array_equal(got, run(hosted, FEED))
    if style == "keyword":
        assert np.array_equal(got, run(conv_graph(tool.masks).as_graph_def(), FEED))
        assert not np.array_equal(got, run(conv_graph().as_graph_def(), FEED))


class SideEffects(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.seen = []
        self.positive = 0
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op().type == "Conv2D":
            context.insert_before_op(self.count, inputs=[0])
            context.insert_before_op(self.append, inputs=[0])
            context.insert_after_op(self.branch)

    def count(self, x):
        self.calls += 1

    def append(self, x):
        self.seen.append(x.shape)

    def branch(self, y):
        if y.max() > 0:
            self.positive += 1
        return y


def test_side_effects_stay_hosted_and_count_every_run():
    tool = SideEffects()
    for routine in (tool.count, tool.append, tool.branch, lambda x: x.numpy() * 2):
        assert not portable.is_portable(routine), portable.explain(routine)
    graph = conv_graph()
    with graph.as_default():
        y = graph.get_tensor_by_name("y:0")
    with tf.compat.v1.Session(graph=graph) as session:
        vanilla = session.run(y, {"x:0": FEED})
        with amanda.apply(tool):
            for step in range(1, 4):
                assert np.array_equal(session.run(y, {"x:0": FEED}), vanilla)
                assert tool.calls == len(tool.seen) == tool.positive == 3 * step
