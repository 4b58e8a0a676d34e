"""networkx and DOT views, and the promise that importing amanda.ir stays light."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from amanda.ir import Graph, to_dot, to_networkx

REPO_ROOT = Path(__file__).resolve().parents[2]


def diamond():
    g = Graph("diamond", namespace="onnx/21/graph")
    x = g.add_input("x")
    a = g.create_op("relu", [x], name="a")
    b = g.create_op("neg", a.outputs, name="b")
    c = g.create_op("add", [a.outputs[0], b.outputs[0], a.outputs[0]], name="c", control_inputs=[b], attrs={"k": [1]})
    g.set_outputs(c.outputs)
    return g


def dot_quoted(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def test_to_networkx_nodes_and_edges():
    pytest.importorskip("networkx")
    view = to_networkx(diamond())
    assert sorted(view.nodes) == ["a", "b", "c"]
    assert view.nodes["c"] == {"type": "add", "namespace": "onnx/21/graph", "attrs": {"k": [1]}}
    # x feeds a from a graph input, so no edge; a feeds c twice: two parallel edges
    assert view.number_of_edges() == 4
    assert view.number_of_edges("a", "c") == 2
    slots = sorted((d["input_position"], d["output_index"], d["tensor"]) for _, _, d in view.in_edges("c", data=True))
    assert slots == [(0, 0, "0"), (1, 0, "1"), (2, 0, "0")]
    assert view.graph["inputs"] == ["x"] and view.graph["outputs"] == ["2"]


def test_to_networkx_control_edges_are_optional():
    pytest.importorskip("networkx")
    view = to_networkx(diamond(), control_edges=True)
    assert view.number_of_edges() == 5
    assert [d["kind"] for _, _, d in view.edges(data=True)].count("control") == 1


def test_to_dot_mentions_every_op_and_quotes_names():
    g = diamond()
    g.create_op("odd", [g.inputs[0]], name='say "hi"\\now', num_outputs=0)
    dot = to_dot(g)
    assert dot.startswith('digraph "diamond" {') and dot.rstrip().endswith("}")
    for op in g:
        assert dot_quoted("op:" + op.name) in dot
    assert '"op:say \\"hi\\"\\\\now"' in dot
    # every quoted string is closed: stripping them leaves no stray quote
    assert '"' not in re.sub(r'"(?:[^"\\]|\\.)*"', "", dot)
    assert dot.count("->") == 6 + 1 + 1  # data edges, one control edge, one output edge
    assert "style=dashed" in dot


def test_importing_amanda_ir_is_light():
    heavy = ("torch", "tensorflow", "onnx", "networkx")
    code = f"import sys, amanda.ir; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_to_dot_is_accepted_by_graphviz_when_installed():
    dot_binary = shutil.which("dot")
    if dot_binary is None:
        pytest.skip("Graphviz is not installed")
    g = diamond()
    g.create_op("odd", [g.inputs[0]], name='say "hi"\\now\n2', num_outputs=0)
    subprocess.run([dot_binary, "-Tsvg"], input=to_dot(g), text=True, capture_output=True, check=True)
