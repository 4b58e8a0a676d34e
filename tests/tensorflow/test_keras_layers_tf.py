"""A sweep of TF2 code as users write it, inside `amanda.apply`, by difference.

Each case is a small program: a Keras model of one layer kind trained two
steps (`fit`), then `evaluate` and `predict`; or a plain `tf.function` using
one TF2 feature (while loop, cond, switch_case, TensorArray, map_fn,
vectorized_map, tf.data, py_function, ragged and string tensors, nested
functions, reduce_retracing, jit_compile). Every case runs

- plainly (outside `apply`),
- inside `apply` with an observing tool (routines before and after every op
  that return None, counting calls), twice in two scopes and once with
  `amanda.cache_disabled()` (the counts must agree),
- inside `apply` with `IdentityTool` (routines that return their arrays,
  also on backward ops),
- plainly again (no state left behind).

The results (losses, metrics, predictions, weights, function outputs) must
equal plain bit for bit: oneDNN is off for this directory (conftest.py) and
Grappler's two float-rewriting passes are off for the test (the settings
docs/tensorflow.md prescribes for bit-exact comparisons), and no
NotInstrumentedWarning may be raised.

Found broken by this sweep: a GradientTape in a function that another
function calls (Keras 3 fit's step) had no backward ops (its ops were
forward ops); once they were, a Keras RNN's step body failed to rebuild
(a backward routine before the forward routine it reads) and ran without
points; `tf.function(jit_compile=True)` ran without XLA, silently, with
other results.
"""

import gc
import os
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import amanda  # noqa: E402
from amanda.tools.identity import IdentityTool  # noqa: E402

layers = keras.layers
# a body amanda cannot rebuild runs as it is with a NotInstrumentedWarning
# (its points dropped): none of these programs may need that. (The documented
# ones stay warnings: Keras' eager input casts, tf.data's bodies, bodies XLA
# compiles.)
pytestmark = pytest.mark.filterwarnings(
    r"error:amanda \(TensorFlow\). the ops of function:amanda.NotInstrumentedWarning")
_OFF = ("constant_folding", "arithmetic_optimization")


@pytest.fixture(autouse=True)
def _bit_exact_settings():
    saved = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({option: False for option in _OFF})
    yield
    tf.config.optimizer.set_experimental_options(
        {option: saved.get(option, True) for option in _OFF})
    # Keras keeps every model's functions and graphs in its global state: the
    # whole test process ran out of memory (24 GiB) with the sweep's models
    # kept alive next to the TF suite's others
    keras.backend.clear_session()
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


# --- Keras models -------------------------------------------------------------

def _rng():
    return np.random.default_rng(0)


def _floats(*shape):
    return _rng().random(shape, dtype=np.float32)


def _sequential(input_shape, *body, out=1):
    return keras.Sequential([layers.Input(input_shape), *body, layers.Flatten(),
                             layers.Dense(out)])


KERAS = {
    "conv1d": lambda: (_sequential((6, 3), layers.Conv1D(4, 3, activation="relu")),
                       _floats(8, 6, 3)),
    "conv2d_maxpool": lambda: (_sequential((6, 6, 2), layers.Conv2D(3, 3, padding="same"),
                                           layers.MaxPooling2D()), _floats(8, 6, 6, 2)),
    "conv3d": lambda: (_sequential((4, 4, 4, 1), layers.Conv3D(2, 2)), _floats(8, 4, 4, 4, 1)),
    "depthwise_conv2d": lambda: (_sequential((5, 5, 2), layers.DepthwiseConv2D(3)),
                                 _floats(8, 5, 5, 2)),
    "separable_conv2d": lambda: (_sequential((5, 5, 2), layers.SeparableConv2D(3, 3)),
                                 _floats(8, 5, 5, 2)),
    "conv2d_transpose_upsampling": lambda: (
        _sequential((3, 3, 2), layers.Conv2DTranspose(2, 2, strides=2), layers.UpSampling2D()),
        _floats(8, 3, 3, 2)),
    "batch_normalization": lambda: (_sequential((4, 4, 2), layers.Conv2D(3, 2),
                                                layers.BatchNormalization()), _floats(8, 4, 4, 2)),
    "layer_normalization": lambda: (_sequential((6,), layers.Dense(4),
                                                layers.LayerNormalization()), _floats(8, 6)),
    "group_normalization": lambda: (_sequential((4, 4), layers.Dense(4),
                                                layers.GroupNormalization(groups=2)),
                                    _floats(8, 4, 4)),
    "dropout": lambda: (_sequential((6,), layers.Dense(4), layers.Dropout(0.0)), _floats(8, 6)),
    "embedding": lambda: (_sequential((5,), layers.Embedding(10, 3)),
                          _rng().integers(0, 10, (8, 5)).astype(np.int32)),
    "gru": lambda: (_sequential((5, 3), layers.GRU(4)), _floats(8, 5, 3)),
    "simple_rnn": lambda: (_sequential((5, 3), layers.SimpleRNN(4)), _floats(8, 5, 3)),
    "bidirectional_lstm": lambda: (_sequential((5, 3), layers.Bidirectional(layers.LSTM(3))),
                                   _floats(8, 5, 3)),
    "time_distributed": lambda: (_sequential((5, 3), layers.TimeDistributed(layers.Dense(2))),
                                 _floats(8, 5, 3)),
    "multi_head_attention": lambda: (_attention_model(True), _floats(8, 5, 4)),
    "attention_pooling": lambda: (_attention_model(False), _floats(8, 5, 4)),
    "reshape_permute": lambda: (_sequential((6, 2), layers.Reshape((3, 4)), layers.Permute((2, 1)),
                                            layers.Dense(2)), _floats(8, 6, 2)),
    "two_inputs_concatenate_add": lambda: (_two_inputs(), [_floats(8, 4), _floats(8, 3)]),
    "masking_embedding_lstm": lambda: (_masked(), _padded()),
    "custom_train_step": lambda: (CustomStep(), _floats(8, 6)),
}


def _attention_model(multi_head):
    inputs = layers.Input((5, 4))
    if multi_head:
        attended = layers.MultiHeadAttention(num_heads=2, key_dim=2)(inputs, inputs)
    else:
        attended = layers.Attention()([inputs, inputs])
    pooled = layers.GlobalAveragePooling1D()(attended)
    return keras.Model(inputs, layers.Dense(1)(pooled))


def _two_inputs():
    a, b = layers.Input((4,)), layers.Input((3,))
    left, right = layers.Dense(3)(a), layers.Dense(3)(b)
    joined = layers.Concatenate()([left, right, layers.Add()([left, right])])
    return keras.Model([a, b], layers.Dense(1)(joined))


def _masked():
    return keras.Sequential([layers.Input((5,), dtype="int32"),
                             layers.Embedding(10, 3, mask_zero=True), layers.LSTM(3),
                             layers.Dense(1)])


def _padded():
    tokens = _rng().integers(1, 10, (8, 5)).astype(np.int32)
    for row, length in enumerate([5, 3, 1, 4, 2, 5, 3, 2]):
        tokens[row, length:] = 0
    return tokens


class CustomStep(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = layers.Dense(4, activation="relu")
        self.out = layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def _keras_run(name):
    keras.utils.set_random_seed(0)
    model, x = KERAS[name]()
    y = _floats(8, 1)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    history = model.fit(x, y, epochs=1, batch_size=4, verbose=0, shuffle=False)
    evaluated = model.evaluate(x, y, verbose=0, batch_size=4)
    predicted = model.predict(x, verbose=0, batch_size=4)
    return [*history.history["loss"], evaluated, predicted, *model.get_weights()]


# --- plain tf.function programs ----------------------------------------------

def _while_loop():
    @tf.function
    def f(x):
        return tf.while_loop(lambda i, s: i < 4, lambda i, s: (i + 1, s * 1.5 + x),
                             (tf.constant(0), tf.zeros_like(x)))[1]
    return lambda: f(tf.constant([1.0, 2.0]))


def _cond():
    @tf.function
    def f(x):
        return tf.cond(tf.reduce_sum(x) > 0, lambda: x * 2.0, lambda: x - 1.0)
    return lambda: [f(tf.constant([1.0, 2.0])), f(tf.constant([-3.0, 1.0]))]


def _switch_case():
    @tf.function
    def f(i, x):
        return tf.switch_case(i, [lambda: x + 1.0, lambda: x * 3.0, lambda: -x])
    return lambda: [f(tf.constant(k), tf.constant([1.0, 2.0])) for k in range(3)]


def _tensor_array():
    @tf.function
    def f(x):
        out = tf.TensorArray(tf.float32, size=0, dynamic_size=True)
        for i in tf.range(3):
            out = out.write(i, x * tf.cast(i, tf.float32))
        return out.stack(), out.gather([0, 2])
    return lambda: f(tf.constant([1.0, 2.0]))


def _map_fn():
    @tf.function
    def f(x):
        return tf.map_fn(lambda row: tf.reduce_sum(row) * row, x)
    return lambda: f(tf.constant(_floats(3, 2)))


def _vectorized_map():
    @tf.function
    def f(x):
        return tf.vectorized_map(lambda row: tf.tensordot(row, row, 1) + row, x)
    return lambda: f(tf.constant(_floats(3, 2)))


def _data_inside():
    @tf.function
    def f(x):
        dataset = tf.data.Dataset.from_tensor_slices(x).map(lambda v: v * 2.0)
        return dataset.reduce(tf.constant(0.0), lambda s, v: s + v)
    return lambda: f(tf.constant([1.0, 2.0, 3.0]))


def _py_function():
    @tf.function
    def f(x):
        y = tf.py_function(lambda v: v.numpy() * 2.0 + 1.0, [x], tf.float32)
        return y * x
    return lambda: f(tf.constant([1.0, 2.0]))


def _ragged():
    @tf.function
    def f(values, lengths):
        ragged = tf.RaggedTensor.from_row_lengths(values, lengths)
        return ragged.to_tensor(), tf.reduce_sum(ragged * 2.0, axis=1)
    return lambda: f(tf.constant([1.0, 2.0, 3.0, 4.0]), tf.constant([1, 3], tf.int64))


def _strings():
    @tf.function
    def f(words):
        joined = tf.strings.join([tf.strings.upper(words), words], separator="-")
        return joined, tf.strings.length(joined), tf.strings.to_number(tf.constant(["1.5"]))
    return lambda: f(tf.constant(["ab", "cde"]))


def _nested():
    @tf.function
    def inner(x):
        return tf.nn.relu(x) * 2.0

    @tf.function
    def outer(x):
        return inner(x) + inner(-x)
    return lambda: outer(tf.constant([1.0, -2.0]))


def _reduce_retracing():
    @tf.function(reduce_retracing=True)
    def f(x):
        return tf.reduce_sum(x * x, axis=0)
    return lambda: [f(tf.constant(_floats(n, 2))) for n in (2, 3, 4)]


def _nested_gradient_tape():
    weight = tf.Variable([0.5, -1.0])

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(tf.tanh(x * weight))
        return y, tape.gradient(y, weight)

    @tf.function
    def outer(x):          # as Keras fit calls its step
        return step(x)
    return lambda: outer(tf.constant([1.0, 2.0]))


def _gradient_of_function():
    weight = tf.Variable([0.5, -1.0])

    @tf.function
    def f(x):
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(tf.tanh(x * weight))
        return y, tape.gradient(y, weight)
    return lambda: f(tf.constant([1.0, 2.0]))


FUNCTIONS = {
    "while_loop": _while_loop, "cond": _cond, "switch_case": _switch_case,
    "tensor_array": _tensor_array, "map_fn": _map_fn, "vectorized_map": _vectorized_map,
    "tf_data_inside": _data_inside, "py_function": _py_function, "ragged": _ragged,
    "strings": _strings, "nested_functions": _nested, "reduce_retracing": _reduce_retracing,
    "gradient_tape_inside": _gradient_of_function,
    "gradient_tape_in_a_called_function": _nested_gradient_tape,
}
BACKWARD = {"gradient_tape_inside", "gradient_tape_in_a_called_function"}


def _arrays(result):
    flat = tf.nest.flatten(result)
    return [np.asarray(v.numpy() if hasattr(v, "numpy") else v) for v in flat]


# --- the comparison ----------------------------------------------------------

def _equal(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _sweep(run):
    """``run()`` -> list of arrays; called plainly and inside the scopes."""
    plain = run()
    counts = []
    for disabled in (False, False, True):
        tool = Observe()
        with amanda.apply(tool), (amanda.cache_disabled() if disabled
                                  else warnings.catch_warnings()):
            got = run()
        _equal(got, plain)
        counts.append(tool.calls)
    assert counts[0] > 0
    assert counts[0] == counts[1] == counts[2], counts
    identity = IdentityTool()
    with amanda.apply(identity):
        got = run()
    _equal(got, plain)
    assert identity.calls["before_op"] > 0 and identity.calls["after_op"] > 0
    _equal(run(), plain)            # nothing left behind
    return counts, identity


# two quick models stay in the fast suite, a few more in the slow one (CI);
# the rest (10-60 s and hundreds of MiB each) run with AMANDA_KERAS_SWEEP=1
FAST = {"dropout", "attention_pooling"}
SLOW = {"gru", "masking_embedding_lstm"}
_ALL = os.environ.get("AMANDA_KERAS_SWEEP") == "1"
_EXTENDED = pytest.mark.skipif(not _ALL, reason="extended Keras sweep: AMANDA_KERAS_SWEEP=1")


@pytest.mark.parametrize("name", [name if name in FAST else
                                  pytest.param(name, marks=[pytest.mark.slow] + (
                                      [] if name in SLOW else [_EXTENDED]))
                                  for name in KERAS])
def test_keras_layer_fit_evaluate_predict(name):
    _, identity = _sweep(lambda: _keras_run(name))
    assert identity.calls["before_backward_op"] > 0


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_tf_function_program(name):
    call = FUNCTIONS[name]()
    _, identity = _sweep(lambda: _arrays(call()))
    if name in BACKWARD:
        # a tape's ops are backward ops also in a body another function calls
        # (they were forward ops there: Keras fit had no backward points)
        assert identity.calls["before_backward_op"] > 0


def test_a_function_xla_compiles_runs_as_it_is_and_amanda_says_so():
    """`jit_compile=True`: no Python routine can run inside XLA, and running
    the ops one by one instead changed results (XLA's tanh/exp differ from
    TF's kernels in the last bits) silently."""
    @tf.function(jit_compile=True)
    def f(x):
        return tf.tanh(x) * tf.exp(x) + tf.math.log1p(x * x)

    x = tf.constant(np.random.default_rng(0).standard_normal(4096).astype(np.float32))
    plain = f(x).numpy()
    tool = Observe()
    with pytest.warns(amanda.NotInstrumentedWarning, match="XLA") as caught:
        with amanda.apply(tool):
            got = f(x).numpy()
            f(x)
    np.testing.assert_array_equal(got, plain)
    assert tool.calls == 0
    assert sum(issubclass(w.category, amanda.NotInstrumentedWarning) for w in caught) == 1
    assert caught[0].filename == __file__           # the user's line
