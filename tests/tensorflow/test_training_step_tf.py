"""A Keras training step with the optimizer's update inside the step, under
an observe-only counting tool and an identity tool: the step's output must
equal the plain step's bit for bit, and every op that runs one of its points
runs all of them (as many before-routines as after-routines, per op).

This is the test that would have caught issue 31: the ``tf.function`` (and
``Session.run``) computes the output and the loss, takes gradients and
applies them with ``keras.optimizers.SGD`` in the same call, so variable
reads, the hosted routines and the optimizer's writes meet in one run. The
weights and the optimizer's state are restored before every run; oneDNN is
off for the directory (conftest.py); Grappler runs with its defaults, as a
user's would.

The quick tests use a small model with the parts that mattered (a grouped
convolution, which Keras compiles with XLA on CPU, layer normalization, a
dense head); the Keras applications the identity sweep knows run as slow
tests (32x32 inputs, batch 2).
"""


import numpy as np
import pytest

import amanda

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")


class Counting(amanda.Tool):
    """Counts, per op and point, how often routines that return None ran, at
    the four points of every op."""

    def __init__(self):
        super().__init__()
        self.counts = {}
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True, require_outputs=True)

    def forward(self, context):
        key = ("forward", context.get_op_id())
        context.insert_before_op(self.count, key=(key, "before"))
        context.insert_after_op(self.count, key=(key, "after"))

    def backward(self, context):
        key = ("backward", context.get_backward_op_id())
        context.insert_before_backward_op(self.count, key=(key, "before"))
        context.insert_after_backward_op(self.count, key=(key, "after"))

    def count(self, *tensors, key):
        self.counts[key] = self.counts.get(key, 0) + 1


class CountingIdentity(Counting):
    """The same points, each routine returning the tensors it received."""

    def count(self, *tensors, key):
        self.counts[key] = self.counts.get(key, 0) + 1
        return tensors


TOOLS = [Counting, CountingIdentity]


def assert_whole_points(tool):
    """Before and after counts equal, per op (and so in total)."""
    ops = {key for key, _ in tool.counts}
    uneven = {key: (tool.counts.get((key, "before"), 0), tool.counts.get((key, "after"), 0))
              for key in ops}
    uneven = {key: pair for key, pair in uneven.items() if pair[0] != pair[1]}
    assert tool.counts, "no routine ran"
    assert any(key[0] == "backward" for key in ops), "no backward routine ran"
    assert not uneven, f"ops whose before and after routines ran unequally: {uneven}"


def assert_same(expected, actual, what):
    assert len(expected) == len(actual)
    for i, (a, b) in enumerate(zip(expected, actual)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, f"{what}: result {i} has shape {b.shape}, plain {a.shape}"
        if not np.array_equal(a, b):
            diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
            raise AssertionError(f"{what}: result {i} differs from the plain step by up to {diff}")


def small_model(side=8):
    inputs = keras.Input((side, side, 4))
    h = keras.layers.Conv2D(4, 3, groups=4, padding="same")(inputs)   # XLA on CPU
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Conv2D(8, 1, activation="gelu")(h)
    h = keras.layers.Conv2D(8, 3, groups=8, padding="same")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(3)(h))


class EagerStep:
    """A ``tf.function`` training step with SGD inside; `run` restores the
    weights and the optimizer's state first and returns the output and every
    weight after the update."""

    def __init__(self, model, images, learning_rate=0.5):
        self.model = model
        self.images = tf.constant(images)
        self.optimizer = keras.optimizers.SGD(learning_rate)
        self.optimizer.build(model.trainable_variables)
        self.state = [(v, v.numpy()) for v in [*model.variables, *self.optimizer.variables]]

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                y = model(x, training=True)
                loss = tf.reduce_mean(y * y)
            grads = tape.gradient(loss, model.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return y

        self.step = step

    def run(self):
        for variable, value in self.state:
            variable.assign(value)
        y = self.step(self.images).numpy()
        return [y] + [v.numpy() for v in self.model.trainable_variables]


class SessionStep:
    """The same step in a ``tf.compat.v1.Session``: output and plain SGD
    updates (``assign_sub``) in one run."""

    def __init__(self, build, images, learning_rate=0.5, exact=False):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.x = tf.compat.v1.placeholder(tf.float32, images.shape)
            model = build()
            self.y = model(self.x, training=True)
            loss = tf.reduce_mean(self.y * self.y)
            variables = [w.value for w in model.trainable_weights]
            grads = tf.compat.v1.gradients(loss, variables)
            self.update = tf.group(*[tf.compat.v1.assign_sub(v, learning_rate * g)
                                     for v, g in zip(variables, grads)])
            self.variables = variables
            init = tf.compat.v1.variables_initializer([w.value for w in model.weights])
            self.values = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape)
                           for v in variables]
            self.restore = tf.group(*[tf.compat.v1.assign(v, p)
                                      for v, p in zip(variables, self.values)])
        config = tf.compat.v1.ConfigProto()
        if exact:
            from tensorflow.core.protobuf import rewriter_config_pb2
            for option in _OFF:
                setattr(config.graph_options.rewrite_options, option,
                        rewriter_config_pb2.RewriterConfig.OFF)
        self.session = tf.compat.v1.Session(graph=self.graph, config=config)
        self.session.run(init)
        self.images = images
        self.saved = self.session.run(variables)

    def run(self):
        self.session.run(self.restore, dict(zip(self.values, self.saved)))
        y, _ = self.session.run([self.y, self.update], {self.x: self.images})
        return [y] + self.session.run(self.variables)


def images(side, batch=2, channels=4):
    return np.random.RandomState(0).rand(batch, side, side, channels).astype(np.float32)


def check(step, tool_class, runs, what, weights=False):
    """``runs`` instrumented runs against the plain one: the output, and
    with ``weights`` the updated weights too (only where Grappler's two
    float rewrites are off: with them on, routines between the gradient ops
    change the rounding of some updates, docs/tensorflow.md, Bit-exactness;
    the output, computed before the update, must not change either way)."""
    keep = None if weights else 1
    expected = step.run()[:keep]
    assert_same(expected, step.run()[:keep], f"{what}, plain twice")   # the baseline repeats
    for _ in range(runs):
        tool = tool_class()
        with amanda.apply(tool):
            actual = step.run()[:keep]
        assert_same(expected, actual, f"{what} under {tool_class.__name__}")
        assert_whole_points(tool)


_OFF = ("constant_folding", "arithmetic_optimization")


@pytest.fixture(params=["default", "exact"])
def grappler(request):
    """Grappler's defaults, or its two float rewrites off (for tf.function a
    process-wide setting, restored afterwards; for a Session its config)."""
    exact = request.param == "exact"
    saved = tf.config.optimizer.get_experimental_options()
    if exact:
        tf.config.optimizer.set_experimental_options({option: False for option in _OFF})
    try:
        yield exact
    finally:
        tf.config.optimizer.set_experimental_options(
            {option: saved.get(option, True) for option in _OFF})


@pytest.mark.parametrize("tool_class", TOOLS, ids=lambda t: t.__name__)
def test_small_step_tf_function(tool_class, grappler):
    keras.utils.set_random_seed(0)
    check(EagerStep(small_model(), images(8)), tool_class, 2, "tf.function step",
          weights=grappler)


@pytest.mark.parametrize("tool_class", TOOLS, ids=lambda t: t.__name__)
def test_small_step_session(tool_class, grappler):
    keras.utils.set_random_seed(0)
    check(SessionStep(small_model, images(8), exact=grappler), tool_class, 2, "Session step",
          weights=grappler)


# The Keras applications of tests/tensorflow/test_identity_sweep_tf.py (all
# of them, not only those it runs without AMANDA_KERAS_SWEEP): weights=None,
# 32x32 (the smallest side each accepts; Xception 71, InceptionV3 75), batch 2.
# InceptionV3 (458 s here) is left out of the suite to keep CI within its
# time; it passed on 2026-11-29 (XPASS). Run it with -k InceptionV3 after
# adding it back here.
APPLICATIONS = [("MobileNetV2", 32), ("MobileNetV3Small", 32), ("ResNet50", 32),
                ("EfficientNetB0", 32), ("ConvNeXtTiny", 32), ("VGG16", 32),
                ("Xception", 71)]


@pytest.fixture
def fresh_keras():
    yield
    keras.backend.clear_session()


def application(name, side):
    return lambda: getattr(keras.applications, name)(weights=None,
                                                     input_shape=(side, side, 3))


#: Issue 31, open: the first full run of these steps (2026-11-29) found the
#: step's output under the counting tool differing from the plain step
#: (MobileNetV2 in tf.function: up to 1.1e-4); not fixed yet. Not strict:
#: an application that passes is reported (XPASS), none fails the suite.
ISSUE_31 = pytest.mark.xfail(strict=False, reason="issue 31: a Keras step with the SGD update "
                             "inside the function is not bit-exact under observe-only tools")


@pytest.mark.slow
@ISSUE_31
@pytest.mark.parametrize("name,side", APPLICATIONS, ids=[a for a, _ in APPLICATIONS])
def test_keras_application_step_tf_function(name, side, fresh_keras):
    keras.utils.set_random_seed(0)
    step = EagerStep(application(name, side)(), images(side, channels=3), learning_rate=0.1)
    for tool_class in TOOLS:
        check(step, tool_class, 1, f"{name} tf.function step")


@pytest.mark.slow
@ISSUE_31
@pytest.mark.parametrize("name,side", [("ConvNeXtTiny", 32)], ids=["ConvNeXtTiny"])
def test_keras_application_step_session(name, side, fresh_keras):
    keras.utils.set_random_seed(0)
    step = SessionStep(application(name, side), images(side, channels=3), learning_rate=0.1)
    for tool_class in TOOLS:
        check(step, tool_class, 1, f"{name} Session step")
