"""TF2 training as users write it, inside `amanda.apply`: Keras `fit` /
`evaluate` / `predict` and custom `tf.function` steps whose optimizer makes
its variables on the first call. By difference with the same code outside
`apply`: losses, metrics, predictions and weights equal, points seen.

Found broken by this test: the instrumented copy of a concrete function
kept only the ops its outputs depend on, so TensorFlow's own
variable-initialising function (no outputs, only assigns) initialised
nothing, and Adam's or RMSprop's slots, made on the first step, failed the
run ("Cannot update variable with shape [0]")."""

import gc
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import amanda  # noqa: E402


@pytest.fixture(autouse=True)
def _forget_keras_models():
    yield
    keras.backend.clear_session()   # Keras keeps every model's functions alive
    gc.collect()


class Observe(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        context.insert_before_op(self.observe)
        context.insert_after_op(self.observe)

    def observe(self, *arrays):
        self.calls += 1


def _data():
    rng = np.random.default_rng(0)
    return (rng.random((48, 8), dtype=np.float32), rng.random((48, 1), dtype=np.float32))


def _model(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((8,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer, "mse", metrics=["mae"])
    return model


def _close(a, b):
    # routines between ops keep Grappler from fusing some float expressions
    # (amanda.NotBitExactWarning): the last bits may differ
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rmsprop"])
def test_keras_fit_evaluate_predict_inside_apply_equal_plain(optimizer):
    x, y = _data()

    def run(tool):
        model = _model(optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", amanda.NotBitExactWarning)
            with amanda.apply(tool) if tool is not None else warnings.catch_warnings():
                history = model.fit(x, y, epochs=2, batch_size=16, verbose=0,
                                    validation_split=0.25)
                evaluated = model.evaluate(x, y, verbose=0)
                predicted = model.predict(x, verbose=0)
        return history.history, evaluated, predicted, model.get_weights()

    plain = run(None)
    tool = Observe()
    got = run(tool)
    assert tool.calls > 0
    assert got[0].keys() == plain[0].keys()
    for key in plain[0]:
        _close(got[0][key], plain[0][key])
    _close(got[1], plain[1])
    _close(got[2], plain[2])
    for a, b in zip(got[3], plain[3]):
        _close(a, b)


def test_a_step_whose_optimizer_makes_its_variables_on_the_first_call():
    x, y = _data()

    def run(tool):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.Adam(0.01)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", amanda.NotBitExactWarning)
            with amanda.apply(tool) if tool is not None else warnings.catch_warnings():
                losses = [float(step(x, y)) for _ in range(3)]
        return losses, model.get_weights()

    plain = run(None)
    tool = Observe()
    got = run(tool)
    assert tool.calls > 0
    _close(got[0], plain[0])
    for a, b in zip(got[1], plain[1]):
        _close(a, b)


def test_a_function_with_side_effects_and_no_output():
    def run(tool):
        counter = tf.Variable(np.zeros(3, np.float32))

        @tf.function
        def accumulate(value):
            counter.assign_add(value * 2.0)     # no output depends on it

        with amanda.apply(tool) if tool is not None else warnings.catch_warnings():
            for i in range(3):
                accumulate(tf.constant(np.full(3, i + 1, np.float32)))
        return counter.numpy()

    tool = Observe()
    np.testing.assert_array_equal(run(tool), run(None))
    assert tool.calls > 0


def test_keras_lstm_fit_inside_apply_equals_plain():
    """A recurrent layer's training step: a while loop writing a TensorList
    whose element shape is an integer constant TensorFlow reads when it
    builds the graph (before, a routine's result in its place failed the
    import: "Received a shape scalar with unknown static value")."""
    rng = np.random.default_rng(0)
    x = rng.random((8, 5, 3), dtype=np.float32)
    y = rng.random((8, 1), dtype=np.float32)

    def run(tool):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.layers.Input((5, 3)), keras.layers.LSTM(4),
                                  keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", amanda.NotBitExactWarning)
            with amanda.apply(tool) if tool is not None else warnings.catch_warnings():
                history = model.fit(x, y, epochs=2, batch_size=4, verbose=0)
        return history.history["loss"], model.get_weights()

    plain = run(None)
    tool = Observe()
    got = run(tool)
    assert tool.calls > 0
    _close(got[0], plain[0])
    for a, b in zip(got[1], plain[1]):
        _close(a, b)


def _tensor_array_function():
    weight = tf.Variable(np.ones(3, np.float32))

    @tf.function
    def forward(x):
        written = tf.TensorArray(tf.float32, size=4)
        for i in tf.range(4):
            written = written.write(i, x * weight * tf.cast(i, tf.float32))
        return tf.reduce_sum(written.stack())

    @tf.function
    def gradient(x):
        with tf.GradientTape() as tape:
            y = forward(x)
        return tape.gradient(y, weight)

    return forward, gradient


def test_routines_on_integer_constants_see_them_and_keep_them():
    x = tf.constant(np.arange(3, dtype=np.float32))
    forward, gradient = _tensor_array_function()
    expected = forward(x).numpy(), gradient(x).numpy()
    seen = []

    class Constants(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analysis)

        def analysis(self, context):
            context.insert_before_op(self.look)
            context.insert_after_op(self.look)

        def look(self, *arrays):
            seen.extend(a for a in arrays if a is not None and a.dtype.kind == "i")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amanda.NotBitExactWarning)
        with amanda.apply(Constants()):
            got = forward(x).numpy(), gradient(x).numpy()
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    assert any(a.shape == () and a == -1 for a in seen)   # the element shape was seen


def test_replacing_an_integer_constant_is_refused_when_the_op_runs():
    x = tf.constant(np.arange(3, dtype=np.float32))
    forward, _ = _tensor_array_function()
    forward(x)

    class Replace(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analysis)

        def analysis(self, context):
            if context.get_op().type == "TensorListReserve":
                context.insert_before_op(self.other_size, inputs=[1])

        @amanda.portable.hosted      # a Python callback (else inferred portable: TF ops)
        def other_size(self, size):
            return (size + 1,)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amanda.NotBitExactWarning)
        with pytest.raises(amanda.ToolError, match="integer constant") as raised:
            with amanda.apply(Replace()):
                forward(x)
    assert "other_size" in str(raised.value) and "TensorListReserve" in str(raised.value)
