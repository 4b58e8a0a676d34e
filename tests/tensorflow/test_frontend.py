"""TensorFlow frontend: tf.Graph / GraphDef / concrete functions lifted into the IR,
gradient ops mapped to the forward ops they differentiate."""

import json
from collections import Counter

import pytest

tf = pytest.importorskip("tensorflow")

from amanda.frontends.tensorflow import default_namespace, forward_op_of, lift_graph  # noqa: E402
from amanda.ir import Graph  # noqa: E402



def by_name(graph):
    return {op.name: op for op in graph}


def backward_ops(graph):
    return [op for op in graph if op.attrs.get("backward")]


def copy_of(graph):
    """A new tf.Graph imported from ``graph``'s GraphDef (safe to mutate)."""
    copy = tf.Graph()
    with copy.as_default():
        tf.graph_util.import_graph_def(graph.as_graph_def(), name="")
    return copy


def assert_owners_are_forward(graph):
    ops = by_name(graph)
    for op in backward_ops(graph):
        owner = op.attrs["forward_op"]
        assert owner is None or (owner in ops and not ops[owner].attrs.get("backward")), op.name
    unowned = [op.name for op in backward_ops(graph) if op.attrs["forward_op"] is None]
    assert graph.attrs["unowned_backward_ops"] == unowned


# -- (a) Keras ResNet50 in a tf.compat.v1 graph, with tf.compat.v1.gradients ---------------


def test_resnet50_lifts_one_op_per_tf_op_and_maps_conv_gradients(keras_resnet50_graph):
    graph, x, loss, grads = keras_resnet50_graph
    ir = lift_graph(graph)
    ir.verify()
    tf_ops = graph.get_operations()
    assert [op.name for op in ir] == [op.name for op in tf_ops]  # creation order is topological
    assert ir.namespace == default_namespace() == f"tensorflow/{tf.__version__}/graph"
    types = Counter(op.type for op in ir)
    assert types["Conv2D"] == 53
    assert types["Conv2DBackpropFilter"] == 53
    ops = by_name(ir)
    owners = [ops[op.name].attrs["forward_op"] for op in ir if op.type == "Conv2DBackpropFilter"]
    assert all(ops[owner].type == "Conv2D" for owner in owners)
    assert len(set(owners)) == 53  # one per convolution
    assert_owners_are_forward(ir)
    # every gradient op of tf.gradients is under "gradients/"; unowned ones are seeds and AddN
    assert {op.name.split("/")[0] for op in backward_ops(ir)} == {"gradients"}
    unowned = [ops[name] for name in ir.attrs["unowned_backward_ops"]]
    assert {op.type for op in unowned} <= {"Shape", "Fill", "Const"}  # the seed; AddNs are owned
    assert ops["gradients/grad_ys_0"].attrs == {
        **ops["gradients/grad_ys_0"].attrs, "backward": True, "forward_op": None}
    # outputs: TF names, shapes and dtypes
    conv = next(op for op in ir if op.type == "Conv2D")
    tf_conv = graph.get_operation_by_name(conv.name)
    assert conv.outputs[0].name == tf_conv.outputs[0].name
    assert conv.outputs[0].attrs == {"shape": tf_conv.outputs[0].shape.as_list(), "dtype": "float32"}
    assert conv.attrs["strides"] and conv.attrs["padding"] in ("SAME", "VALID")
    assert ops[x.op.name].attrs["shape"] == [1, 64, 64, 3]
    # a Conv2D owns its filter gradient and the shape helpers of its _grad scope
    filter_grad = next(op for op in ir if op.type == "Conv2DBackpropFilter")
    owner = filter_grad.attrs["forward_op"]
    family = {op.type for op in backward_ops(ir) if op.attrs["forward_op"] == owner}
    assert "Conv2DBackpropFilter" in family and len(family) >= 2


def test_resnet50_hash_is_stable_and_changes_when_the_graph_grows(keras_resnet50_graph):
    graph = keras_resnet50_graph[0]
    first = lift_graph(graph).structural_hash()
    assert lift_graph(graph).structural_hash() == first
    copy = copy_of(graph)  # the GraphDef path gives the same IR
    assert lift_graph(copy).structural_hash() == first
    with copy.as_default():
        tf.identity(copy.get_tensor_by_name(keras_resnet50_graph[2].name), name="extra")
    grown = lift_graph(copy)
    grown.verify()
    assert grown.structural_hash() != first
    assert len(grown) == len(graph.get_operations()) + 1


# -- (b) GraphDef ----------------------------------------------------------------------------


def test_graph_def_lifts_like_the_graph(keras_cnn_graph):
    graph = keras_cnn_graph()[0]
    from_graph = lift_graph(graph)
    from_graph.verify()
    graph_def = graph.as_graph_def()
    for source in (graph_def, graph_def.SerializeToString()):
        lifted = lift_graph(source)
        lifted.verify()
        assert lifted.structural_hash() == from_graph.structural_hash()
        assert [op.name for op in lifted] == [op.name for op in from_graph]
    ops = by_name(from_graph)
    convs = [op.name for op in from_graph if op.type == "Conv2D"]
    for op in from_graph:
        if op.type in ("Conv2DBackpropFilter", "Conv2DBackpropInput"):
            assert op.attrs["forward_op"] in convs
        if op.type == "MatMul" and op.attrs.get("backward"):
            assert ops[op.attrs["forward_op"]].type == "MatMul"
    assert_owners_are_forward(from_graph)


def test_graph_def_in_shuffled_order_is_sorted_topologically(keras_cnn_graph):
    graph = keras_cnn_graph()[0]
    graph_def = graph.as_graph_def()
    shuffled = tf.compat.v1.GraphDef()
    shuffled.node.extend(reversed(graph_def.node))
    lifted = lift_graph(shuffled)
    lifted.verify()
    assert sorted(op.name for op in lifted) == sorted(op.name for op in graph.get_operations())


def test_graph_def_fragment_reads_missing_tensors_as_graph_inputs():
    graph = tf.Graph()
    with graph.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [2], name="a")
        b = tf.nn.relu(a, name="b")
        tf.multiply(b, 3.0, name="c")
    nodes = [n for n in graph.as_graph_def().node if n.name != "a"]
    fragment = tf.compat.v1.GraphDef()
    fragment.node.extend(nodes)
    fragment.node[0].input.append("^ghost")  # a control input from outside the fragment
    lifted = lift_graph(fragment)
    lifted.verify()
    assert [t.name for t in lifted.inputs] == ["a:0"]
    ops = by_name(lifted)
    assert ops["b"].inputs[0] is lifted.inputs[0]
    assert ops["c"].outputs[0].attrs["dtype"] == "float32"
    assert [t.name for t in lifted.outputs] == ["c:0"]


def test_cyclic_graph_def_breaks_back_edges():
    """A v1 loop: NextIteration feeds Merge, which runs before it."""
    text = """
    node { name: "c" op: "Const" attr { key: "dtype" value { type: DT_FLOAT } }
           attr { key: "value" value { tensor { dtype: DT_FLOAT tensor_shape {} float_val: 1 } } } }
    node { name: "enter" op: "Enter" input: "c" attr { key: "T" value { type: DT_FLOAT } }
           attr { key: "frame_name" value { s: "loop" } } }
    node { name: "merge" op: "Merge" input: "enter" input: "next"
           attr { key: "T" value { type: DT_FLOAT } } attr { key: "N" value { i: 2 } } }
    node { name: "body" op: "Identity" input: "merge" attr { key: "T" value { type: DT_FLOAT } } }
    node { name: "next" op: "NextIteration" input: "body" attr { key: "T" value { type: DT_FLOAT } } }
    """
    from google.protobuf import text_format

    graph_def = text_format.Parse(text, tf.compat.v1.GraphDef())
    lifted = lift_graph(graph_def)
    lifted.verify()
    assert [op.name for op in lifted] == ["c", "enter", "merge", "body", "next"]
    assert lifted.attrs["back_edges"] == [["merge", "next:0"]]
    merge = by_name(lifted)["merge"]
    assert len(merge.outputs) == 2  # output, value_index
    assert merge.inputs[1] is lifted.inputs[0] and lifted.inputs[0].attrs["back_edge"] == "next:0"


# -- (c) GradientTape inside tf.function ------------------------------------------------------


def test_gradient_tape_ops_are_mapped_to_their_forward_ops():
    model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(4)])
    model.build((None, 8))

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        return loss, tape.gradient(loss, model.trainable_variables)

    concrete = train_step.get_concrete_function(tf.TensorSpec([2, 8], tf.float32))
    lifted = lift_graph(concrete)
    lifted.verify()
    assert [t.name for t in lifted.outputs] == [t.name for t in concrete.graph.outputs]
    ops = by_name(lifted)
    matmuls = [op.name for op in lifted if op.type == "MatMul" and not op.attrs.get("backward")]
    assert len(matmuls) == 2
    tape_matmuls = [op for op in lifted if op.type == "MatMul" and op.name.startswith("gradient_tape/")]
    assert len(tape_matmuls) == 3  # dx of the second layer, dW of both
    for op in tape_matmuls:
        assert op.attrs["backward"] is True
        assert op.attrs["forward_op"] in matmuls
        assert op.name.startswith("gradient_tape/" + op.attrs["forward_op"] + "/")
    assert {op.attrs["forward_op"] for op in tape_matmuls} == set(matmuls)
    for op in lifted:
        if op.type == "BiasAddGrad":
            assert ops[op.attrs["forward_op"]].type == "BiasAdd"
        if op.type == "ReluGrad":
            assert ops[op.attrs["forward_op"]].type == "Relu"
    assert ops["gradient_tape/Mul"].attrs["forward_op"] == "Square"
    assert ops["ones"].attrs == {**ops["ones"].attrs, "backward": True, "forward_op": None}  # the seed
    assert_owners_are_forward(lifted)
    assert not any(op.attrs.get("backward") for op in lifted if op.type in ("Identity", "Placeholder", "NoOp"))


def test_gradient_tape_through_a_nested_function_maps_the_backward_call():
    @tf.function
    def inner(z):
        return tf.nn.relu(z) * 2.0

    w = tf.Variable(tf.ones([3, 3]))

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(inner(tf.matmul(x, w)))
        return tape.gradient(loss, w)

    lifted = lift_graph(train_step.get_concrete_function(tf.TensorSpec([2, 3], tf.float32)))
    lifted.verify()
    calls = [op for op in lifted if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    forward = [op for op in calls if not op.attrs.get("backward")]
    backward = [op for op in calls if op.attrs.get("backward")]
    assert len(forward) == 1 and len(backward) == 1
    assert backward[0].attrs["forward_op"] == forward[0].name
    assert isinstance(backward[0].attrs["f"], Graph) and "__backward_" in backward[0].attrs["f"].name
    assert_owners_are_forward(lifted)


def test_tf_gradients_in_a_name_scope_and_twice():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        with tf.name_scope("model"):
            y = tf.nn.relu(tf.matmul(x, tf.ones([3, 3])))
        loss = tf.reduce_sum(y)
        tf.compat.v1.gradients(loss, x)
        with tf.name_scope("train"):
            tf.compat.v1.gradients(loss, x)
    lifted = lift_graph(graph)
    ops = by_name(lifted)
    relu_grads = [op for op in lifted if op.type == "ReluGrad"]
    assert sorted(op.name.split("/")[0] for op in relu_grads) == ["gradients", "train"]
    assert {op.attrs["forward_op"] for op in relu_grads} == {"model/Relu"}
    assert ops["train/gradients/model/MatMul_grad/MatMul"].attrs["forward_op"] == "model/MatMul"
    assert_owners_are_forward(lifted)
    assert not any(op.attrs.get("backward") for op in lifted if op.name.startswith("model/"))


def test_forward_op_of_reads_tf_gradients_names():
    names = {"conv1/Conv2D", "loss", "gradients/conv1/Conv2D_grad/Conv2DBackpropFilter"}
    assert forward_op_of("gradients/conv1/Conv2D_grad/Conv2DBackpropFilter", names) == "conv1/Conv2D"
    assert forward_op_of("gradients_1/conv1/Conv2D_grad/ShapeN", names) == "conv1/Conv2D"
    assert forward_op_of("scope/gradients/conv1/Conv2D_grad/Conv2DBackpropInput", names) == "conv1/Conv2D"
    assert forward_op_of("gradients/AddN", names) is None
    assert forward_op_of("gradients/grad_ys_0", names) is None
    assert forward_op_of("gradients/missing_grad/Mul", names) is None  # no guessing
    assert forward_op_of("conv1/Conv2D", names) is None
    assert forward_op_of("gradient_tape/conv1/Conv2D/Conv2DBackpropFilter", names) is None
    # second order: the gradient of a gradient op names that gradient op
    second = "gradients_1/gradients/conv1/Conv2D_grad/Conv2DBackpropFilter_grad/Conv2D"
    assert forward_op_of(second, names) == "gradients/conv1/Conv2D_grad/Conv2DBackpropFilter"


# -- (d) function-valued attrs become nested graphs -------------------------------------------


def function_call_graph():
    graph = tf.Graph()
    with graph.as_default():

        @tf.function
        def double_relu(z):
            return tf.nn.relu(z) * 2.0

        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        v = tf.Variable(tf.ones([3]), name="v")
        y = double_relu(x) + v
        tf.while_loop(lambda i: i < 3, lambda i: i + 1, [tf.constant(0)], name="loop")
        tf.cond(tf.reduce_sum(y) > 0, lambda: y * 2.0, lambda: y - 1.0, name="branch")
    return graph


def test_function_call_ops_carry_nested_graphs():
    graph = function_call_graph()
    lifted = lift_graph(graph)
    lifted.verify()
    assert lifted.attrs["unlifted_functions"] == []
    (call,) = [op for op in lifted if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    body = call.attrs["f"]
    assert isinstance(body, Graph)
    assert "double_relu" in body.name
    assert [op.type for op in body] == ["Placeholder", "Relu", "Const", "Mul", "Identity"]
    assert len(body.outputs) == 1 and body.namespace == lifted.namespace
    (loop,) = [op for op in lifted if op.type in ("While", "StatelessWhile")]
    assert isinstance(loop.attrs["cond"], Graph) and isinstance(loop.attrs["body"], Graph)
    assert "Less" in [op.type for op in loop.attrs["cond"]]
    (branch,) = [op for op in lifted if op.type in ("If", "StatelessIf")]
    assert {op.type for op in branch.attrs["then_branch"]} >= {"Mul"}
    assert {op.type for op in branch.attrs["else_branch"]} >= {"Sub"}
    # the GraphDef path lifts the same nested graphs
    assert lift_graph(graph.as_graph_def()).structural_hash() == lifted.structural_hash()


def test_missing_function_is_recorded_not_raised():
    graph_def = function_call_graph().as_graph_def()
    names = [f.signature.name for f in graph_def.library.function if "double_relu" in f.signature.name]
    kept = [f for f in graph_def.library.function if f.signature.name not in names]
    del graph_def.library.function[:]
    graph_def.library.function.extend(kept)
    lifted = lift_graph(graph_def)
    lifted.verify()
    (call,) = [op for op in lifted if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    assert call.attrs["f"] == {"function": names[0], "lifted": False}
    assert lifted.attrs["unlifted_functions"] == names


# -- attrs -------------------------------------------------------------------------------------


def test_attrs_are_json_values_and_big_constants_keep_only_their_type():
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/cpu:0"):
            small = tf.constant([[1, 2], [3, 4]], name="small")
        tf.constant(0.5, shape=[100], name="big")
        tf.constant(["a", "b"], name="words")
        tf.compat.v1.placeholder(tf.float16, [None, 4], name="p")
        tf.compat.v1.placeholder(tf.int64, None, name="unknown")
        tf.cast(small, tf.float32, name="cast")
    lifted = lift_graph(graph)
    ops = by_name(lifted)
    assert ops["small"].attrs["value"] == {"dtype": "int32", "shape": [2, 2], "value": [[1, 2], [3, 4]]}
    assert ops["small"].attrs["dtype"] == "int32"
    assert ops["small"].attrs["device"] == "/device:CPU:0"
    assert "device" not in ops["big"].attrs
    assert ops["big"].attrs["value"] == {"dtype": "float32", "shape": [100]}
    assert ops["words"].attrs["value"]["value"] == ["a", "b"]
    assert ops["p"].attrs["shape"] == [None, 4]
    assert ops["p"].outputs[0].attrs == {"shape": [None, 4], "dtype": "float16"}
    assert ops["unknown"].attrs["shape"] is None
    assert ops["unknown"].outputs[0].attrs == {"shape": None, "dtype": "int64"}
    assert ops["cast"].attrs["SrcT"] == "int32" and ops["cast"].attrs["Truncate"] is False
    json.dumps(lifted.to_json(), allow_nan=False)


def test_control_inputs_become_ir_control_inputs():
    graph = tf.Graph()
    with graph.as_default():
        a = tf.constant(1.0, name="a")
        with tf.control_dependencies([a]):
            tf.constant(2.0, name="b")
    ops = by_name(lift_graph(graph))
    assert ops["b"].control_inputs == (ops["a"],)


def test_rejects_other_objects():
    with pytest.raises(TypeError):
        lift_graph(object())


# -- (e) JSON ----------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["cnn", "function_calls"])
def test_json_round_trip_keeps_the_hash(which, keras_cnn_graph):
    lifted = lift_graph(keras_cnn_graph()[0] if which == "cnn" else function_call_graph())
    data = json.loads(json.dumps(lifted.to_json(), allow_nan=False))
    restored = Graph.from_json(data)
    restored.verify()
    assert restored.structural_hash() == lifted.structural_hash()
    assert [op.name for op in restored] == [op.name for op in lifted]


def test_resnet50_json_round_trip_keeps_the_hash(keras_resnet50_graph):
    lifted = lift_graph(keras_resnet50_graph[0])
    restored = Graph.from_json(json.loads(json.dumps(lifted.to_json())))
    assert restored.structural_hash() == lifted.structural_hash()


# -- GradientTape mapping against TensorFlow's own record --------------------------------------


@pytest.fixture
def tape_calls():
    """Records, for each gradient function the tape runs, the ops it creates.

    Wraps the gradient function TensorFlow registers for its tapes (restored
    afterwards). Yields a list of ``(forward op type, forward name scope,
    forward op name or None, [names of the ops created])``.
    """
    from tensorflow.python import pywrap_tfe
    from tensorflow.python.eager import backprop
    from tensorflow.python.framework import ops as tf_ops

    calls = []
    original = backprop._gradient_function

    def recording(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads, skip, scope):
        graph = tf_ops.get_default_graph()
        before = len(graph.get_operations())
        result = original(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads, skip, scope)
        known = [t for t in (outputs or ()) if t is not None and hasattr(t, "op")]
        created = [op.name for op in graph.get_operations()[before:]]
        calls.append((op_name, scope, known[0].op.name if known else None, created))
        return result

    pywrap_tfe.TFE_Py_RegisterGradientFunction(recording)
    try:
        yield calls
    finally:
        pywrap_tfe.TFE_Py_RegisterGradientFunction(original)


def test_gradient_tape_owners_agree_with_the_tape(tape_calls):
    model = tf.keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10)

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    lifted = lift_graph(train_step.get_concrete_function(tf.TensorSpec([2, 32, 32, 3], tf.float32)))
    lifted.verify()
    ops = by_name(lifted)
    created = {}
    for op_type, scope, forward, names in tape_calls:
        for name in names:
            created[name] = (op_type, scope, forward)
    assert len(created) > 1000
    mapped = 0
    for name, (op_type, scope, forward) in created.items():
        op = ops[name]
        assert op.attrs["backward"] is True, name
        owner = op.attrs["forward_op"]
        if owner is None:
            continue
        mapped += 1
        if forward is not None:
            assert owner == forward, name
        else:  # the tape kept no outputs: check the type and the name scope
            assert ops[owner].type == op_type, name
            assert scope in (owner, owner.rpartition("/")[0]), name
    assert mapped / len(created) > 0.75
    for op in lifted:  # every weight gradient kernel has its forward op
        if op.type in ("Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter", "BiasAddGrad"):
            assert op.attrs["forward_op"] is not None, op.name
    assert_owners_are_forward(lifted)


# -- (d) gradient plumbing: AddN, constant shape arithmetic, dead ops ---------------------

_GRAD_SCOPE = __import__("re").compile(r"(.+)_grad(_\d+)?\Z")


def _as_if_taped(ir):
    """Renames the ``tf.gradients`` ops of ``ir`` the way a GradientTape names them.

    ``gradients/<scope>/<op>_grad/<name>`` becomes ``gradient_tape/<scope>/<name>``
    (the forward op's name scope, as the tape's gradient functions run in it),
    aggregations and seeds leave the ``gradients`` scope. The owners the names
    gave are the truth; the attrs are cleared and mapped again from the tape-style
    names. Returns ``{new name: true owner}``.
    """
    from amanda.frontends.tensorflow import map_gradients

    truth, taken = {}, {op.name for op in ir if not op.attrs.get("backward")}
    for op in [op for op in ir if op.attrs.get("backward")]:
        comps = op.name.split("/")
        rest = comps[comps.index("gradients") + 1 :]
        k = next((j for j, c in enumerate(rest[:-1]) if _GRAD_SCOPE.match(c)), None)
        base = "/".join(["gradient_tape"] + rest[:k] + [rest[-1]]) if k is not None else "seed_" + rest[-1]
        if rest[-1].startswith("AddN"):
            base = rest[-1]
        name, n = base, 0
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        truth[name] = op.attrs["forward_op"]
        op.name = name
        del op.attrs["backward"], op.attrs["forward_op"]
    map_gradients(ir)
    return truth


def test_tape_style_owners_are_never_wrong(keras_resnet50_graph):
    """By difference: ResNet50's ``tf.gradients`` ops, whose names give their owners,
    renamed as a GradientTape names them; the tape rules must give the same owner or
    none, never another op."""
    ir = lift_graph(keras_resnet50_graph[0])
    truth = _as_if_taped(ir)
    got = {op.name: op.attrs.get("forward_op") for op in ir if op.name in truth}
    wrong = [(name, truth[name], got[name]) for name in truth if got[name] not in (truth[name], None)]
    assert wrong == []
    owned = sum(got[name] is not None for name in truth)
    assert owned > len(truth) / 2


def _tape_training_step_ir(model, shape):
    optimizer = tf.keras.optimizers.SGD(0.01)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return lift_graph(step.get_concrete_function(tf.TensorSpec(shape), tf.TensorSpec([shape[0]], tf.int32)))


@pytest.mark.slow
def test_tape_gradient_plumbing_of_mobilenet_is_owned():
    """MobileNetV2 training step in a tf.function: 20% of its gradient ops had no
    owner (shape constants, AddN aggregations, dead shape arithmetic); now only the
    seed and the batch-norm parameter reshapes (two candidates, documented) are left.
    Every owner lies in the layer its gradient op's name scope names."""
    model = tf.keras.applications.MobileNetV2(weights=None, alpha=0.35, input_shape=(32, 32, 3), classes=10)
    ir = _tape_training_step_ir(model, [2, 32, 32, 3])
    assert_owners_are_forward(ir)
    backward = backward_ops(ir)
    unowned = [op for op in backward if op.attrs["forward_op"] is None]
    assert len(unowned) < 0.06 * len(backward)
    assert {op.type for op in unowned} <= {"Const", "Reshape"}
    assert [op.name for op in unowned if not op.name.startswith("gradient_tape/")] == ["ones"]
    for op in backward:
        owner = op.attrs["forward_op"]
        if owner is not None and op.name.startswith("gradient_tape/"):
            layer = "/".join(owner.split("/")[:-1][:2])  # <model>/<layer> of the forward op
            assert op.name.startswith("gradient_tape/" + layer), (op.name, owner)
    addn = [op for op in backward if op.type == "AddN"]
    assert addn and all(op.attrs["forward_op"] is not None for op in addn)


@pytest.mark.parametrize("taped", [False, True])
def test_an_aggregated_gradient_belongs_to_the_producer_of_the_summed_tensor(taped):
    """h = x @ W + b is read by two ops; the AddN summing their gradients is read by
    BiasAdd's gradient and (passed through) MatMul's: it belongs to BiasAdd, the op
    that produced h."""
    w = tf.Variable(tf.ones([3, 4]))
    b = tf.Variable(tf.zeros([4]))

    def loss_of(x):
        h = tf.nn.bias_add(tf.matmul(x, w), b)
        return tf.reduce_sum(tf.nn.relu(h) + tf.square(h))

    if taped:
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = loss_of(x)
            return tape.gradient(loss, [w, b])

        ir = lift_graph(step.get_concrete_function(tf.TensorSpec([2, 3])))
    else:
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [2, 3])
            w, b = tf.compat.v1.Variable(tf.ones([3, 4])), tf.compat.v1.Variable(tf.zeros([4]))
            tf.compat.v1.gradients(loss_of(x), [w, b])
        ir = lift_graph(graph)
    ops = by_name(ir)
    addn = [op for op in ir if op.type == "AddN" and op.attrs.get("backward")]
    assert len(addn) == 1
    assert ops[addn[0].attrs["forward_op"]].type == "BiasAdd"
    assert_owners_are_forward(ir)
