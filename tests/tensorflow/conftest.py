"""Fixtures for the TensorFlow tests: real Keras models built in tf.compat.v1 graphs.

Keras 3 models are built and called on a placeholder inside ``graph.as_default()``;
nothing global (eager mode, control flow version) is switched, so other tests
are unaffected. Weights are random (``weights=None``): nothing is downloaded.
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# oneDNN's CPU kernels (on by default) compute the first ResNet50 block's
# backward ops in a different order when routines sit between them (last-bit
# differences, about 5e-8 relative); TensorFlow's own kernels do not, so the
# bit-exactness tests run without oneDNN. Must be set before TF is imported.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# TensorFlow sizes its CPU thread pools once per process, from the first
# session or the eager context, and ignores later sessions' thread counts
# unless each device owns its pool: without this the single-threaded configs
# of the bit-exact tests (`test_generated_tf._config`) ran on two intra-op
# and two inter-op threads, where an `AddN`'s summation order may change from
# run to run (docs/tensorflow.md, Bit-exactness). Before TF is imported too.
os.environ.setdefault("TF_OVERRIDE_GLOBAL_THREADPOOL", "1")

tf = pytest.importorskip("tensorflow")


class KerasGraph(tuple):
    """``(graph, x, loss, grads)``, with more as attributes.

    Attributes:
        y: the model's output tensor.
        init: the op initialising the model's variables (fixed seeds: every
            session starts from the same weights).
        model: the Keras model.
        variables: the ``tf.Variable`` objects behind ``model.trainable_weights``
            (fetchable, unlike Keras variables), in the order of ``grads``.
    """

    def __new__(cls, graph, x, loss, grads, **attrs):
        self = super().__new__(cls, (graph, x, loss, grads))
        self.__dict__.update(attrs)
        return self

    @property
    def graph(self):
        return self[0]

    @property
    def x(self):
        return self[1]

    @property
    def loss(self):
        return self[2]

    @property
    def grads(self):
        return self[3]


def _graph_with_gradients(build_model, input_shape, loss_fn=None):
    """Builds ``build_model()`` in a fresh graph, called on a placeholder.

    Returns:
        A `KerasGraph`: the graph, the input placeholder, a scalar loss (sum
        of the outputs, or ``loss_fn(y)``) and ``tf.compat.v1.gradients(loss,
        model.trainable_weights)``, plus ``y``, ``init``, ``model`` and
        ``variables``.
    """
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, input_shape, name="x")
        model = build_model()
        y = model(x)
        loss = tf.reduce_sum(y if loss_fn is None else loss_fn(y), name="loss")
        grads = tf.compat.v1.gradients(loss, model.trainable_weights)
        variables = [w.value for w in model.trainable_weights]
        init = tf.compat.v1.variables_initializer([w.value for w in model.weights], name="init")
    return KerasGraph(graph, x, loss, grads, y=y, init=init, model=model, variables=variables)


def build_keras_cnn_graph(batch=2):
    """A small Keras CNN in a tf.compat.v1 graph, with its weight gradients.

    Conv2D(8, 3) + ReLU, Conv2D(8, 3), Flatten, Dense(10) on 16x16x3 inputs.

    Returns:
        ``(graph, x, loss, grads)`` as in `keras_resnet50_graph`.
    """

    def build():
        layers = tf.keras.layers
        return tf.keras.Sequential(
            [
                tf.keras.Input((16, 16, 3)),
                layers.Conv2D(8, 3, activation="relu"),
                layers.Conv2D(8, 3),
                layers.Flatten(),
                layers.Dense(10),
            ]
        )

    return _graph_with_gradients(build, [batch, 16, 16, 3])


def build_keras_transformer_graph(batch=2, length=6, width=16):
    """A Keras transformer encoder block in a tf.compat.v1 graph.

    MultiHeadAttention (2 heads) + residual + LayerNormalization, then a
    Dense(2 * width, relu) -> Dense(width) feed-forward + residual +
    LayerNormalization; the loss is the sum of the squared outputs.

    Returns:
        A `KerasGraph`.
    """

    def build():
        layers = tf.keras.layers
        inputs = tf.keras.Input((length, width))
        attended = layers.MultiHeadAttention(num_heads=2, key_dim=width // 2)(inputs, inputs)
        hidden = layers.LayerNormalization()(inputs + attended)
        forward = layers.Dense(2 * width, activation="relu")(hidden)
        forward = layers.Dense(width)(forward)
        return tf.keras.Model(inputs, layers.LayerNormalization()(hidden + forward))

    return _graph_with_gradients(build, [batch, length, width], loss_fn=tf.square)


@pytest.fixture(scope="session")
def keras_resnet50_graph():
    """Keras ResNet50 (random weights) in a tf.compat.v1 graph, on one 64x64
    image (small enough to run fast; still 53 convolutions).

    Returns:
        A `KerasGraph` ``(graph, x, loss, grads)`` with ``grads =
        tf.compat.v1.gradients(loss, model.trainable_weights)``. Shared by the
        session: do not add ops to the graph (import its GraphDef into a new
        graph to mutate a copy); amanda's runtime never adds any.
    """
    return _graph_with_gradients(
        lambda: tf.keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3)),
        [1, 64, 64, 3])


@pytest.fixture
def keras_cnn_graph():
    """The small-CNN builder: ``keras_cnn_graph(batch=2)`` returns a fresh
    ``(graph, x, loss, grads)`` on each call (see `build_keras_cnn_graph`).

    A fixture rather than an importable function: tests/tensorflow must stay
    a plain directory (an ``__init__.py`` there would make it a package named
    ``tensorflow`` that shadows the real one under pytest's default import mode).
    """
    return build_keras_cnn_graph


@pytest.fixture
def keras_transformer_graph():
    """The transformer-block builder (see `build_keras_transformer_graph`)."""
    return build_keras_transformer_graph
