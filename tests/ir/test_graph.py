"""Unit tests for building and mutating graphs: every verb, including refusals."""

import pytest

from amanda.ir import Graph, IRError, Op, Tensor, VerificationError

from .strategies import assert_use_def, snapshot


@pytest.fixture
def conv_graph():
    """x, w, b -> conv2d -> relu -> output."""
    g = Graph("main", namespace="pytorch/2.13.0/eager")
    x, w, b = g.add_input("x", shape=[1, 3, 8, 8]), g.add_input("w"), g.add_input("b")
    conv = g.create_op("conv2d", [x, w, b], attrs={"stride": [1, 1]})
    relu = g.create_op("relu", conv.outputs)
    g.set_outputs(relu.outputs)
    return g


def test_errors_hierarchy():
    assert issubclass(VerificationError, IRError)
    assert issubclass(IRError, Exception)


def test_add_input_sets_index_attrs_and_names():
    g = Graph()
    a, b, c = g.add_input("a", dtype="float32"), g.add_input(), g.add_input("a")
    assert g.inputs == (a, b, c)
    assert [t.index for t in g.inputs] == [0, 1, 2]
    assert a.attrs == {"dtype": "float32"} and a.producer is None and a.graph is g
    assert (a.name, b.name, c.name) == ("a", "0", "a_1")


def test_create_op_wires_outputs_and_uses(conv_graph):
    conv, relu = conv_graph.ops
    x, w, b = conv_graph.inputs
    assert isinstance(conv, Op) and isinstance(conv.outputs[0], Tensor)
    assert conv.inputs == (x, w, b)
    assert conv.namespace == "pytorch/2.13.0/eager"
    assert conv.outputs[0].producer is conv and conv.outputs[0].index == 0
    assert x.uses == ((conv, 0),)
    assert conv.outputs[0].uses == ((relu, 0),)
    assert conv.users == (relu,)
    assert relu.users == ()
    assert conv.control_inputs == ()
    assert conv.graph is conv_graph


def test_op_repr_reads_like_python():
    g = Graph(namespace="pytorch/2.13.0/eager")
    inputs = [g.add_input() for _ in range(3)]
    conv = g.create_op("conv2d", inputs, attrs={"stride": [1, 1]})
    assert repr(conv) == "%3 = pytorch::conv2d(%0, %1, %2) {stride: [1, 1]}"
    assert repr(conv.outputs[0]) == "<Tensor %3: output of 'conv2d' #0>"


def test_repr_shows_foreign_namespace_in_full_and_no_outputs():
    g = Graph(namespace="pytorch/2.13.0/eager")
    x = g.add_input("x")
    op = g.create_op("Print", [x], num_outputs=0, namespace="onnx/21/graph", attrs={"tag": "a"})
    assert repr(op) == "onnx/21/graph::Print(%x) {tag: 'a'}"
    bare = g.create_op("split", [x], num_outputs=2, namespace="", control_inputs=[op])
    assert repr(bare) == "%0, %1 = split(%x) after(Print)"


def test_str_prints_every_op_on_its_own_line(conv_graph):
    text = str(conv_graph)
    assert text.splitlines() == [
        "graph main(%x, %w, %b) [namespace: 'pytorch/2.13.0/eager'] {",
        "  %0 = pytorch::conv2d(%x, %w, %b) {stride: [1, 1]}  # conv2d",
        "  %1 = pytorch::relu(%0)  # relu",
        "  return %1",
        "}",
    ]


def test_op_and_tensor_names_are_unique():
    g = Graph()
    x = g.add_input("x")
    ops = [g.create_op("relu", [x]) for _ in range(3)]
    assert [op.name for op in ops] == ["relu", "relu_1", "relu_2"]
    named = g.create_op("relu", [x], name="relu", output_names=["y"])
    assert named.name == "relu_3" and named.outputs[0].name == "y"
    assert g.create_op("relu", [x], output_names=["y"]).outputs[0].name == "y_1"


def test_rename_checks_uniqueness():
    g = Graph()
    x, y = g.add_input("x"), g.add_input("y")
    op = g.create_op("relu", [x], name="r")
    with pytest.raises(IRError):
        y.name = "x"
    assert y.name == "y"
    x.name = "input"
    y.name = "x"  # freed by the rename above
    op.name = "activation"
    assert g.create_op("relu", [x], name="r").name == "r"
    with pytest.raises(IRError):
        op.name = "r"
    g.verify()


def test_create_op_rejects_foreign_inputs_and_changes_nothing():
    g, other = Graph(), Graph()
    x, foreign = g.add_input("x"), other.add_input("f")
    before = snapshot(g)
    with pytest.raises(IRError, match="does not belong"):
        g.create_op("add", [x, foreign])
    with pytest.raises(IRError):
        g.create_op("add", [x, "not a tensor"])
    with pytest.raises(IRError, match="output names"):
        g.create_op("split", [x], num_outputs=2, output_names=["a"])
    with pytest.raises(IRError, match="control input"):
        g.create_op("add", [x], control_inputs=[other.create_op("c")])
    with pytest.raises(IRError, match="names must be str"):
        g.create_op("add", [x], output_names=[3])
    with pytest.raises(IRError, match="op type"):
        g.create_op(None, [x])
    assert snapshot(g) == before and x.uses == ()


def test_replace_input_with_updates_uses(conv_graph):
    conv, relu = conv_graph.ops
    x, w, b = conv_graph.inputs
    conv.replace_input_with(2, x)
    assert conv.inputs == (x, w, x)
    assert b.uses == ()
    assert set(x.uses) == {(conv, 0), (conv, 2)}
    conv.replace_input_with(-1, b)
    assert conv.inputs == (x, w, b) and b.uses == ((conv, 2),)
    assert_use_def(conv_graph)
    conv_graph.verify()


def test_replace_input_with_refuses_bad_position_and_foreign_tensor(conv_graph):
    conv = conv_graph.ops[0]
    foreign = Graph().add_input("f")
    before = snapshot(conv_graph)
    with pytest.raises(IRError, match="no input 3"):
        conv.replace_input_with(3, conv_graph.inputs[0])
    with pytest.raises(IRError, match="does not belong"):
        conv.replace_input_with(0, foreign)
    assert snapshot(conv_graph) == before


def test_set_inputs_replaces_and_resizes(conv_graph):
    conv, relu = conv_graph.ops
    x, w, b = conv_graph.inputs
    conv.set_inputs([w, w])
    assert conv.inputs == (w, w)
    assert x.uses == () and b.uses == ()
    assert w.uses == ((conv, 0), (conv, 1))
    before = snapshot(conv_graph)
    with pytest.raises(IRError):
        conv.set_inputs([x, Graph().add_input()])
    assert snapshot(conv_graph) == before
    assert_use_def(conv_graph)


def test_set_control_inputs_tracks_control_users(conv_graph):
    conv, relu = conv_graph.ops
    relu.set_control_inputs([conv])
    assert relu.control_inputs == (conv,) and conv.control_users == (relu,)
    relu.set_control_inputs([])
    assert conv.control_users == ()
    with pytest.raises(IRError):
        relu.set_control_inputs([relu])


def test_replace_all_uses_with_rewires_ops_and_graph_outputs(conv_graph):
    conv, relu = conv_graph.ops
    y = conv.outputs[0]
    with conv_graph.inserting_after(conv):
        obs = conv_graph.create_op("observe", [y])
    y.replace_all_uses_with(obs.outputs[0])
    # the observer keeps reading y: rewiring it would make it read itself
    assert obs.inputs == (y,) and y.uses == ((obs, 0),)
    assert relu.inputs == (obs.outputs[0],)
    relu.outputs[0].replace_all_uses_with(y)
    assert conv_graph.outputs == (y,)
    conv_graph.verify()


def test_replace_all_uses_with_can_keep_graph_outputs(conv_graph):
    relu = conv_graph.ops[1]
    out = relu.outputs[0]
    out.replace_all_uses_with(conv_graph.inputs[0], replace_graph_outputs=False)
    assert conv_graph.outputs == (out,)


def test_replace_all_uses_with_refuses_foreign(conv_graph):
    before = snapshot(conv_graph)
    with pytest.raises(IRError):
        conv_graph.inputs[0].replace_all_uses_with(Graph().add_input())
    assert snapshot(conv_graph) == before


def test_inserting_before_and_after_keep_order_and_nest(conv_graph):
    conv, relu = conv_graph.ops
    x = conv_graph.inputs[0]
    with conv_graph.inserting_after(conv):
        a = conv_graph.create_op("a", [x])
        b = conv_graph.create_op("b", [x])
        with conv_graph.inserting_before(conv):
            c = conv_graph.create_op("c", [x])
            d = conv_graph.create_op("d", [x])
        e = conv_graph.create_op("e", [x])
    f = conv_graph.create_op("f", [x])
    # after the inner block the outer cursor resumes where it stopped (after b)
    assert [op.name for op in conv_graph] == ["c", "d", "conv2d", "a", "b", "e", "relu", "f"]
    assert conv_graph.ops == [c, d, conv, a, b, e, relu, f]
    conv_graph.verify()


def test_inserting_cursor_is_restored_after_an_exception(conv_graph):
    conv = conv_graph.ops[0]
    with pytest.raises(RuntimeError):
        with conv_graph.inserting_before(conv):
            raise RuntimeError
    last = conv_graph.create_op("last")
    assert conv_graph.ops[-1] is last


def test_inserting_refuses_foreign_or_removed_anchor(conv_graph):
    with pytest.raises(IRError):
        with conv_graph.inserting_after(Graph().create_op("x")):
            pass
    g = Graph()
    x = g.add_input("x")
    op = g.create_op("a")
    with pytest.raises(IRError, match="no longer"):
        with g.inserting_before(op):
            g.remove_op(op)
            g.create_op("b", [x])
    assert len(g) == 0 and x.uses == ()  # the refused op left no trace
    assert g.create_op("b").name == "b"


def test_remove_op_drops_uses_and_detaches(conv_graph):
    conv, relu = conv_graph.ops
    dead = conv_graph.create_op("dead", [conv.outputs[0], conv_graph.inputs[0]])
    conv_graph.remove_op(dead)
    assert dead.graph is None and dead.outputs[0].graph is None and dead.inputs == ()
    assert conv.outputs[0].uses == ((relu, 0),)
    assert conv_graph.inputs[0].uses == ((conv, 0),)
    assert len(conv_graph) == 2 and dead not in conv_graph
    conv_graph.create_op("dead")  # the name was freed
    conv_graph.verify()


def test_remove_op_refuses_used_op_and_leaves_graph_unchanged(conv_graph):
    conv = conv_graph.ops[0]
    before = snapshot(conv_graph)
    with pytest.raises(IRError, match="still used by op 'relu'") as info:
        conv_graph.remove_op(conv)
    assert type(info.value) is IRError
    assert snapshot(conv_graph) == before
    assert conv.graph is conv_graph
    conv_graph.verify()


def test_remove_op_refuses_graph_outputs_control_users_and_strangers(conv_graph):
    conv, relu = conv_graph.ops
    before = snapshot(conv_graph)
    with pytest.raises(IRError, match="graph output"):
        conv_graph.remove_op(relu)
    side = conv_graph.create_op("side", num_outputs=0)
    conv_graph.create_op("after_side", num_outputs=0, control_inputs=[side])
    with pytest.raises(IRError, match="control input"):
        conv_graph.remove_op(side)
    with pytest.raises(IRError, match="not an op"):
        Graph().remove_op(conv)
    assert conv_graph.ops[:2] == [conv, relu]
    assert snapshot(conv_graph)[2] == before[2]


def test_replace_op_rewires_then_removes(conv_graph):
    conv, relu = conv_graph.ops
    with conv_graph.inserting_before(relu):
        fused = conv_graph.create_op("conv_relu", conv.inputs)
    conv_graph.replace_op(relu, fused.outputs)
    conv_graph.remove_op(conv)
    assert conv_graph.ops == [fused]
    assert conv_graph.outputs == fused.outputs
    conv_graph.verify()


def test_replace_op_refuses_bad_replacements_and_changes_nothing(conv_graph):
    conv, relu = conv_graph.ops
    before = snapshot(conv_graph)
    with pytest.raises(IRError, match="1 outputs but 2"):
        conv_graph.replace_op(conv, [conv_graph.inputs[0]] * 2)
    with pytest.raises(IRError, match="own outputs"):
        conv_graph.replace_op(conv, conv.outputs)
    with pytest.raises(IRError, match="cycle"):
        conv_graph.replace_op(conv, relu.outputs)
    with pytest.raises(IRError, match="does not belong"):
        conv_graph.replace_op(conv, [Graph().add_input()])
    assert snapshot(conv_graph) == before


def test_set_outputs_refuses_foreign(conv_graph):
    with pytest.raises(IRError):
        conv_graph.set_outputs([Graph().add_input()])
    assert conv_graph.outputs == conv_graph.ops[1].outputs
    assert conv_graph.outputs[0].is_graph_output


def test_iteration_is_over_a_snapshot(conv_graph):
    conv, relu = conv_graph.ops
    seen = []
    for op in conv_graph:
        seen.append(op.name)
        if op is conv:
            conv_graph.create_op("appended")  # not visited
            relu.outputs[0].replace_all_uses_with(conv.outputs[0])
            conv_graph.remove_op(relu)  # removed before reached: skipped
    assert seen == ["conv2d"]
    assert [op.name for op in conv_graph] == ["conv2d", "appended"]


def test_find_by_type_and_namespace_prefix():
    g = Graph(namespace="pytorch/2.13.0/eager")
    x = g.add_input()
    a = g.create_op("relu", [x])
    b = g.create_op("relu", [x], namespace="onnx/21/graph")
    c = g.create_op("add", [x, x])
    assert list(g.find(type="relu")) == [a, b]
    assert list(g.find(namespace="pytorch")) == [a, c]
    assert list(g.find(namespace="pytorch/2.13.0")) == [a, c]
    assert list(g.find(namespace="pyt")) == []
    assert list(g.find(type="relu", namespace="onnx")) == [b]
    assert list(g.find()) == [a, b, c]


def test_len_bool_and_contains():
    g = Graph()
    assert len(g) == 0 and bool(g)
    op = g.create_op("a")
    assert len(g) == 1 and op in g and "a" not in g


def test_copy_is_deep_and_equal(conv_graph):
    conv_graph.ops[0].attrs["nested"] = {"k": [1]}
    clone = conv_graph.copy()
    assert str(clone) == str(conv_graph)
    assert clone.structural_hash() == conv_graph.structural_hash()
    assert [op.name for op in clone] == [op.name for op in conv_graph]
    assert all(a is not b for a, b in zip(clone.ops, conv_graph.ops))
    assert clone.ops[0].attrs is not conv_graph.ops[0].attrs
    assert clone.ops[0].attrs["nested"] is conv_graph.ops[0].attrs["nested"]  # shallow
    assert clone.inputs[0].attrs == {"shape": [1, 3, 8, 8]}
    clone.ops[0].attrs["stride"] = [2, 2]
    clone.create_op("extra", clone.outputs)
    assert conv_graph.ops[0].attrs["stride"] == [1, 1] and len(conv_graph) == 2
    clone.verify()
    assert_use_def(clone)


def test_copy_copies_nested_graphs_and_control_inputs():
    body = Graph("body")
    body.set_outputs([body.add_input("i")])
    g = Graph()
    a = g.create_op("a", num_outputs=0)
    loop = g.create_op("loop", attrs={"body": body, "branches": [body, 1]}, control_inputs=[a])
    clone = g.copy()
    new_loop = clone.ops[1]
    assert new_loop.attrs["body"] is not body and str(new_loop.attrs["body"]) == str(body)
    assert new_loop.attrs["branches"][0] is not body and new_loop.attrs["branches"][1] == 1
    assert new_loop.control_inputs == (clone.ops[0],)
    assert loop.control_inputs == (a,)
    assert clone.structural_hash() == g.structural_hash()


def test_removed_op_and_its_outputs_are_refused(conv_graph):
    dead = conv_graph.create_op("dead")
    conv_graph.remove_op(dead)
    with pytest.raises(IRError, match="removed"):
        dead.set_inputs([conv_graph.inputs[0]])
    with pytest.raises(IRError, match="removed"):
        dead.replace_input_with(0, conv_graph.inputs[0])
    with pytest.raises(IRError, match="does not belong"):
        conv_graph.create_op("uses_dead", dead.outputs)
