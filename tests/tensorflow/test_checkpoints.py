"""Checkpoints written inside ``amanda.apply`` hold the user's variables, with
their trained values, and nothing of the instrumentation."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda.tools.identity import IdentityTool  # noqa: E402


class MatMulCounter(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op().type == "MatMul":
            context.insert_before_op(self.tick)

    def tick(self, *arrays):
        self.count += 1


def test_saver_inside_apply_saves_the_user_variables_only(keras_cnn_graph, tmp_path):
    model = keras_cnn_graph()
    with model.graph.as_default():
        train = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(
            model.loss, var_list=model.variables)
        saver = tf.compat.v1.train.Saver()
        user_variables = sorted(v.op.name for v in tf.compat.v1.global_variables())
    image = np.random.default_rng(0).random((2, 16, 16, 3), np.float32)
    tool = IdentityTool()
    with tf.compat.v1.Session(graph=model.graph) as session:
        session.run(model.init)
        initial = session.run(model.variables)
        with amanda.apply(tool):
            for _ in range(2):
                session.run(train, {model.x: image})
            with model.graph.as_default():
                path = saver.save(session, str(tmp_path / "model"))
        trained = session.run(model.variables)
    assert tool.calls["after_backward_op"] > 0
    names = [name for name, _ in tf.train.list_variables(path)]
    assert names == user_variables
    # the checkpoint holds the values trained in the instrumented session
    reader = tf.train.load_checkpoint(path)
    for variable, value, old in zip(model.variables, trained, initial):
        np.testing.assert_array_equal(reader.get_tensor(variable.op.name), value)
        assert not np.array_equal(value, old)


def test_keras_checkpoint_after_tf_function_training_inside_apply(tmp_path):
    layers = tf.keras.layers
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((8, 8, 3)), layers.Conv2D(4, 3, activation="relu"),
                                 layers.Flatten(), layers.Dense(3)])
    optimizer = tf.keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x)))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss

    plain_path = tf.train.Checkpoint(model=model).save(str(tmp_path / "plain"))
    image = tf.constant(np.random.default_rng(1).random((2, 8, 8, 3), np.float32))
    initial = [w.numpy() for w in model.weights]
    tool = MatMulCounter()
    with amanda.apply(tool):
        losses = [float(step(image)) for _ in range(3)]
        path = tf.train.Checkpoint(model=model).save(str(tmp_path / "inside"))
    assert tool.count == 3
    assert losses[0] > losses[2]
    names = [name for name, _ in tf.train.list_variables(path)]
    assert names == [name for name, _ in tf.train.list_variables(plain_path)]
    assert not any("amanda" in name for name in names)
    restored = tf.keras.models.clone_model(model)
    tf.train.Checkpoint(model=restored).read(path).expect_partial()
    for trained, loaded, old in zip(model.weights, restored.weights, initial):
        np.testing.assert_array_equal(loaded.numpy(), trained.numpy())
        assert not np.array_equal(trained.numpy(), old)
