"""A Keras training step with the optimizer's update inside the step, under
an observe-only counting tool and an identity tool (issue 31).

The ``tf.function`` (and ``Session.run``) computes the output and the loss,
takes gradients and applies them with SGD in the same call, so variable
reads, the hosted routines and the optimizer's writes meet in one run. The
weights and the optimizer's state are restored before every run; oneDNN is
off for the directory (conftest.py). Two properties, each of which fails on
a defect of its own:

* **Exact.** With Grappler's two float rewrites off (arithmetic optimizer,
  constant folding: the documented condition, docs/tensorflow.md,
  Bit-exactness), the step's output and every updated weight equal the
  plain step's bit for bit, no ``NotBitExactWarning`` is raised, and every
  op that runs one of its points runs all of them (before and after counts
  equal per op: the skipped after-routines of issue 31 fail this).
* **Ordered**, at Grappler's defaults: the forward pass must not read a
  weight the update inside the same run has already written. The output is
  computed before the update, so under the tool it must not move when the
  learning rate is multiplied by 1000, while the weights must. (At the
  defaults the output may differ from the plain step's by the rounding of
  the rewrites the routines block, which amanda announces with
  ``NotBitExactWarning``; in these small-batch models BatchNorm over two
  samples amplifies it: ResNet50's output moves by 0.13, MobileNetV2's by
  1.1e-4, and the plain step itself moves by 5.9e-3 on MobileNetV2 when the
  rewrites are turned off. That was issue 31's "wrong numbers".)

The quick tests use a small model with the parts that mattered (a grouped
convolution, which Keras compiles with XLA on CPU, layer normalization, a
dense head); the Keras applications the identity sweep knows run as slow
tests (32x32 inputs, batch 2).
"""


import contextlib
import os

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
    weights and the optimizer's state first (then sets the learning rate,
    if given: an optimizer variable, so no new trace) and returns the
    output and every weight after the update."""

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

    def run(self, learning_rate=None):
        for variable, value in self.state:
            variable.assign(value)
        if learning_rate is not None:
            self.optimizer.learning_rate = learning_rate
        y = self.step(self.images).numpy()
        return [y] + [v.numpy() for v in self.model.trainable_variables]


class SessionStep:
    """The same step in a ``tf.compat.v1.Session``: output and plain SGD
    updates (``assign_sub``) in one run; the learning rate is a
    placeholder with a default."""

    def __init__(self, build, images, learning_rate=0.5, exact=False):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.x = tf.compat.v1.placeholder(tf.float32, images.shape)
            self.learning_rate = tf.compat.v1.placeholder_with_default(
                np.float32(learning_rate), [])
            model = build()
            self.y = model(self.x, training=True)
            loss = tf.reduce_mean(self.y * self.y)
            variables = [w.value for w in model.trainable_weights]
            grads = tf.compat.v1.gradients(loss, variables)
            self.update = tf.group(*[tf.compat.v1.assign_sub(v, self.learning_rate * g)
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

    def run(self, learning_rate=None):
        self.session.run(self.restore, dict(zip(self.values, self.saved)))
        feeds = {self.x: self.images}
        if learning_rate is not None:
            feeds[self.learning_rate] = np.float32(learning_rate)
        y, _ = self.session.run([self.y, self.update], feeds)
        return [y] + self.session.run(self.variables)


def images(side, batch=2, channels=4):
    return np.random.RandomState(0).rand(batch, side, side, channels).astype(np.float32)


def not_bit_exact_warnings(record):
    return [w for w in record if issubclass(w.category, amanda.NotBitExactWarning)]


def check_exact(step, tool_classes, what):
    """Rewrites off: under each tool, the output and every updated weight
    equal the plain step's bit for bit, with whole points and no
    NotBitExactWarning."""
    expected = step.run()
    assert_same(expected, step.run(), f"{what}, plain twice")   # the baseline repeats
    for tool_class in tool_classes:
        tool = tool_class()
        with pytest.warns() as record, amanda.apply(tool):
            actual = step.run()
        assert not not_bit_exact_warnings(record), \
            f"{what}: NotBitExactWarning with the float rewrites off"
        assert_same(expected, actual, f"{what} under {tool_class.__name__}")
        assert_whole_points(tool)


def check_ordered(step, learning_rate, what):
    """Grappler's defaults: under the counting tool, the output does not
    move when the update grows 1000-fold (the forward pass reads no weight
    the update wrote), the weights do, and amanda says that bits may
    differ from the plain step."""
    step.run(learning_rate)   # the plain step first: the tool instruments a traced function
    tool = Counting()
    with pytest.warns() as record, amanda.apply(tool):
        small = step.run(learning_rate)
        large = step.run(learning_rate * 1000)
    assert not_bit_exact_warnings(record), f"{what}: no NotBitExactWarning at the defaults"
    assert_same(small[:1], large[:1], f"{what} under Counting, learning rate x1000")
    assert not all(np.array_equal(a, b) for a, b in zip(small[1:], large[1:])), \
        f"{what}: the update did not change with the learning rate"
    assert tool.counts, "no routine ran"   # (whole points: check_exact; a fed op has no before-point)


_OFF = ("constant_folding", "arithmetic_optimization")


@contextlib.contextmanager
def float_rewrites(on):
    """Grappler's two float rewrites on (its defaults) or off, for the
    ``tf.function``s traced inside (a process-wide setting, restored)."""
    saved = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({option: on for option in _OFF})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options(
            {option: saved.get(option, True) for option in _OFF})


def test_small_step_tf_function():
    keras.utils.set_random_seed(0)
    model = small_model()
    with float_rewrites(False):
        check_exact(EagerStep(model, images(8)), TOOLS, "tf.function step")
    check_ordered(EagerStep(model, images(8)), 0.5, "tf.function step")


def test_small_step_session():
    keras.utils.set_random_seed(0)
    check_exact(SessionStep(small_model, images(8), exact=True), TOOLS, "Session step")
    check_ordered(SessionStep(small_model, images(8)), 0.5, "Session step")


# The Keras applications of tests/tensorflow/test_identity_sweep_tf.py:
# weights=None, 32x32 (the smallest side each accepts; Xception 71), batch 2.
# `make test` runs a fixed sample: MobileNetV2 in a tf.function (batch
# normalisation, where the arithmetic optimizer's rewrites show; the small
# model above stands for ConvNeXtTiny's blocks); `make sweep`
# (AMANDA_KERAS_SWEEP=1) runs all of them and ConvNeXtTiny's Session step:
# with both checks, ConvNeXtTiny alone takes minutes (1,628 s on 2026-11-29
# with the two cores shared five ways; MobileNetV2 1,060 s; both passed),
# which would take CI past its time. InceptionV3 (458 s alone, old checks)
# passed on 2026-11-29; run it with -k InceptionV3 after adding it here.
SAMPLE = {"MobileNetV2"}
_FULL = os.environ.get("AMANDA_KERAS_SWEEP") == "1"
_SWEEP_ONLY = pytest.mark.skipif(not _FULL, reason="the whole sweep: make sweep")
APPLICATIONS = [pytest.param(name, side, id=name, marks=() if name in SAMPLE else _SWEEP_ONLY)
                for name, side in [("MobileNetV2", 32), ("MobileNetV3Small", 32),
                                   ("ResNet50", 32), ("EfficientNetB0", 32),
                                   ("ConvNeXtTiny", 32), ("VGG16", 32), ("Xception", 71)]]


@pytest.fixture
def fresh_keras():
    yield
    keras.backend.clear_session()


def application(name, side):
    return lambda: getattr(keras.applications, name)(weights=None,
                                                     input_shape=(side, side, 3))


@pytest.mark.slow
@pytest.mark.parametrize("name,side", APPLICATIONS)
def test_keras_application_step_tf_function(name, side, fresh_keras):
    keras.utils.set_random_seed(0)
    model = application(name, side)()
    x = images(side, channels=3)
    with float_rewrites(False):
        check_exact(EagerStep(model, x, learning_rate=0.1), TOOLS, f"{name} tf.function step")
    check_ordered(EagerStep(model, x), 0.1, f"{name} tf.function step")


@pytest.mark.slow
@_SWEEP_ONLY
@pytest.mark.parametrize("name,side", [("ConvNeXtTiny", 32)], ids=["ConvNeXtTiny"])
def test_keras_application_step_session(name, side, fresh_keras):
    keras.utils.set_random_seed(0)
    x = images(side, channels=3)
    check_exact(SessionStep(application(name, side), x, learning_rate=0.1, exact=True), TOOLS,
                f"{name} Session step")
    check_ordered(SessionStep(application(name, side), x), 0.1, f"{name} Session step")


class ReorderedStep(EagerStep):
    """The defect the ordering check is for, written by hand: the output
    is read after the update."""

    def __init__(self, model, images, learning_rate=0.5):
        super().__init__(model, images, learning_rate)

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x, training=True) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return model(x, training=True)

        self.step = step


def test_the_ordering_check_fails_on_a_step_whose_output_reads_the_update():
    keras.utils.set_random_seed(0)
    with pytest.raises(AssertionError, match="learning rate x1000"):
        check_ordered(ReorderedStep(small_model(), images(8)), 0.5, "reordered step")
