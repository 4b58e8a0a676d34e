"""JSON round trips, attribute encoding and format errors."""

import json
import math

import pytest

from amanda.ir import Graph, IRError, graph_from_json, graph_to_json, structural_hash
from amanda.ir.attrs import OpaqueAttr


def sample_graph():
    g = Graph("main", namespace="pytorch/2.13.0/eager", attrs={"opset": 21})
    x = g.add_input("x", shape=[1, 3], dtype="float32")
    w = g.add_input("w")
    mm = g.create_op("matmul", [x, w], attrs={"transpose": False, "alpha": 0.5, "tag": None})
    split = g.create_op("split", mm.outputs, num_outputs=2, namespace="onnx/21/graph", control_inputs=[mm])
    split.outputs[1].attrs["shape"] = [1, 1]
    g.create_op("print", [split.outputs[1]], num_outputs=0, attrs={"meta": {"a": [1, {"b": "c"}]}})
    g.set_outputs([split.outputs[0], x])
    return g


def round_trip(graph):
    return graph_from_json(json.loads(json.dumps(graph_to_json(graph), allow_nan=False)))


def test_round_trip_preserves_everything():
    g = sample_graph()
    data = graph_to_json(g)
    assert data["format"] == "amanda.ir.graph" and data["format_version"] == 1
    back = round_trip(g)
    assert str(back) == str(g)
    assert structural_hash(back) == structural_hash(g)
    assert graph_to_json(back) == data
    assert back.name == "main" and back.namespace == g.namespace and back.attrs == {"opset": 21}
    assert [op.name for op in back] == [op.name for op in g]
    assert [op.attrs for op in back] == [op.attrs for op in g]
    assert back.inputs[0].attrs == {"shape": [1, 3], "dtype": "float32"}
    assert back.ops[1].outputs[1].attrs == {"shape": [1, 1]}
    assert back.ops[1].control_inputs == (back.ops[0],)
    assert [t.name for t in back.outputs] == [t.name for t in g.outputs]
    back.verify()


def test_methods_match_functions():
    g = sample_graph()
    assert g.to_json() == graph_to_json(g)
    assert str(Graph.from_json(g.to_json())) == str(g)


def test_nested_graphs_round_trip():
    body = Graph("body")
    i = body.add_input("i")
    body.set_outputs(body.create_op("add", [i, i]).outputs)
    g = Graph("outer")
    x = g.add_input("x")
    g.create_op("loop", [x], attrs={"body": body, "branches": [body, {"else": body}]})
    back = round_trip(g)
    loop = back.ops[0]
    assert isinstance(loop.attrs["body"], Graph) and str(loop.attrs["body"]) == str(body)
    assert isinstance(loop.attrs["branches"][1]["else"], Graph)
    assert structural_hash(back) == structural_hash(g)
    assert "body = graph body(%i) {" in str(g)
    back.verify()


def test_non_json_values_use_the_repr_marker():
    g = Graph()

    class Thing:
        def __repr__(self):
            return "Thing()"

    op = g.create_op("custom", attrs={"thing": Thing(), "pair": (1, 2), "blob": b"\x00", "ints": {1: "a"}})
    data = graph_to_json(g)
    assert data["ops"][0]["attrs"] == {
        "thing": {"$repr": "Thing()"},
        "pair": [1, 2],
        "blob": {"$repr": "b'\\x00'"},
        "ints": {"$repr": "{1: 'a'}"},
    }
    back = round_trip(g)
    attrs = back.ops[0].attrs
    assert attrs["thing"] == OpaqueAttr("Thing()") and repr(attrs["thing"]) == "Thing()"
    assert attrs["pair"] == [1, 2]  # tuples come back as lists
    assert structural_hash(back) == structural_hash(g)
    assert str(back) == str(g)
    assert op.attrs["pair"] == (1, 2)


def test_non_finite_floats_and_marker_like_dicts_round_trip():
    g = Graph()
    floats = {"nan": math.nan, "inf": math.inf, "ninf": -math.inf}
    g.create_op("c", attrs=dict(floats, d={"$graph": 1}, e={"$x": 1, "y": 2}))
    text = json.dumps(graph_to_json(g), allow_nan=False)  # strict JSON
    attrs = graph_from_json(json.loads(text)).ops[0].attrs
    assert math.isnan(attrs["nan"]) and attrs["inf"] == math.inf and attrs["ninf"] == -math.inf
    assert attrs["d"] == {"$graph": 1} and attrs["e"] == {"$x": 1, "y": 2}


def test_unicode_and_odd_names_round_trip():
    g = Graph("g 1")
    x = g.add_input("in:0 ü")
    op = g.create_op("op", [x], name='we"ird\nname', attrs={"ключ": "значение"})
    g.set_outputs(op.outputs)
    back = round_trip(g)
    assert back.ops[0].name == 'we"ird\nname' and back.inputs[0].name == "in:0 ü"
    assert str(back) == str(g)


def test_wrong_format_or_version_is_refused():
    data = graph_to_json(sample_graph())
    with pytest.raises(IRError, match="not an amanda IR graph"):
        graph_from_json({"format": "onnx"})
    with pytest.raises(IRError, match="unsupported amanda IR format version 99"):
        graph_from_json(dict(data, format_version=99))


def test_dangling_references_are_refused():
    data = graph_to_json(sample_graph())
    data["ops"][1]["inputs"] = ["missing"]
    with pytest.raises(IRError, match="unknown name 'missing'"):
        graph_from_json(data)
    data = graph_to_json(sample_graph())
    del data["ops"][0]["type"]
    with pytest.raises(IRError, match="malformed"):
        graph_from_json(data)
    data = graph_to_json(sample_graph())
    data["ops"][0]["attrs"] = {"x": {"$bogus": 1}}
    with pytest.raises(IRError, match="unknown attribute marker"):
        graph_from_json(data)


def test_duplicate_names_are_refused_on_write():
    g = sample_graph()
    g.ops[1]._name = g.ops[0].name
    with pytest.raises(IRError, match="two ops are named"):
        graph_to_json(g)
