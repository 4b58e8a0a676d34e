"""FlopsProfiler on a TensorFlow graph: Keras ResNet50 against the PyTorch
(transformers) ResNet-50, convolution by convolution."""

from collections import Counter

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda.tools.flops import FlopsProfiler  # noqa: E402


def conv_flops(profiler):
    return Counter(r["flops"] for r in profiler.records.values() if r["type"] == "conv2d")


@pytest.mark.slow
def test_keras_resnet50_convs_match_pytorch_resnet50():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 224, 224, 3])
        model = tf.keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3))
        y = model(x)
        init = tf.compat.v1.variables_initializer([w.value for w in model.weights])
    keras = FlopsProfiler()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        with amanda.apply(keras):
            session.run(y, {x: np.zeros((1, 224, 224, 3), np.float32)})
            session.run(y, {x: np.zeros((1, 224, 224, 3), np.float32)})
    assert not keras.unknown
    assert all(r["calls"] == 2 for r in keras.records.values()
               if r["type"] in ("conv2d", "linear"))
    assert keras.by_type("forward")["linear"] == 2 * 2 * 2048 * 1000  # the classifier

    torch_model = transformers.ResNetModel(transformers.ResNetConfig()).eval()
    pytorch = FlopsProfiler()
    with torch.no_grad(), amanda.apply(pytorch):
        torch_model(torch.rand(1, 3, 224, 224))

    tf_convs, pt_convs = conv_flops(keras), conv_flops(pytorch)
    assert sum(tf_convs.values()) == sum(pt_convs.values()) == 53
    # Keras ResNet50 is ResNet v1 (stride 2 in the first 1x1 conv of stages
    # 3-5); transformers' is v1.5 (stride 2 in the 3x3 conv). Only those three
    # 1x1 convs differ: v1.5 runs them at the stage's input resolution.
    stages = [(256, 128, 56), (512, 256, 28), (1024, 512, 14)]  # Cin, width, input H=W
    v15 = Counter(2 * cin * w * h * h for cin, w, h in stages)
    v1 = Counter(2 * cin * w * (h // 2) ** 2 for cin, w, h in stages)
    assert pt_convs - tf_convs == v15
    assert tf_convs - pt_convs == v1
    # the 50 others, the 7x7 stem included, agree exactly
    assert keras.by_type("forward")["conv2d"] // 2 - sum(v1.elements()) \
        == pytorch.by_type("forward")["conv2d"] - sum(v15.elements())


def test_keras_cnn_backward_conv_flops(keras_cnn_graph):
    model = keras_cnn_graph()
    profiler = FlopsProfiler()
    with tf.compat.v1.Session(graph=model.graph) as session:
        session.run(model.init)
        with amanda.apply(profiler):
            session.run(model.grads, {model.x: np.zeros(model.x.shape, np.float32)})
    first, second = 2 * 2 * 14 * 14 * 8 * (3 * 3 * 3), 2 * 2 * 12 * 12 * 8 * (3 * 3 * 8)
    assert profiler.by_type("forward")["conv2d"] == first + second
    # 1x forward per Conv2DBackprop* op that runs: filter gradients of both
    # convolutions and the input gradient of the second (the first one's input
    # gradient is not needed for weight gradients, so it does not run)
    assert profiler.by_type("backward")["conv2d"] == first + 2 * second
