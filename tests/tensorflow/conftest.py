"""Fixtures for the TensorFlow tests: real Keras models built in tf.compat.v1 graphs.

Keras 3 models are built and called on a placeholder inside ``graph.as_default()``;
nothing global (eager mode, control flow version) is switched, so other tests
are unaffected. Weights are random (``weights=None``): nothing is downloaded.
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

tf = pytest.importorskip("tensorflow")

def _graph_with_gradients(build_model, input_shape):
    """Builds ``build_model()`` in a fresh graph, called on a placeholder.

    Returns:
        ``(graph, x, loss, grads)``: the graph, the input placeholder, a scalar
        loss (sum of the outputs) and ``tf.compat.v1.gradients(loss,
        model.trainable_weights)``.
    """
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, input_shape, name="x")
        model = build_model()
        y = model(x)
        loss = tf.reduce_sum(y, name="loss")
        grads = tf.compat.v1.gradients(loss, model.trainable_weights)
    return graph, x, loss, grads


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


@pytest.fixture(scope="session")
def keras_resnet50_graph():
    """Keras ResNet50 (random weights) in a tf.compat.v1 graph.

    Returns:
        ``(graph, x, loss, grads)`` with ``grads = tf.compat.v1.gradients(loss,
        model.trainable_weights)``. Shared by the session: do not add ops to
        the graph (import its GraphDef into a new graph to mutate a copy).
    """
    return _graph_with_gradients(lambda: tf.keras.applications.ResNet50(weights=None), [1, 224, 224, 3])


@pytest.fixture
def keras_cnn_graph():
    """The small-CNN builder: ``keras_cnn_graph(batch=2)`` returns a fresh
    ``(graph, x, loss, grads)`` on each call (see `build_keras_cnn_graph`).

    A fixture rather than an importable function: tests/tensorflow must stay
    a plain directory (an ``__init__.py`` there would make it a package named
    ``tensorflow`` that shadows the real one under pytest's default import mode).
    """
    return build_keras_cnn_graph
