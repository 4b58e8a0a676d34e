"""Tile-wise pruning (paper Tbl. 4, TF session hooks in the original) applied
unchanged to Keras applications in TF graph mode: every convolution gets a
tile-wise mask, and the pruned run equals a vanilla run of the same graph
whose kernels were multiplied by those masks (by difference)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda.tools.pruning_projects.tile_wise import TileWisePruner  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("name, convs", [("VGG16", 13), ("VGG19", 16)])
def test_tile_wise_prunes_every_conv_of_a_keras_vgg(name, convs):
    graph = tf.Graph()
    with graph.as_default():
        model = getattr(tf.keras.applications, name)(
            weights=None, include_top=False, input_shape=(32, 32, 3), pooling="avg")
        images = tf.compat.v1.placeholder(tf.float32, [2, 32, 32, 3])
        features = model(images)
        init = tf.compat.v1.global_variables_initializer()
        kernels = [w.value for w in model.trainable_weights if len(w.shape) == 4]
        values = [tf.compat.v1.placeholder(k.dtype, k.shape) for k in kernels]
        load = [k.assign(v) for k, v in zip(kernels, values)]
    session = tf.compat.v1.Session(graph=graph)
    session.run(init)
    data = np.random.default_rng(0).random((2, 32, 32, 3), np.float32)

    dense = session.run(kernels)
    vanilla = session.run(features, {images: data})

    tool = TileWisePruner(0.5, tile=16)
    with amanda.apply(tool):
        pruned = session.run(features, {images: data})
    layers = list(tool.layers.values())
    assert len(layers) == convs
    assert all(np.array_equal(a, b) for a, b in zip(session.run(kernels), dense))
    assert [layer.shape for layer in layers] == [k.shape for k in dense]
    for layer in layers:
        matrix = layer.mask.reshape(-1, layer.shape[-1])   # (K, N): HWIO kernels
        for start in range(0, matrix.shape[1], 16):
            tile = matrix[:, start:start + 16]
            assert (tile == tile[:, :1]).all()                 # whole rows per tile
            assert (tile[:, 0] == 0).sum() == round(0.5 * matrix.shape[0])

    assert not np.allclose(pruned, vanilla)
    # masking the kernels by hand gives the pruned run
    session.run(load, dict(zip(values, [k * layer.mask for k, layer in zip(dense, layers)])))
    expected = session.run(features, {images: data})
    np.testing.assert_allclose(pruned, expected, rtol=1e-4, atol=1e-6)
