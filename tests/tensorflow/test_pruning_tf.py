"""Pruner in TensorFlow graph mode: a Keras CNN trained by a tf.compat.v1
optimizer inside amanda.apply keeps its pruned kernel entries where they were,
with zero gradients, and computes with the pruned kernels."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda.tools import mapping_rules  # noqa: E402
from amanda.tools.mapping import MappingTool  # noqa: E402
from amanda.tools.pruning import Pruner, magnitude_mask  # noqa: E402


class KernelProbe(amanda.Tool):
    """Records the kernel each pruned op receives (its routine runs after
    the pruner's when applied after it)."""

    def __init__(self):
        super().__init__()
        self.depends_on(MappingTool(rules=mapping_rules.RULES))
        self.seen = []
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        if context.get("weight_input") is not None:
            context.insert_before_op(self.look, inputs=[context["weight_input"]],
                                     op_id=context.get_op_id())

    def look(self, kernel, op_id):
        self.seen.append((op_id, np.array(kernel)))


@pytest.fixture
def training(keras_cnn_graph):
    """(model, training op, session, kernels, image): the Keras CNN with a
    plain gradient-descent training op on a squared loss."""
    model = keras_cnn_graph()
    with model.graph.as_default():
        loss = tf.reduce_mean(tf.square(model.y - 1.0))
        grads = tf.compat.v1.gradients(loss, model.variables)
        train = tf.compat.v1.train.GradientDescentOptimizer(0.05).apply_gradients(
            zip(grads, model.variables))
    session = tf.compat.v1.Session(graph=model.graph)
    session.run(model.init)
    kernels = [model.variables[0], model.variables[2], model.variables[4]]
    image = np.random.default_rng(0).random((2, 16, 16, 3), np.float32)
    model.train_loss, model.train_grads = loss, [grads[0], grads[2], grads[4]]
    yield model, train, session, kernels, image
    session.close()


@pytest.mark.parametrize("pattern, sparsity", [("unstructured", 0.5), ("unstructured", 0.9),
                                               ("2:4", None), ("channel", 0.5)])
def test_training_keeps_pruned_kernels_fixed_and_zero(training, pattern, sparsity):
    model, train, session, kernels, image = training
    before = session.run(kernels)
    pruner, probe = Pruner(pattern, sparsity=sparsity or 0.5), KernelProbe()
    with amanda.apply(pruner, probe):
        for _ in range(3):
            *grads, loss, _ = session.run(model.train_grads + [model.train_loss, train],
                                          {model.x: image})
    after = session.run(kernels)   # handed back to the user session
    layers = list(pruner.layers.values())
    # Conv2D(8, 3) on 3 input channels cannot be 2:4 along them: skipped
    first = 1 if pattern == "2:4" else 0
    assert [layer.type for layer in layers] == ["conv2d", "conv2d", "linear"][first:]
    for layer, old, new, grad in zip(layers, before[first:], after[first:], grads[first:]):
        mask = layer.mask
        assert mask.shape == old.shape == layer.shape
        np.testing.assert_array_equal(new[mask == 0], old[mask == 0])
        assert (new[mask == 1] != old[mask == 1]).any()
        assert (grad[mask == 0] == 0).all() and (grad[mask == 1] != 0).any()
        if pattern == "2:4":   # HWIO / (in, out): groups of 4 along the input axis
            axis = 2 if layer.type == "conv2d" else 0
            groups = np.moveaxis(mask, axis, -1)
            assert (groups.reshape(groups.shape[:-1] + (-1, 4)).sum(-1) == 2).all()
        elif pattern == "channel":
            channels = np.moveaxis(mask, -1, 0).reshape(mask.shape[-1], -1)
            assert ((channels == 0).all(1) | (channels == 1).all(1)).all()
            assert int((channels[:, 0] == 0).sum()) == mask.shape[-1] // 2
        else:
            assert layer.sparsity == pytest.approx(sparsity, abs=0.5 / mask.size)
    if first:
        assert "divisible by 4" in pruner.report()["skipped"][0]["reason"]
    # every step, the convolutions and the dense layer read pruned kernels
    masks = {layer.op_id: layer.mask for layer in layers}
    seen = [(op_id, k) for op_id, k in probe.seen if op_id in masks]
    assert len(seen) == 3 * len(layers)
    assert all((k[masks[op_id] == 0] == 0).all() for op_id, k in seen)


def test_pruned_graph_computes_with_masked_kernels(training):
    model, _, session, kernels, image = training
    pruner = Pruner("unstructured", sparsity=0.5)
    with amanda.apply(pruner):
        pruned = session.run(model.y, {model.x: image})
    dense = session.run(model.y, {model.x: image})
    assert not np.allclose(pruned, dense, atol=1e-4)
    masks = [layer.mask for layer in pruner.layers.values()]
    values = session.run(kernels)
    for kernel, value, mask in zip(kernels, values, masks):
        session.run(kernel.initializer, {kernel.initializer.inputs[1]: value * mask})
    np.testing.assert_allclose(session.run(model.y, {model.x: image}), pruned,
                               rtol=1e-5, atol=1e-5)


def test_dynamic_masks_are_recomputed_every_k_runs(training):
    model, train, session, kernels, image = training
    pruner = Pruner("unstructured", sparsity=0.5, update_every=2, mask_grads=False)
    seen = []
    for _ in range(5):   # one apply scope per step: the analysis and the masks are kept
        seen.append(session.run(kernels[2]))   # the dense kernel the next run reads
        with amanda.apply(pruner):
            session.run(train, {model.x: image})
    dense = [layer for layer in pruner.layers.values() if layer.type == "linear"][0]
    assert dense.updates == 3 and dense.calls == 5     # at runs 0, 2 and 4
    np.testing.assert_array_equal(dense.mask, magnitude_mask(seen[4], 0.5))
    assert not np.array_equal(dense.mask, magnitude_mask(seen[0], 0.5))
