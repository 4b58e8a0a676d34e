"""Readable drawings of traced graphs (amanda.tools.graph_view, `amanda graph`)."""

import re

import pytest

pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda.cli import main  # noqa: E402
from amanda.models import load  # noqa: E402
from amanda.tools import graph_view  # noqa: E402
from amanda.tools.graph import GraphTracingTool  # noqa: E402

DEEP = '''
import torch
from torch import nn
from block import Block        # a sibling module of this file

class Deep(nn.Module):
    def __init__(self, layers=20, width=16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

def build():
    return Deep(), torch.rand(2, 16)
'''

BLOCK = '''
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.relu(self.norm(self.fc(x)))
'''


def _traced(spec):
    work = load(spec)
    tracer = GraphTracingTool()
    with amanda.apply(tracer):
        work.run()
    graph_view.name_parameters(tracer.graph, work.model)
    return tracer.graph


@pytest.fixture(scope="module")
def cnn_view():
    return graph_view.build_view(_traced("cnn"))


def test_labels_name_types_modules_parameters_and_shapes(cnn_view):
    first = next(n for n in cnn_view.nodes.values() if n.kind == "forward")
    assert first.label == ["conv2d", "conv_layer1", "weight 32x3x3x3", "bias 32"]
    dot = graph_view.to_dot(cnn_view, title="cnn")
    assert "%parameter" not in dot and '{"args"' not in dot
    assert 'label="1x32x30x30"' in dot            # conv_layer1 -> conv_layer2
    assert 'label="1x1600"' in dot


def test_forward_and_backward_are_styled_apart(cnn_view):
    kinds = {n.kind for n in cnn_view.nodes.values()}
    assert {"forward", "backward", "input"} <= kinds
    dot = graph_view.to_dot(cnn_view)
    backward = [line for line in dot.splitlines() if "ConvolutionBackward0" in line]
    assert len(backward) == 4 and all(graph_view.BACKWARD_FILL in line for line in backward)
    assert 'subgraph "cluster_backward"' in dot


def test_twenty_repeated_blocks_collapse_and_stay_small(tmp_path):
    (tmp_path / "block.py").write_text(BLOCK)
    (tmp_path / "deep.py").write_text(DEEP)
    graph = _traced(f"{tmp_path / 'deep.py'}:build")
    view = graph_view.build_view(graph)
    assert len(graph.ops) > 250 and len(view.nodes) < 30
    collapsed = [n for n in view.nodes.values() if n.kind == "collapsed"]
    assert [n.label[:2] for n in collapsed] == [["blocks.1 … blocks.19",
                                                  "×19, each like blocks.0"]]
    assert len(collapsed[0].ops) == 19 * 4
    full = graph_view.build_view(graph, collapse=False)
    assert len(full.nodes) > 250
    page = graph_view.to_html(view, title="deep")
    assert page.startswith("<!DOCTYPE html>") and "<script" in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert page.count("<rect") == len(view.nodes)


def test_an_rnn_backward_strip_becomes_one_box():
    view = graph_view.build_view(_traced("rnn"))
    assert len(view.nodes) < 10
    summary = [n for n in view.nodes.values() if n.label[0] == "backward of rnn_tanh"]
    assert len(summary) == 1 and "TanhBackward0 ×64" in summary[0].label[1]


def test_graph_command_writes_svg_or_html_without_dot(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(graph_view.shutil, "which", lambda name: None)
    assert main(["graph", "cnn", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "writing graph.html instead of graph.svg" in captured.err
    assert (tmp_path / "graph.html").exists() and not (tmp_path / "graph.svg").exists()
    assert "drawing: 37 boxes for 36 ops" in captured.out


def test_graph_command_draws_svg_with_graphviz(tmp_path):
    if graph_view.shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed")
    assert main(["graph", "cnn", "--forward-only", "--out", str(tmp_path)]) == 0
    svg = (tmp_path / "graph.svg").read_text()
    assert "<svg" in svg and "conv_layer1" in svg and "Backward" not in svg


def test_tf_initialisers_are_hidden_by_default():
    pytest.importorskip("tensorflow")
    from amanda.frontends.tensorflow import lift_graph
    graph = lift_graph(load("keras:cnn").model.graph)
    view = graph_view.build_view(graph)
    names = [op.name for n in view.nodes.values() for op in n.ops]
    assert not any("Initializer" in name or "IsInitialized" in name for name in names)
    assert view.hidden > 100
    conv = next(n for n in view.nodes.values() if n.label[0] == "Conv2D")
    assert re.search(r"kernel 3x3x3x32", " ".join(conv.label))
    shown = graph_view.build_view(graph, show_init=True)
    assert len(shown.nodes) > len(view.nodes)
